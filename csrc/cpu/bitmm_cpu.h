#pragma once
#include <optional>
#include <ATen/core/Tensor.h>

namespace pyg_quant {

at::Tensor bitmm_int_cpu(const at::Tensor& a_planes, const at::Tensor& b_planes, int64_t rows, int64_t cols, bool wide);

// float32 [M, N] = affine correction of an int32/int64 code product (see epilogue.h),
// optionally + bias[N] and ReLU.  Sums are int64; lo/scale are float32 vectors.
at::Tensor bitmm_affine_cpu(const at::Tensor& product, const at::Tensor& row_sums, const at::Tensor& col_sums,
                        const at::Tensor& a_lo, const at::Tensor& a_scale, const at::Tensor& b_lo,
                        const at::Tensor& b_scale, int64_t k, const std::optional<at::Tensor>& bias, bool relu);

}  // namespace pyg_quant
