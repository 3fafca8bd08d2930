// Writes the bit tiles of a CompactAdjacency (pyg_quant/compact_adjacency.py): the inverse of tile_plan.
//
// Entries arrive row-major (window, row in window, tile, column); the entries of row r of a window are the
// row's segments of the window's tiles in tile order, so walking windows, then rows, then tiles visits the
// entry stream in order with one running offset.
#include "cpu/expand_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <vector>

#include "expand_args.h"
#include "layout.h"

namespace pyg_quant {
namespace {

int64_t count_at(const at::Tensor& row_count, const void* data, int64_t index) {
  return row_count.scalar_type() == at::kByte ? static_cast<const uint8_t*>(data)[index]
                                              : static_cast<const int16_t*>(data)[index];
}

// The first tile of every window (bounds[w], w = 0..num_windows) from the sorted, in-range tile keys.
void window_bounds(const char* op, const int32_t* key, int64_t num_tiles, int64_t col_tiles, int64_t num_windows,
                   int64_t* bounds) {
  for (int64_t i = 0; i < num_tiles; ++i) {
    TORCH_CHECK(key[i] >= 0 && key[i] < num_windows * col_tiles && (i == 0 || key[i] > key[i - 1]), op,
                ": tile_key must be sorted and in range");
  }
  int64_t t = 0;
  for (int64_t w = 0; w <= num_windows; ++w) {
    while (t < num_tiles && key[t] / col_tiles < w) ++t;
    bounds[w] = t;
  }
}

// The first residual entry of every row (bounds[r], r = 0..num_rows) from the sorted, in-range residual rows.
void row_bounds(const char* op, const int32_t* res_row, int64_t num_res, int64_t num_rows, int64_t* bounds) {
  for (int64_t k = 0; k < num_res; ++k) {
    TORCH_CHECK(res_row[k] >= 0 && res_row[k] < num_rows && (k == 0 || res_row[k] >= res_row[k - 1]), op,
                ": res_row must be sorted and in range");
  }
  int64_t j = 0;
  for (int64_t r = 0; r <= num_rows; ++r) {
    while (j < num_res && res_row[j] < r) ++j;
    bounds[r] = j;
  }
}
}  // namespace

ExpandedTiles expand_tiles_cpu(const at::Tensor& tile_key_in, const at::Tensor& row_count_in,
                               const at::Tensor& entry_col_in, const std::optional<at::Tensor>& entry_val_in,
                               const at::Tensor& res_row_in, const std::optional<at::Tensor>& res_val_in,
                               int64_t num_rows, int64_t num_cols, int64_t planes) {
  check_expand_args(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in, res_val_in, num_rows, num_cols,
                    planes);
  const ExpandOperands o = expand_operands(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in,
                                           std::nullopt, res_val_in, num_rows, num_cols);
  const at::Tensor &tile_key = o.tile_key, &row_count = o.row_count, &entry_col = o.entry_col, &res_row = o.res_row;
  const at::Tensor &entry_val = o.entry_val, &res_val = o.res_val;
  const int64_t num_tiles = o.num_tiles, num_entries = o.num_entries, num_res = o.num_res;
  const int64_t col_tiles = o.col_tiles, num_windows = o.num_windows;
  const auto i64 = tile_key.options().dtype(at::kLong);

  const int32_t* key = tile_key.data_ptr<int32_t>();
  at::Tensor window_ptr = at::empty({num_windows + 1}, i64);
  at::Tensor tile_col = at::empty({num_tiles}, tile_key.options());
  int64_t* wptr = window_ptr.data_ptr<int64_t>();
  int32_t* tcol = tile_col.data_ptr<int32_t>();
  window_bounds("expand_tiles", key, num_tiles, col_tiles, num_windows, wptr);
  for (int64_t i = 0; i < num_tiles; ++i) tcol[i] = key[i] % col_tiles;

  at::Tensor res_ptr = at::empty({num_rows + 1}, i64);
  int64_t* rptr = res_ptr.data_ptr<int64_t>();
  row_bounds("expand_tiles", res_row.data_ptr<int32_t>(), num_res, num_rows, rptr);

  at::Tensor tile_bits = at::zeros({planes, num_tiles, kTileRows, kTileWords}, tile_key.options());
  uint32_t* bits = reinterpret_cast<uint32_t*>(tile_bits.data_ptr<int32_t>());
  const int64_t plane_words = num_tiles * kTileRows * kTileWords;
  at::Tensor row_sums = at::empty({num_rows}, i64);
  int64_t* sums = row_sums.data_ptr<int64_t>();
  const void* counts = row_count.data_ptr();
  const uint8_t* col = entry_col.data_ptr<uint8_t>();
  const uint8_t* val = entry_val.defined() ? entry_val.data_ptr<uint8_t>() : nullptr;
  const int32_t* rval = res_val.defined() ? res_val.data_ptr<int32_t>() : nullptr;
  int64_t e = 0;
  for (int64_t w = 0; w < num_windows; ++w) {
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int64_t row = w * kTileRows + r;
      int64_t sum = 0;
      for (int64_t tile = wptr[w]; tile < wptr[w + 1]; ++tile) {
        const int64_t end = e + count_at(row_count, counts, tile * kTileRows + r);
        TORCH_CHECK(end <= num_entries, "expand_tiles: row_count holds more entries than entry_col");
        for (; e < end; ++e) {
          const int64_t v = val ? val[e] : 1;
          sum += v;
          const int64_t word = (tile * kTileRows + r) * kTileWords + col[e] / 32;
          for (int64_t p = 0; p < planes; ++p) {
            if ((v >> p) & 1) bits[p * plane_words + word] |= uint32_t{1} << (col[e] % 32);
          }
        }
      }
      if (row < num_rows) {
        for (int64_t k = rptr[row]; k < rptr[row + 1]; ++k) sum += rval ? rval[k] : 1;
        sums[row] = sum;
      }
    }
  }
  TORCH_CHECK(e == num_entries, "expand_tiles: row_count and entry_col disagree on the number of entries");
  return {window_ptr, tile_col, tile_bits, res_ptr, row_sums};
}

