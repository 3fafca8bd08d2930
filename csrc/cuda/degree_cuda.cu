// degree_inv_sqrt on the GPU: the kept edges' counts summed per target with 64-bit integer atomics (exact in any
// order), then the per-node formula; one op where the composition of torch ops took eleven.
#include "degree_cuda.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

namespace pyg_quant {
namespace {

constexpr int kThreads = 256;

int64_t blocks_for(int64_t n) { return std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)); }

template <typename index_t>
__global__ void degree_sums_kernel(const index_t* __restrict__ dst, const bool* __restrict__ keep,
                                   const int64_t* __restrict__ count, int64_t edges, int64_t num_nodes,
                                   unsigned long long* __restrict__ sums) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < edges;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t node = dst[e];
    CUDA_KERNEL_ASSERT(node >= 0 && node < num_nodes);
    if (node < 0 || node >= num_nodes || (keep != nullptr && !keep[e])) continue;
    atomicAdd(sums + node, static_cast<unsigned long long>(count != nullptr ? count[e] : 1));
  }
}

__global__ void degree_finish_kernel(const unsigned long long* __restrict__ sums, const float* __restrict__ diag,
                                     int64_t num_nodes, float* __restrict__ deg, float* __restrict__ inv_sqrt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_nodes;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    degree_and_inv_sqrt(static_cast<int64_t>(sums[i]), diag, i, deg, inv_sqrt);
  }
}

}  // namespace

DegreeInvSqrt degree_inv_sqrt_cuda(const at::Tensor& dst_in, const std::optional<at::Tensor>& keep_in,
                                   const std::optional<at::Tensor>& count_in, const std::optional<at::Tensor>& diag_in,
                                   int64_t num_nodes) {
  check_degree_args(dst_in, keep_in, count_in, diag_in, num_nodes);
  const c10::cuda::CUDAGuard guard(dst_in.device());
  const at::Tensor dst = dst_in.contiguous();
  const at::Tensor keep = keep_in ? keep_in->contiguous() : at::Tensor();
  const at::Tensor count = count_in ? count_in->to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor diag = diag_in ? diag_in->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor sums = at::zeros({num_nodes}, dst.options().dtype(at::kLong));
  at::Tensor deg = at::empty({num_nodes}, dst.options().dtype(at::kFloat)), inv_sqrt = at::empty_like(deg);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto* sums_ptr = reinterpret_cast<unsigned long long*>(sums.mutable_data_ptr<int64_t>());
  const int64_t edges = dst.numel();
  if (edges > 0) {
    AT_DISPATCH_INDEX_TYPES(dst.scalar_type(), "degree_inv_sqrt_cuda", [&] {
      degree_sums_kernel<index_t><<<blocks_for(edges), kThreads, 0, stream>>>(
          dst.const_data_ptr<index_t>(), keep.defined() ? keep.const_data_ptr<bool>() : nullptr,
          count.defined() ? count.const_data_ptr<int64_t>() : nullptr, edges, num_nodes, sums_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (num_nodes > 0) {
    degree_finish_kernel<<<blocks_for(num_nodes), kThreads, 0, stream>>>(
        sums_ptr, diag.defined() ? diag.const_data_ptr<float>() : nullptr, num_nodes, deg.mutable_data_ptr<float>(),
        inv_sqrt.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {deg, inv_sqrt};
}

}  // namespace pyg_quant
