#pragma once
// Argument checks and operands of expand_tiles and expand_csr, shared by the CPU and CUDA kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "layout.h"

namespace pyg_quant {

// (window_ptr, tile_col, tile_bits, res_ptr, row_sums) of a CompactAdjacency (pyg_quant/compact_adjacency.py).
using ExpandedTiles = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// (res_ptr, res_col, res_val, row_sums) of a CompactAdjacency decoded without tiles: every entry, tile entries and
// residual alike, in one CSR sorted by (row, column).  res_val is int32[nnz], or int32[0] when neither entry_val
// nor res_val is given (every value is 1: BitAdjacency's res_val is then None).
using ExpandedCsr = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The integer types a plan's indices and residual values may come in: int32, or narrower where their values fit (how
// a loader batch ships them).  The CUDA kernels read each width as it is; the CPU kernels widen them on the way in.
inline bool index_type(const at::Tensor& t) {
  const auto type = t.scalar_type();
  return type == at::kInt || type == at::kShort || type == at::kChar;
}

// The plan's shapes, dtypes and devices, shared by expand_tiles and expand_csr (`op` names the caller).
inline void check_plan_args(const char* op, const at::Tensor& tile_key, const at::Tensor& row_count,
                            const at::Tensor& entry_col, const std::optional<at::Tensor>& entry_val,
                            const at::Tensor& res_row, const std::optional<at::Tensor>& res_val, int64_t num_rows,
                            int64_t num_cols) {
  TORCH_CHECK(num_rows > 0 && num_cols > 0, op, ": num_rows and num_cols must be positive");
  TORCH_CHECK(index_type(tile_key) && tile_key.dim() == 1, op, ": tile_key must be int32 (or int16, int8) [T]");
  TORCH_CHECK((row_count.scalar_type() == at::kByte || row_count.scalar_type() == at::kShort) &&
                  row_count.dim() == 2 && row_count.size(0) == tile_key.size(0) && row_count.size(1) == kTileRows,
              op, ": row_count must be uint8/int16 [T, 16]");
  TORCH_CHECK(entry_col.scalar_type() == at::kByte && entry_col.dim() == 1, op, ": entry_col must be uint8");
  TORCH_CHECK(!entry_val || (entry_val->scalar_type() == at::kByte && entry_val->sizes() == entry_col.sizes()), op,
              ": entry_val must be uint8 like entry_col");
  TORCH_CHECK(index_type(res_row) && res_row.dim() == 1, op, ": res_row must be int32 (or int16, int8)");
  TORCH_CHECK(!res_val || (index_type(*res_val) && res_val->sizes() == res_row.sizes()), op,
              ": res_val must be int32 (or int16, int8) like res_row");
  const auto device = tile_key.device();
  for (const at::Tensor* t : {&row_count, &entry_col, &res_row}) {
    TORCH_CHECK(t->device() == device, op, ": all tensors must be on one device");
  }
  TORCH_CHECK((!entry_val || entry_val->device() == device) && (!res_val || res_val->device() == device), op,
              ": all tensors must be on one device");
}

// Shapes, dtypes and devices of expand_tiles' arguments.
inline void check_expand_args(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                              const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                              const std::optional<at::Tensor>& res_val, int64_t num_rows, int64_t num_cols,
                              int64_t planes) {
  check_plan_args("expand_tiles", tile_key, row_count, entry_col, entry_val, res_row, res_val, num_rows, num_cols);
  TORCH_CHECK(planes >= 1 && planes <= kMaxBits, "expand_tiles: planes must be in 1..8, got ", planes);
  TORCH_CHECK(planes == 1 || entry_val, "expand_tiles: more than one plane needs entry_val");
}

// expand_csr's arguments: expand_tiles' (planes aside) plus res_col, int32 like res_row.
inline void check_expand_csr_args(const at::Tensor& tile_key, const at::Tensor& row_count,
                                  const at::Tensor& entry_col, const std::optional<at::Tensor>& entry_val,
                                  const at::Tensor& res_row, const at::Tensor& res_col,
                                  const std::optional<at::Tensor>& res_val, int64_t num_rows, int64_t num_cols) {
  check_plan_args("expand_csr", tile_key, row_count, entry_col, entry_val, res_row, res_val, num_rows, num_cols);
  TORCH_CHECK(index_type(res_col) && res_col.sizes() == res_row.sizes(),
              "expand_csr: res_col must be int32 (or int16, int8) like res_row");
  TORCH_CHECK(res_col.device() == tile_key.device(), "expand_csr: all tensors must be on one device");
}

// A checked plan made contiguous, and its sizes: the common start of expand_tiles and expand_csr on every backend
// (on CUDA, after the device guard).  entry_val, res_col and res_val are undefined when not given.  tile_key,
// res_row, res_col and res_val come as int32, or, where `narrow` (kernels that read each width as it is), in the
// width they were passed in.
struct ExpandOperands {
  at::Tensor tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val;
  int64_t num_tiles, num_entries, num_res, col_tiles, num_windows;
};

inline ExpandOperands expand_operands(const at::Tensor& tile_key, const at::Tensor& row_count,
                                      const at::Tensor& entry_col, const std::optional<at::Tensor>& entry_val,
                                      const at::Tensor& res_row, const std::optional<at::Tensor>& res_col,
                                      const std::optional<at::Tensor>& res_val, int64_t num_rows, int64_t num_cols,
                                      bool narrow = false) {
  auto index = [narrow](const at::Tensor& t) {
    return (narrow || t.scalar_type() == at::kInt ? t : t.to(at::kInt)).contiguous();
  };
  ExpandOperands o;
  o.tile_key = index(tile_key);
  o.row_count = row_count.contiguous();
  o.entry_col = entry_col.contiguous();
  o.entry_val = entry_val ? entry_val->contiguous() : at::Tensor();
  o.res_row = index(res_row);
  o.res_col = res_col ? index(*res_col) : at::Tensor();
  o.res_val = res_val ? index(*res_val) : at::Tensor();
  o.num_tiles = o.tile_key.size(0);
  o.num_entries = o.entry_col.size(0);
  o.num_res = o.res_row.size(0);
  o.col_tiles = (num_cols + kTileCols - 1) / kTileCols;
  o.num_windows = (num_rows + kTileRows - 1) / kTileRows;
  return o;
}

}  // namespace pyg_quant
