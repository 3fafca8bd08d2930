#pragma once
// mlp_weight_codes on CUDA (see csrc/mlp_weight_codes.h).
#include <ATen/core/Tensor.h>

#include <vector>

namespace pyg_quant {

std::vector<at::Tensor> mlp_weight_codes_cuda(at::TensorList weights, at::IntArrayRef bits);

}  // namespace pyg_quant
