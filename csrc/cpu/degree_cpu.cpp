// degree_inv_sqrt on the CPU: the kept edges' counts summed per target in int64, then the per-node formula.
#include "degree_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/to.h>

#include <vector>

namespace pyg_quant {

DegreeInvSqrt degree_inv_sqrt_cpu(const at::Tensor& dst_in, const std::optional<at::Tensor>& keep_in,
                                  const std::optional<at::Tensor>& count_in, const std::optional<at::Tensor>& diag_in,
                                  int64_t num_nodes) {
  check_degree_args(dst_in, keep_in, count_in, diag_in, num_nodes);
  const at::Tensor dst = dst_in.contiguous();
  const at::Tensor keep = keep_in ? keep_in->contiguous() : at::Tensor();
  const at::Tensor count = count_in ? count_in->to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor diag = diag_in ? diag_in->to(at::kFloat).contiguous() : at::Tensor();
  std::vector<int64_t> sums(num_nodes, 0);
  const bool* k = keep.defined() ? keep.const_data_ptr<bool>() : nullptr;
  const int64_t* c = count.defined() ? count.const_data_ptr<int64_t>() : nullptr;
  const int64_t edges = dst.numel();
  AT_DISPATCH_INDEX_TYPES(dst.scalar_type(), "degree_inv_sqrt_cpu", [&] {
    const index_t* d = dst.const_data_ptr<index_t>();
    for (int64_t e = 0; e < edges; ++e) {
      TORCH_CHECK_VALUE(d[e] >= 0 && d[e] < num_nodes, "degree_inv_sqrt: dst holds an index out of [0, ", num_nodes,
                        ")");
      if (k != nullptr && !k[e]) continue;
      sums[d[e]] += c != nullptr ? c[e] : 1;
    }
  });
  at::Tensor deg = at::empty({num_nodes}, dst.options().dtype(at::kFloat)), inv_sqrt = at::empty_like(deg);
  const float* g = diag.defined() ? diag.const_data_ptr<float>() : nullptr;
  float* dp = deg.mutable_data_ptr<float>();
  float* ip = inv_sqrt.mutable_data_ptr<float>();
  for (int64_t i = 0; i < num_nodes; ++i) degree_and_inv_sqrt(sums[i], g, i, dp, ip);
  return {deg, inv_sqrt};
}

}  // namespace pyg_quant
