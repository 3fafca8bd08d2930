#pragma once
// Argument checks of bitmm_int and bitmm_affine, shared by the CPU and CUDA kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

#include "layout.h"

namespace pyg_quant {

// bitmm_int's operands: row-layout a_planes [s, M_pad, W] and column-layout b_planes [t, N_pad, W] (layout.h) of at
// most kMaxBits planes each, on one device, packing the same W words along K, a multiple of `word_multiple` (what
// the backend's kernel reads at once), with rows and cols within their padded outer dimensions.
inline void check_bitmm_int_args(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols,
                                 int64_t word_multiple) {
  TORCH_CHECK_VALUE(a.dim() == 3 && b.dim() == 3 && a.scalar_type() == at::kInt && b.scalar_type() == at::kInt,
                    "a_planes and b_planes must be int32[bits, outer, words]");
  TORCH_CHECK_VALUE(a.size(2) == b.size(2) && a.size(2) % word_multiple == 0,
                    "a_planes and b_planes must pack the same number of words along K (a multiple of ",
                    word_multiple, ")");
  TORCH_CHECK_VALUE(a.size(0) <= kMaxBits && b.size(0) <= kMaxBits, "at most 8 bit planes per operand");
  TORCH_CHECK_VALUE(rows <= a.size(1) && cols <= b.size(1), "rows/cols exceed the padded operands");
  TORCH_CHECK_VALUE(a.device() == b.device(), "a_planes and b_planes must be on one device");
}

// Shapes, dtypes and devices of bitmm_affine's operands: an int32 / int64 product [M, N], int64 row_sums [M] and
// col_sums [N], float32 a_lo / a_scale [M] and b_lo / b_scale / bias [N].
inline void check_bitmm_affine_args(const at::Tensor& product, const at::Tensor& row_sums,
                                    const at::Tensor& col_sums, const at::Tensor& a_lo, const at::Tensor& a_scale,
                                    const at::Tensor& b_lo, const at::Tensor& b_scale, int64_t k,
                                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(product.dim() == 2 && (product.scalar_type() == at::kInt || product.scalar_type() == at::kLong),
                    "product must be a 2-D int32 or int64 tensor");
  const int64_t rows = product.size(0), cols = product.size(1);
  TORCH_CHECK_VALUE(row_sums.dim() == 1 && row_sums.size(0) == rows && row_sums.scalar_type() == at::kLong,
                    "row_sums must be int64 [", rows, "]");
  TORCH_CHECK_VALUE(col_sums.dim() == 1 && col_sums.size(0) == cols && col_sums.scalar_type() == at::kLong,
                    "col_sums must be int64 [", cols, "]");
  for (const auto* t : {&a_lo, &a_scale}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat,
                      "a_lo and a_scale must be float32 [", rows, "]");
  }
  for (const auto* t : {&b_lo, &b_scale}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == cols && t->scalar_type() == at::kFloat,
                      "b_lo and b_scale must be float32 [", cols, "]");
  }
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == cols && bias->scalar_type() == at::kFloat,
                      "bias must be float32 [", cols, "]");
  }
  TORCH_CHECK_VALUE(k >= 0, "k must be non-negative");
  for (const auto* t : {&row_sums, &col_sums, &a_lo, &a_scale, &b_lo, &b_scale}) {
    TORCH_CHECK_VALUE(t->device() == product.device(), "every operand must be on the product's device");
  }
  if (bias.has_value()) TORCH_CHECK_VALUE(bias->device() == product.device(), "bias must be on the product's device");
}

}  // namespace pyg_quant
