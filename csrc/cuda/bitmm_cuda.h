#pragma once
#include <ATen/core/Tensor.h>

namespace pyg_quant {

at::Tensor bitmm_int_cuda(const at::Tensor& a_planes, const at::Tensor& b_planes, int64_t rows, int64_t cols, bool wide);

}  // namespace pyg_quant
