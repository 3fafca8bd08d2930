#pragma once
#include <optional>
#include <ATen/core/Tensor.h>

namespace pyg_quant {

at::Tensor bitmm_int_cuda(const at::Tensor& a_planes, const at::Tensor& b_planes, int64_t rows, int64_t cols, bool wide);

// The wgmma path (bitmm_wgmma_cuda.cu): true when `device` is sm_90 and the build has its sm_90a image.
bool bitmm_wgmma_available(const at::Device& device);
// Writes the int32 product into `out` [rows, cols] and returns true, or returns false
// (nothing launched) where the wgmma kernel does not apply: not sm_90/sm_90a, no
// cuTensorMapEncodeTiled in the driver, planes off a 16-byte boundary, K = 0, an
// operand past the tensor maps' int32 coordinates or the grid's 65535 M tiles.
bool bitmm_int_wgmma(const at::Tensor& a_planes, const at::Tensor& b_planes, int64_t rows, int64_t cols,
                     at::Tensor& out);

// float32 [M, N] = affine correction of an int32/int64 code product (see epilogue.h),
// optionally + bias[N] and ReLU.  Sums are int64; lo/scale are float32 vectors.
at::Tensor bitmm_affine_cuda(const at::Tensor& product, const at::Tensor& row_sums, const at::Tensor& col_sums,
                        const at::Tensor& a_lo, const at::Tensor& a_scale, const at::Tensor& b_lo,
                        const at::Tensor& b_scale, int64_t k, const std::optional<at::Tensor>& bias, bool relu);

}  // namespace pyg_quant
