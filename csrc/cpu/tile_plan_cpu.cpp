// The tile plan of a bit adjacency (pyg_quant/compact_adjacency.py) in one pass over its sorted entries.
//
// Keys are sorted row-major, so the entries of one 16-row window are contiguous: each window is planned on
// its own with a counter per 256-column block, and no entry is divided (rows advance with the keys).
#include "cpu/tile_plan_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "layout.h"

namespace pyg_quant {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
tile_plan_cpu(const at::Tensor& keys, const at::Tensor& sums, int64_t num_rows, int64_t num_cols,
              int64_t min_tile_nnz, int64_t planes) {
  TORCH_CHECK(keys.device().is_cpu() && sums.device().is_cpu(), "tile_plan: keys and sums must be on the CPU");
  TORCH_CHECK(keys.scalar_type() == at::kLong && sums.scalar_type() == at::kLong,
              "tile_plan: keys and sums must be int64");
  TORCH_CHECK(keys.dim() == 1 && sums.dim() == 1 && keys.numel() == sums.numel(),
              "tile_plan: keys and sums must be 1-D of equal length");
  TORCH_CHECK(num_rows > 0 && num_cols > 0, "tile_plan: num_rows and num_cols must be positive");
  TORCH_CHECK(min_tile_nnz >= 1 && planes >= 1 && planes <= 8, "tile_plan: bad min_tile_nnz or planes");
  const at::Tensor key_c = keys.contiguous(), sum_c = sums.contiguous();
  const int64_t* key = key_c.data_ptr<int64_t>();
  const int64_t* sum = sum_c.data_ptr<int64_t>();
  const int64_t n = keys.numel();
  const int64_t col_tiles = (num_cols + kTileCols - 1) / kTileCols;
  const int64_t fits = int64_t{1} << planes;
  if (n > 0) {
    TORCH_CHECK(key[0] >= 0 && key[n - 1] < num_rows * num_cols, "tile_plan: keys out of range");
  }

  std::vector<int32_t> tile_key;
  std::vector<int16_t> row_count;
  std::vector<uint8_t> entry_col, entry_val;
  std::vector<int32_t> res_row, res_col;
  std::vector<int64_t> res_sum;
  entry_col.reserve(n);
  entry_val.reserve(n);
  at::Tensor row_sums = at::zeros({num_rows}, keys.options());
  int64_t* row_sum = row_sums.data_ptr<int64_t>();

  std::vector<int32_t> block_count(col_tiles, 0), tile_entries(col_tiles, 0), tile_of_block(col_tiles, -1);
  std::vector<int32_t> touched;
  std::vector<uint8_t> row_in_window, in_tile;  // per entry of the current window
  std::vector<int64_t> col_of;
  int64_t start = 0;
  while (start < n) {
    const int64_t window = key[start] / num_cols / kTileRows;
    const int64_t window_end_key = std::min(num_rows, (window + 1) * kTileRows) * num_cols;
    // Rows advance with the sorted keys: no division per entry; each entry's row and column are kept for
    // the two passes below.
    int64_t row = window * kTileRows, row_end = (row + 1) * num_cols, end = start;
    touched.clear();
    row_in_window.clear();
    col_of.clear();
    while (end < n && key[end] < window_end_key) {
      while (key[end] >= row_end) {
        ++row;
        row_end += num_cols;
      }
      const int64_t col = key[end] - (row_end - num_cols);
      row_in_window.push_back(static_cast<uint8_t>(row - window * kTileRows));
      col_of.push_back(col);
      if (block_count[col / kTileCols]++ == 0) touched.push_back(static_cast<int32_t>(col / kTileCols));
      ++end;
    }
    in_tile.assign(end - start, 0);
    for (int64_t e = start; e < end; ++e) {
      const int64_t block = col_of[e - start] / kTileCols;
      if (block_count[block] >= min_tile_nnz && sum[e] < fits) {
        in_tile[e - start] = 1;
        ++tile_entries[block];
      }
    }
    std::sort(touched.begin(), touched.end());
    for (int32_t block : touched) {
      if (tile_entries[block] > 0) {
        tile_of_block[block] = static_cast<int32_t>(tile_key.size());
        tile_key.push_back(static_cast<int32_t>(window * col_tiles + block));
        row_count.resize(row_count.size() + kTileRows, 0);
      }
    }
    for (int64_t e = start; e < end; ++e) {
      const int64_t local = row_in_window[e - start], col = col_of[e - start];
      row_sum[window * kTileRows + local] += sum[e];
      if (in_tile[e - start]) {
        ++row_count[static_cast<int64_t>(tile_of_block[col / kTileCols]) * kTileRows + local];
        entry_col.push_back(static_cast<uint8_t>(col % kTileCols));
        entry_val.push_back(static_cast<uint8_t>(sum[e]));
      } else {
        res_row.push_back(static_cast<int32_t>(window * kTileRows + local));
        res_col.push_back(static_cast<int32_t>(col));
        res_sum.push_back(sum[e]);
      }
    }
    for (int32_t block : touched) block_count[block] = tile_entries[block] = 0, tile_of_block[block] = -1;
    start = end;
  }

  auto to_tensor = [](const auto& values, at::ScalarType type) {
    at::Tensor out = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(type));
    if (!values.empty()) std::memcpy(out.data_ptr(), values.data(), values.size() * sizeof(values[0]));
    return out;
  };
  at::Tensor counts = to_tensor(row_count, at::kShort).view({-1, kTileRows});
  return {to_tensor(tile_key, at::kInt), counts, to_tensor(entry_col, at::kByte), to_tensor(entry_val, at::kByte),
          to_tensor(res_row, at::kInt), to_tensor(res_col, at::kInt), to_tensor(res_sum, at::kLong), row_sums};
}

}  // namespace pyg_quant
