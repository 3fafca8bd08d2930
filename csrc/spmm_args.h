#pragma once
// Argument checks of bit_spmm_int and bit_spmm_affine, shared by the CPU and CUDA kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

#include "layout.h"
#include "row_codes.h"

namespace pyg_quant {

// The block-sparse adjacency (window_ptr, tile_col and tile_bits: layout.h's tiles; the CSR residual res_ptr, res_col
// and res_val) and the column-layout x_planes over `cols` features, all on one device, with x_codes (when given) the
// row codes of x_planes.  Index bounds are the format's invariants (BitAdjacency builds them): a backend checks them
// only where it can without a device-to-host copy.
inline void check_spmm_operands(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                                const at::Tensor& res_ptr, const at::Tensor& res_col,
                                const std::optional<at::Tensor>& res_val, const at::Tensor& x, int64_t rows,
                                int64_t cols, const std::optional<at::Tensor>& x_codes) {
  TORCH_CHECK_VALUE(window_ptr.dim() == 1 && window_ptr.scalar_type() == at::kLong,
                    "window_ptr must be int64[num_windows + 1]");
  TORCH_CHECK_VALUE(tile_col.dim() == 1 && tile_col.scalar_type() == at::kInt, "tile_col must be int32[num_tiles]");
  TORCH_CHECK_VALUE(tile_bits.dim() == 4 && tile_bits.scalar_type() == at::kInt &&
                        tile_bits.size(1) == tile_col.size(0) && tile_bits.size(2) == kTileRows &&
                        tile_bits.size(3) == kTileWords,
                    "tile_bits must be int32[bits, num_tiles, 16, 8]");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.scalar_type() == at::kInt && x.size(2) % kTileWords == 0 &&
                        x.size(1) % kOuterAlign == 0,
                    "x_planes must be column-layout int32[bits, outer (padded to 64), words]");
  TORCH_CHECK_VALUE(tile_bits.size(0) >= 1 && tile_bits.size(0) <= kMaxBits && x.size(0) >= 1 &&
                        x.size(0) <= kMaxBits,
                    "1 to 8 bit planes per operand");
  TORCH_CHECK_VALUE(cols >= 0 && cols <= x.size(1), "cols exceeds x_planes' padded feature count");
  TORCH_CHECK_VALUE(rows >= 0 && res_ptr.dim() == 1 && res_ptr.scalar_type() == at::kLong &&
                        res_ptr.size(0) == rows + 1,
                    "res_ptr must be int64[rows + 1]");
  TORCH_CHECK_VALUE(res_col.dim() == 1 && res_col.scalar_type() == at::kInt, "res_col must be int32[res_nnz]");
  if (res_val.has_value()) {
    TORCH_CHECK_VALUE(res_val->scalar_type() == at::kInt && res_val->sizes() == res_col.sizes(),
                      "res_val must be int32 with res_col's shape");
  }
  TORCH_CHECK_VALUE((window_ptr.size(0) - 1) * kTileRows >= rows, "rows exceeds the adjacency's row windows");
  for (const auto* t : {&window_ptr, &tile_col, &tile_bits, &res_ptr, &res_col}) {
    TORCH_CHECK_VALUE(t->device() == x.device(), "the adjacency and x_planes must be on one device");
  }
  if (res_val.has_value()) TORCH_CHECK_VALUE(res_val->device() == x.device(), "res_val must be on x_planes' device");
  check_row_codes(x_codes, x, cols);
}

// A vector argument of bit_spmm_affine (lo, scale, row_sums, ...): 1-D, `n` entries of `dtype`, on x_planes' device.
inline void check_spmm_vector(const std::optional<at::Tensor>& t, at::ScalarType dtype, int64_t n, const at::Tensor& x,
                              const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == n && t->scalar_type() == dtype && t->device() == x.device(), name,
                    " must be a 1-D ", c10::toString(dtype), " tensor of ", n, " entries on x_planes' device");
}

// Entries self_weight must have: one a row, or a single one for every row (GIN's scalar 1 + eps, passed without
// being expanded to a row vector first: one fill kernel a layer fewer).
inline int64_t self_weight_length(const std::optional<at::Tensor>& self_weight, int64_t rows) {
  return self_weight.has_value() && self_weight->dim() == 1 && self_weight->size(0) == 1 ? 1 : rows;
}

// bit_spmm_affine's vectors: lo and scale [cols], row_sums [rows], self_weight [rows] or [1], row_scale [rows] and
// bias [cols]; a self term needs a square adjacency (an x that is not 3-D is left to check_spmm_operands to name).
// Returns self_weight's length.
inline int64_t check_spmm_affine_vectors(const at::Tensor& lo, const at::Tensor& scale, const at::Tensor& row_sums,
                                         const std::optional<at::Tensor>& self_weight,
                                         const std::optional<at::Tensor>& row_scale,
                                         const std::optional<at::Tensor>& bias, const at::Tensor& x, int64_t rows,
                                         int64_t cols) {
  check_spmm_vector(lo, at::kFloat, cols, x, "lo");
  check_spmm_vector(scale, at::kFloat, cols, x, "scale");
  check_spmm_vector(row_sums, at::kLong, rows, x, "row_sums");
  const int64_t self_len = self_weight_length(self_weight, rows);
  check_spmm_vector(self_weight, at::kFloat, self_len, x, "self_weight");
  check_spmm_vector(row_scale, at::kFloat, rows, x, "row_scale");
  check_spmm_vector(bias, at::kFloat, cols, x, "bias");
  if (self_weight.has_value()) {
    TORCH_CHECK_VALUE(x.dim() != 3 || rows <= x.size(2) * kWordBits,
                      "self_weight needs a square adjacency (rows <= x's nodes)");
  }
  return self_len;
}

}  // namespace pyg_quant
