#pragma once
// degree_inv_sqrt's argument checks and its per-node formula, shared by the CPU and CUDA kernels: GCN's degrees of an
// unweighted edge list, d_i = (Σ of count over the kept edges into i) + diag_i, and d_i^-1/2.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "macros.h"

namespace pyg_quant {

// (d, d^-1/2), float32 [num_nodes].
using DegreeInvSqrt = std::tuple<at::Tensor, at::Tensor>;

// The integer row sum in float32 (one rounding) plus the diagonal term; then 1 / sqrt(d) in float64, rounded to
// float32 once, and 0 where that is +inf (a zero degree): the bits of pyg_quant.ops.reference.inv_sqrt_degree.
PYG_QUANT_HOST_DEVICE void degree_and_inv_sqrt(int64_t row_sum, const float* diag, int64_t node, float* deg,
                                               float* inv_sqrt) {
  float d = static_cast<float>(row_sum);
  if (diag != nullptr) d = d + diag[node];
  float r = static_cast<float>(1.0 / sqrt(static_cast<double>(d)));
  if (r == std::numeric_limits<float>::infinity()) r = 0.0f;
  deg[node] = d;
  inv_sqrt[node] = r;
}

inline void check_degree_args(const at::Tensor& dst, const std::optional<at::Tensor>& keep,
                              const std::optional<at::Tensor>& count, const std::optional<at::Tensor>& diag,
                              int64_t num_nodes) {
  TORCH_CHECK_VALUE(dst.dim() == 1, "degree_inv_sqrt: dst must be a 1-D tensor");
  TORCH_CHECK_TYPE(dst.scalar_type() == at::kLong || dst.scalar_type() == at::kInt,
                   "degree_inv_sqrt: dst must be int64 or int32");
  TORCH_CHECK_VALUE(num_nodes >= 0 && (dst.numel() == 0 || num_nodes > 0),
                    "degree_inv_sqrt: num_nodes must be positive where there are edges");
  const auto device = dst.device();
  if (keep) {
    TORCH_CHECK_VALUE(keep->dim() == 1 && keep->numel() == dst.numel() && keep->device() == device,
                      "degree_inv_sqrt: keep must be one per edge, on dst's device");
    TORCH_CHECK_TYPE(keep->scalar_type() == at::kBool, "degree_inv_sqrt: keep must be a bool tensor");
  }
  if (count) {
    TORCH_CHECK_VALUE(count->dim() == 1 && count->numel() == dst.numel() && count->device() == device,
                      "degree_inv_sqrt: count must be one per edge, on dst's device");
    TORCH_CHECK_TYPE(!count->is_floating_point() && !count->is_complex() && count->scalar_type() != at::kBool,
                     "degree_inv_sqrt: count must hold integers");
  }
  if (diag) {
    TORCH_CHECK_VALUE(diag->dim() == 1 && diag->numel() == num_nodes && diag->device() == device,
                      "degree_inv_sqrt: diag must hold one value per node, on dst's device");
    TORCH_CHECK_TYPE(diag->is_floating_point(), "degree_inv_sqrt: diag must be floating point");
  }
}

}  // namespace pyg_quant
