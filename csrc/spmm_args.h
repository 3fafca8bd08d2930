#pragma once
// Argument shapes of bit_spmm_affine, shared by the CPU and CUDA kernels.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace pyg_quant {

// Entries self_weight must have: one a row, or a single one for every row (GIN's scalar 1 + eps, passed without
// being expanded to a row vector first: one fill kernel a layer fewer).
inline int64_t self_weight_length(const std::optional<at::Tensor>& self_weight, int64_t rows) {
  return self_weight.has_value() && self_weight->dim() == 1 && self_weight->size(0) == 1 ? 1 : rows;
}

}  // namespace pyg_quant
