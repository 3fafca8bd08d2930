#pragma once
// Argument checks of the quantize ops (quantize_pack, quantize_pack_ranges, unpack_codes, dequantize and
// packed_code_sums), shared by the CPU and CUDA kernels.  The row-code ops' shapes are in row_codes.h.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

#include "col_keys.h"
#include "layout.h"

namespace pyg_quant {

// quantize_pack's arguments: a 2-D float32 x, lo and inv_scale 2-D and broadcastable to x's shape (the kernels read
// them as float32), noise float32 with x's shape, all on x's device.
// pack_codes' codes: a 2-D uint8 matrix (each code checked against bits by the kernel).
inline void check_pack_codes_args(const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK_VALUE(codes.dim() == 2, "pack_codes: codes must be a 2-D tensor");
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "pack_codes: codes must be uint8");
  TORCH_CHECK_VALUE(bits >= 1 && bits <= kMaxBits, "pack_codes: bits must be in 1..8, got ", bits);
}

inline void check_quantize_pack_args(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& inv_scale,
                                     int64_t bits, const std::optional<at::Tensor>& noise) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK_VALUE(bits >= 1 && bits <= kMaxBits, "bits must be in 1..8, got ", bits);
  TORCH_CHECK_VALUE(lo.dim() == 2 && inv_scale.dim() == 2, "lo and inv_scale must be 2-D (broadcastable to x)");
  const int64_t rows = x.size(0), cols = x.size(1);
  for (const auto* t : {&lo, &inv_scale}) {
    TORCH_CHECK_VALUE(t->device() == x.device(), "lo and inv_scale must be on x's device");
    TORCH_CHECK_VALUE((t->size(0) == 1 || t->size(0) == rows) && (t->size(1) == 1 || t->size(1) == cols),
                      "lo and inv_scale must broadcast to x's shape");
  }
  TORCH_CHECK_VALUE(!noise || (noise->sizes() == x.sizes() && noise->scalar_type() == at::kFloat &&
                               noise->device() == x.device()),
                    "noise must be float32 with x's shape and device");
}

// quantize_pack_ranges' x, bits, dim and noise (also what its composed form checks).
inline void check_quantize_ranges_args(const at::Tensor& x, int64_t bits, int64_t dim,
                                       const std::optional<at::Tensor>& noise) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK_VALUE(x.size(0) > 0 && x.size(1) > 0, "x must not be empty");
  TORCH_CHECK_VALUE(bits >= 1 && bits <= kMaxBits, "bits must be in 1..8, got ", bits);
  TORCH_CHECK_VALUE(dim == 0 || dim == 1, "dim must be 0 (per column) or 1 (per row), got ", dim);
  TORCH_CHECK_VALUE(!noise || (noise->sizes() == x.sizes() && noise->scalar_type() == at::kFloat &&
                               noise->device() == x.device()),
                    "noise must be float32 with x's shape and device");
}

// quantize_pack_ranges' arguments, col_keys included: keys describe columns, so they only stand for the ranges of
// dim 0, and only the column layout's kernel reads them.
inline void check_quantize_ranges_args(const at::Tensor& x, int64_t bits, int64_t dim, bool col_layout,
                                       const std::optional<at::Tensor>& noise,
                                       const std::optional<at::Tensor>& col_keys) {
  check_quantize_ranges_args(x, bits, dim, noise);
  if (!col_keys.has_value()) return;
  TORCH_CHECK_VALUE(dim == 0 && col_layout, "col_keys needs per-column ranges in the column layout (dim=0, "
                    "col_layout=True), got dim=", dim, ", col_layout=", col_layout ? "True" : "False");
  check_col_keys(col_keys, x.size(1), x.device(), "x", "x");
}

// The planes of unpack_codes / dequantize: int32 [bits, outer, words] holding a rows x cols matrix.
inline void check_unpack_shape(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout) {
  TORCH_CHECK_VALUE(planes.dim() == 3 && planes.scalar_type() == at::kInt, "planes must be int32[bits, outer, words]");
  TORCH_CHECK_VALUE(planes.size(0) >= 1 && planes.size(0) <= kMaxBits, "planes must hold 1 to 8 bit planes");
  TORCH_CHECK_VALUE(rows >= 0 && cols >= 0, "rows and cols must be non-negative");
  TORCH_CHECK_VALUE(planes.size(1) >= (col_layout ? cols : rows) &&
                        planes.size(2) * kWordBits >= (col_layout ? rows : cols),
                    "rows/cols exceed the planes' padded shape");
}

// The ranges of dequantize: float32 lo / scale with one entry per group, dim -1 (one), 0 (per column) or 1 (per
// row), on the planes' device.
inline void check_dequantize_ranges(const at::Tensor& planes, const at::Tensor& lo, const at::Tensor& scale,
                                    int64_t rows, int64_t cols, int64_t dim) {
  TORCH_CHECK_VALUE(dim >= -1 && dim <= 1, "dim must be -1 (per tensor), 0 (per column) or 1 (per row), got ", dim);
  const int64_t groups = dim < 0 ? 1 : (dim == 0 ? cols : rows);
  for (const auto* t : {&lo, &scale}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->numel() == groups,
                      "lo and scale must be float32 with ", groups, " entries (dim=", dim, "), got ", t->numel());
    TORCH_CHECK_VALUE(t->device() == planes.device(), "lo and scale must be on the planes' device");
  }
}

// packed_code_sums' planes: int32 [bits, outer, words].
inline void check_code_sums_planes(const at::Tensor& planes) {
  TORCH_CHECK_VALUE(planes.dim() == 3 && planes.scalar_type() == at::kInt, "planes must be int32[bits, outer, words]");
}

}  // namespace pyg_quant
