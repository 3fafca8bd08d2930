#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace pyg_quant {

// (window_ptr, tile_col, tile_bits, res_ptr, row_sums) of a CompactAdjacency (pyg_quant/compact_adjacency.py).
using ExpandedTiles = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Shapes, dtypes and devices of expand_tiles' arguments (shared by the CPU and CUDA kernels).
void check_expand_args(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                       const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                       const std::optional<at::Tensor>& res_val, int64_t num_rows, int64_t num_cols, int64_t planes);

ExpandedTiles expand_tiles_cpu(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                               const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                               const std::optional<at::Tensor>& res_val, int64_t num_rows, int64_t num_cols,
                               int64_t planes);

// (res_ptr, res_col, res_val, row_sums) of a CompactAdjacency decoded without tiles: every entry, tile entries and
// residual alike, in one CSR sorted by (row, column).  res_val is int32[nnz], or int32[0] when neither entry_val
// nor res_val is given (every value is 1: BitAdjacency's res_val is then None).
using ExpandedCsr = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// expand_csr's arguments: expand_tiles' (planes aside) plus res_col, int32 like res_row.
void check_expand_csr_args(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                           const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                           const at::Tensor& res_col, const std::optional<at::Tensor>& res_val, int64_t num_rows,
                           int64_t num_cols);

// A checked plan made contiguous, and its sizes: the common start of expand_tiles and expand_csr on every backend
// (on CUDA, after the device guard).  entry_val, res_col and res_val are undefined when not given.
struct ExpandOperands {
  at::Tensor tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val;
  int64_t num_tiles, num_entries, num_res, col_tiles, num_windows;
};

ExpandOperands expand_operands(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                               const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                               const std::optional<at::Tensor>& res_col, const std::optional<at::Tensor>& res_val,
                               int64_t num_rows, int64_t num_cols);

ExpandedCsr expand_csr_cpu(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                           const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                           const at::Tensor& res_col, const std::optional<at::Tensor>& res_val, int64_t num_rows,
                           int64_t num_cols);

}  // namespace pyg_quant