// One pass after a count.  The count: each row's entries (its segments of the window's tiles plus its residual
// run) -> res_ptr.  The pass: walk windows, rows, tiles with one running entry offset (the order tile_plan wrote
// them in), merging each row's tile entries (sorted: tiles in column order, columns inside a tile sorted) with its
// residual run (sorted) by column.
ExpandedCsr expand_csr_cpu(const at::Tensor& tile_key_in, const at::Tensor& row_count_in,
                           const at::Tensor& entry_col_in, const std::optional<at::Tensor>& entry_val_in,
                           const at::Tensor& res_row_in, const at::Tensor& res_col_in,
                           const std::optional<at::Tensor>& res_val_in, int64_t num_rows, int64_t num_cols) {
  check_expand_csr_args(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in, res_col_in, res_val_in,
                        num_rows, num_cols);
  const ExpandOperands o = expand_operands(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in,
                                           res_col_in, res_val_in, num_rows, num_cols);
  const at::Tensor &tile_key = o.tile_key, &row_count = o.row_count, &entry_col = o.entry_col, &res_row = o.res_row;
  const at::Tensor &res_col = o.res_col, &entry_val = o.entry_val, &res_val = o.res_val;
  const int64_t num_entries = o.num_entries, num_res = o.num_res, num_tiles = o.num_tiles;
  const int64_t col_tiles = o.col_tiles, num_windows = o.num_windows;
  const int64_t nnz = num_entries + num_res;
  const auto i64 = tile_key.options().dtype(at::kLong);

  // Tile boundaries of every window and residual boundaries of every row; columns in range.
  const int32_t* key = tile_key.data_ptr<int32_t>();
  std::vector<int64_t> wptr(num_windows + 1), rptr(num_rows + 1);
  window_bounds("expand_csr", key, num_tiles, col_tiles, num_windows, wptr.data());
  row_bounds("expand_csr", res_row.data_ptr<int32_t>(), num_res, num_rows, rptr.data());
  const int32_t* rcol = res_col.data_ptr<int32_t>();
  for (int64_t k = 0; k < num_res; ++k) {
    TORCH_CHECK(rcol[k] >= 0 && rcol[k] < num_cols, "expand_csr: res_col must be in [0, num_cols)");
  }

  // The count.
  const void* counts = row_count.data_ptr();
  at::Tensor out_ptr = at::empty({num_rows + 1}, i64);
  int64_t* optr = out_ptr.data_ptr<int64_t>();
  optr[0] = 0;
  int64_t tile_total = 0;
  for (int64_t w = 0; w < num_windows; ++w) {
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int64_t row = w * kTileRows + r;
      int64_t n = 0;
      for (int64_t tile = wptr[w]; tile < wptr[w + 1]; ++tile) n += count_at(row_count, counts, tile * kTileRows + r);
      TORCH_CHECK(row < num_rows || n == 0, "expand_csr: row_count holds entries past the last row");
      tile_total += n;
      if (row < num_rows) optr[row + 1] = optr[row] + n + rptr[row + 1] - rptr[row];
    }
  }
  TORCH_CHECK(tile_total == num_entries, "expand_csr: row_count and entry_col disagree on the number of entries");

  // The pass.
  const bool weighted = entry_val.defined() || res_val.defined();
  at::Tensor out_col = at::empty({nnz}, tile_key.options());
  at::Tensor out_val = at::empty({weighted ? nnz : 0}, tile_key.options());
  at::Tensor row_sums = at::empty({num_rows}, i64);
  int32_t* ocol = out_col.data_ptr<int32_t>();
  int32_t* oval = weighted ? out_val.data_ptr<int32_t>() : nullptr;
  int64_t* sums = row_sums.data_ptr<int64_t>();
  const uint8_t* col = entry_col.data_ptr<uint8_t>();
  const uint8_t* val = entry_val.defined() ? entry_val.data_ptr<uint8_t>() : nullptr;
  const int32_t* rval = res_val.defined() ? res_val.data_ptr<int32_t>() : nullptr;
  int64_t e = 0;
  for (int64_t row = 0; row < num_rows; ++row) {
    const int64_t w = row / kTileRows, r = row % kTileRows;
    int64_t o = optr[row], k = rptr[row], sum = 0;
    const int64_t k_end = rptr[row + 1];
    auto put = [&](int32_t c, int64_t v) {
      ocol[o] = c;
      if (oval) oval[o] = static_cast<int32_t>(v);
      sum += v;
      ++o;
    };
    for (int64_t tile = wptr[w]; tile < wptr[w + 1]; ++tile) {
      const int64_t base = static_cast<int64_t>(key[tile] % col_tiles) * kTileCols;
      const int64_t end = e + count_at(row_count, counts, tile * kTileRows + r);
      for (; e < end; ++e) {
        const int64_t c = base + col[e];
        TORCH_CHECK(c < num_cols, "expand_csr: a tile entry's column is past num_cols");
        for (; k < k_end && rcol[k] < c; ++k) put(rcol[k], rval ? rval[k] : 1);
        put(static_cast<int32_t>(c), val ? val[e] : 1);
      }
    }
    for (; k < k_end; ++k) put(rcol[k], rval ? rval[k] : 1);
    sums[row] = sum;
  }
  return {out_ptr, out_col, out_val, row_sums};
}

}  // namespace pyg_quant
