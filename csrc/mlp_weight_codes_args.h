#pragma once
// mlp_weight_codes' argument checks, shared by the CPU's composition (mlp_weight_codes.h) and the CUDA kernel.
#include <ATen/core/Tensor.h>

#include "layout.h"  // kMaxBits

namespace pyg_quant {

inline void check_mlp_weight_codes_args(at::TensorList weights, at::IntArrayRef bits) {
  TORCH_CHECK_VALUE(weights.size() == bits.size(), "weights and bits must have one entry per layer, got ",
                    weights.size(), " and ", bits.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK_TYPE(w.is_floating_point(), "weights[", i, "] must be floating point, got ", w.scalar_type());
    TORCH_CHECK_VALUE(w.dim() == 2 && w.numel() > 0, "weights[", i, "] must be a non-empty 2-D [out, in] tensor, got ",
                      w.sizes());
    TORCH_CHECK_VALUE(w.device() == weights[0].device(), "weights must be on one device, got ", weights[0].device(),
                      " and ", w.device());
    TORCH_CHECK_VALUE(bits[i] >= 1 && bits[i] <= kMaxBits, "bits[", i, "] must be in 1..", kMaxBits, ", got ", bits[i]);
  }
}

}  // namespace pyg_quant
