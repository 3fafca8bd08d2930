// Writes the bit tiles of a CompactAdjacency on the GPU (see csrc/cpu/expand_cpu.cpp for the entry order).
//
// Three kernels and two small torch reductions, no host synchronisation (every size is known on the host):
//  * boundaries: window_ptr and res_ptr from the sorted tile keys / residual rows (one thread per key), and
//    tile_col;
//  * torch: each tile's entry count and their exclusive prefix sum (where each window's entries start);
//  * one block per 16-row window, one warp per row: the warp scans the row's counts over the window's tiles
//    32 at a time; each lane then owns one (tile, row) segment and builds its 8 words per plane in shared
//    memory and stores them (every word of every tile is written once: no memset, no atomics); the warp
//    also sums the row's values, its residual entries included, into row_sums.
// The plan's indices and residual values are read in the width they come in (int8, int16 or int32: IntArray), so
// that a loader batch's narrowed parts need no widening kernels.
//
// expand_csr (the same plan decoded without tiles, every entry in one CSR sorted by (row, column)) runs the two
// boundary kernels, then
//  * count_kernel, one thread per row: the row's entries in the window's tiles plus its residual run;
//  * torch: their cumsum -> res_ptr (res_ptr[0] is written by count_kernel);
//  * merge_kernel, one thread per row: the row's tile entries are one run of the entry stream (entries are
//    row-major over the whole matrix), starting at res_ptr[row] minus the residual entries of the rows before
//    it; the thread walks the window's tiles along that run, merged by column with the row's residual run.
#include "expand_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "layout.h"

namespace pyg_quant {
namespace {
constexpr int kWarp = 32, kThreads = kTileRows * kWarp;

// An int8, int16 or int32 array read as int64; the width is the same for every thread (a uniform branch).
struct IntArray {
  const void* data;
  int width;  // bytes an element
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return width == 4 ? static_cast<const int32_t*>(data)[i]
                      : width == 2 ? static_cast<const int16_t*>(data)[i] : static_cast<const int8_t*>(data)[i];
  }
};

IntArray int_array(const at::Tensor& t) {
  return t.defined() ? IntArray{t.data_ptr(), static_cast<int>(t.element_size())} : IntArray{nullptr, 4};
}

// ptr[k] = first i with keys[i] / divisor >= k, for k in [0, m]; optionally rest[i] = keys[i] % divisor.
__global__ void boundaries_kernel(const IntArray keys, int64_t n, int64_t divisor, int64_t m,
                                  int64_t* __restrict__ ptr, int32_t* __restrict__ rest) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i > n) return;
  const int64_t lo = i == 0 ? -1 : min(m, keys[i - 1] / divisor);
  const int64_t hi = i == n ? m : min(m, keys[i] / divisor);
  for (int64_t k = lo + 1; k <= hi; ++k) ptr[k] = i;
  if (rest != nullptr && i < n) rest[i] = static_cast<int32_t>(keys[i] % divisor);
}

__device__ __forceinline__ int64_t warp_sum(int64_t v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return __shfl_sync(0xffffffffu, v, 0);
}

template <typename Count>
__global__ void __launch_bounds__(kThreads) expand_window_kernel(
    const int64_t* __restrict__ window_ptr, const int64_t* __restrict__ tile_start, const Count* __restrict__ counts,
    const uint8_t* __restrict__ entry_col, const uint8_t* __restrict__ entry_val, int64_t num_entries,
    const int64_t* __restrict__ res_ptr, const IntArray res_val, int64_t num_res, int64_t num_rows,
    int64_t num_tiles, int planes, uint32_t* __restrict__ tile_bits, int64_t* __restrict__ row_sums) {
  __shared__ int64_t row_total[kTileRows];
  __shared__ uint32_t words[kTileWords * kThreads];  // words[w * kThreads + thread]: conflict-free
  const int64_t window = blockIdx.x;
  const int r = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // Clamped: malformed keys must not turn into out-of-range reads.
  const int64_t first = min(max(window_ptr[window], int64_t{0}), num_tiles);
  const int64_t last = min(max(window_ptr[window + 1], first), num_tiles);
  const int64_t plane_words = num_tiles * kTileRows * kTileWords;

  int64_t total = 0;
  for (int64_t t = first + lane; t < last; t += kWarp) total += counts[t * kTileRows + r];
  total = warp_sum(total);
  if (lane == 0) row_total[r] = total;
  __syncthreads();
  int64_t offset = first < num_tiles ? tile_start[first] : 0;
  for (int q = 0; q < r; ++q) offset += row_total[q];

  int64_t sum = 0;
  for (int64_t base = first; base < last; base += kWarp) {
    const int64_t t = base + lane;
    const int64_t count = t < last ? counts[t * kTileRows + r] : 0;
    int64_t inclusive = count;
    for (int d = 1; d < kWarp; d *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    const int64_t begin = offset + inclusive - count;
    const int64_t end = min(begin + count, num_entries);  // never read past the entries, whatever the counts
    if (t < last) {
      for (int p = 0; p < planes; ++p) {
        for (int w = 0; w < kTileWords; ++w) words[w * kThreads + threadIdx.x] = 0;
        for (int64_t e = begin; e < end; ++e) {
          const int col = entry_col[e];
          const int value = entry_val != nullptr ? entry_val[e] : 1;
          if (p == 0) sum += value;
          if ((value >> p) & 1) words[(col / 32) * kThreads + threadIdx.x] |= 1u << (col % 32);
        }
        uint32_t* out = tile_bits + p * plane_words + (t * kTileRows + r) * kTileWords;
        for (int w = 0; w < kTileWords; ++w) out[w] = words[w * kThreads + threadIdx.x];
      }
    }
    offset += __shfl_sync(0xffffffffu, inclusive, kWarp - 1);
  }
  const int64_t row = window * kTileRows + r;
  if (row < num_rows) {
    const int64_t res_end = min(res_ptr[row + 1], num_res);
    for (int64_t k = max(res_ptr[row], int64_t{0}) + lane; k < res_end; k += kWarp) {
      sum += res_val.data != nullptr ? res_val[k] : 1;
    }
  }
  sum = warp_sum(sum);
  if (row < num_rows && lane == 0) row_sums[row] = sum;
}

// counts -> out_ptr[row + 1] (out_ptr[0] = 0): entries of the row in the window's tiles plus its residual run.
template <typename Count>
__global__ void count_kernel(const int64_t* __restrict__ window_ptr, const Count* __restrict__ counts,
                             const int64_t* __restrict__ res_ptr, int64_t num_res, int64_t num_rows, int64_t num_tiles,
                             int64_t* __restrict__ out_counts, int64_t* __restrict__ out_ptr) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row == 0) out_ptr[0] = 0;
  if (row >= num_rows) return;
  const int64_t window = row / kTileRows, r = row % kTileRows;
  const int64_t first = min(max(window_ptr[window], int64_t{0}), num_tiles);
  const int64_t last = min(max(window_ptr[window + 1], first), num_tiles);
  int64_t n = 0;
  for (int64_t t = first; t < last; ++t) n += max(static_cast<int64_t>(counts[t * kTileRows + r]), int64_t{0});
  const int64_t res_begin = min(max(res_ptr[row], int64_t{0}), num_res);
  const int64_t res_end = min(max(res_ptr[row + 1], res_begin), num_res);
  out_counts[row] = n + res_end - res_begin;
}

// One thread per row: the row's tile entries merged by column with its residual run (both sorted).
template <typename Count>
__global__ void merge_kernel(const IntArray tile_key, const int64_t* __restrict__ window_ptr,
                             const Count* __restrict__ counts, const uint8_t* __restrict__ entry_col,
                             const uint8_t* __restrict__ entry_val, int64_t num_entries,
                             const int64_t* __restrict__ res_ptr, const IntArray res_col,
                             const IntArray res_val, int64_t num_res, int64_t num_rows, int64_t num_tiles,
                             int64_t col_tiles, const int64_t* __restrict__ out_ptr, int64_t nnz,
                             int32_t* __restrict__ out_col, int32_t* __restrict__ out_val,
                             int64_t* __restrict__ row_sums) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= num_rows) return;
  const int64_t window = row / kTileRows, r = row % kTileRows;
  // Clamped: malformed plans must not turn into out-of-range reads or writes.
  const int64_t first = min(max(window_ptr[window], int64_t{0}), num_tiles);
  const int64_t last = min(max(window_ptr[window + 1], first), num_tiles);
  int64_t k = min(max(res_ptr[row], int64_t{0}), num_res);
  const int64_t k_end = min(max(res_ptr[row + 1], k), num_res);
  int64_t o = min(max(out_ptr[row], int64_t{0}), nnz);
  const int64_t o_end = min(max(out_ptr[row + 1], o), nnz);
  int64_t e = max(o - k, int64_t{0});  // tile entries of the rows before this one
  int64_t sum = 0;
  for (int64_t t = first; t < last && o < o_end; ++t) {
    const int64_t base = (tile_key[t] % col_tiles) * kTileCols;
    const int64_t end = min(e + max(static_cast<int64_t>(counts[t * kTileRows + r]), int64_t{0}), num_entries);
    for (; e < end && o < o_end; ++e) {
      const int64_t c = base + entry_col[e];
      for (; k < k_end && res_col[k] < c && o < o_end; ++k, ++o) {
        const int32_t v = res_val.data != nullptr ? static_cast<int32_t>(res_val[k]) : 1;
        out_col[o] = static_cast<int32_t>(res_col[k]);
        if (out_val != nullptr) out_val[o] = v;
        sum += v;
      }
      if (o < o_end) {
        const int32_t v = entry_val != nullptr ? entry_val[e] : 1;
        out_col[o] = static_cast<int32_t>(c);
        if (out_val != nullptr) out_val[o] = v;
        sum += v;
        ++o;
      }
    }
  }
  for (; k < k_end && o < o_end; ++k, ++o) {
    const int32_t v = res_val.data != nullptr ? static_cast<int32_t>(res_val[k]) : 1;
    out_col[o] = static_cast<int32_t>(res_col[k]);
    if (out_val != nullptr) out_val[o] = v;
    sum += v;
  }
  row_sums[row] = sum;
}

int64_t blocks_for(int64_t threads, int64_t per_block) { return (threads + per_block - 1) / per_block; }
}  // namespace

ExpandedTiles expand_tiles_cuda(const at::Tensor& tile_key_in, const at::Tensor& row_count_in,
                                const at::Tensor& entry_col_in, const std::optional<at::Tensor>& entry_val_in,
                                const at::Tensor& res_row_in, const std::optional<at::Tensor>& res_val_in,
                                int64_t num_rows, int64_t num_cols, int64_t planes) {
  check_expand_args(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in, res_val_in, num_rows, num_cols,
                    planes);
  const c10::cuda::CUDAGuard guard(tile_key_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const ExpandOperands o = expand_operands(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in,
                                           std::nullopt, res_val_in, num_rows, num_cols, /*narrow=*/true);
  const at::Tensor &tile_key = o.tile_key, &row_count = o.row_count, &entry_col = o.entry_col, &res_row = o.res_row;
  const at::Tensor &entry_val = o.entry_val, &res_val = o.res_val;
  const int64_t num_tiles = o.num_tiles, num_res = o.num_res, col_tiles = o.col_tiles, num_windows = o.num_windows;
  const auto i64 = tile_key.options().dtype(at::kLong), i32 = tile_key.options().dtype(at::kInt);

  at::Tensor window_ptr = at::empty({num_windows + 1}, i64);
  at::Tensor tile_col = at::empty({num_tiles}, i32);
  at::Tensor res_ptr = at::empty({num_rows + 1}, i64);
  constexpr int kBoundaryThreads = 256;
  boundaries_kernel<<<blocks_for(num_tiles + 1, kBoundaryThreads), kBoundaryThreads, 0, stream>>>(
      int_array(tile_key), num_tiles, col_tiles, num_windows, window_ptr.data_ptr<int64_t>(),
      tile_col.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  boundaries_kernel<<<blocks_for(num_res + 1, kBoundaryThreads), kBoundaryThreads, 0, stream>>>(
      int_array(res_row), num_res, 1, num_rows, res_ptr.data_ptr<int64_t>(), nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const at::Tensor tile_entries = row_count.sum(1, /*keepdim=*/false, at::kLong);
  const at::Tensor tile_start = at::cumsum(tile_entries, 0).sub_(tile_entries);
  at::Tensor tile_bits = at::empty({planes, num_tiles, kTileRows, kTileWords}, i32);
  at::Tensor row_sums = at::empty({num_rows}, i64);
  auto launch = [&](auto* counts) {
    expand_window_kernel<<<num_windows, kThreads, 0, stream>>>(
        window_ptr.data_ptr<int64_t>(), tile_start.data_ptr<int64_t>(), counts, entry_col.data_ptr<uint8_t>(),
        entry_val.defined() ? entry_val.data_ptr<uint8_t>() : nullptr, entry_col.size(0), res_ptr.data_ptr<int64_t>(),
        int_array(res_val), num_res, num_rows, num_tiles, static_cast<int>(planes),
        reinterpret_cast<uint32_t*>(tile_bits.data_ptr<int32_t>()), row_sums.data_ptr<int64_t>());
  };
  if (row_count.scalar_type() == at::kByte) {
    launch(row_count.data_ptr<uint8_t>());
  } else {
    launch(row_count.data_ptr<int16_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {window_ptr, tile_col, tile_bits, res_ptr, row_sums};
}

ExpandedCsr expand_csr_cuda(const at::Tensor& tile_key_in, const at::Tensor& row_count_in,
                            const at::Tensor& entry_col_in, const std::optional<at::Tensor>& entry_val_in,
                            const at::Tensor& res_row_in, const at::Tensor& res_col_in,
                            const std::optional<at::Tensor>& res_val_in, int64_t num_rows, int64_t num_cols) {
  check_expand_csr_args(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in, res_col_in, res_val_in,
                        num_rows, num_cols);
  const c10::cuda::CUDAGuard guard(tile_key_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const ExpandOperands o = expand_operands(tile_key_in, row_count_in, entry_col_in, entry_val_in, res_row_in,
                                           res_col_in, res_val_in, num_rows, num_cols, /*narrow=*/true);
  const at::Tensor &tile_key = o.tile_key, &row_count = o.row_count, &entry_col = o.entry_col, &res_row = o.res_row;
  const at::Tensor &res_col = o.res_col, &entry_val = o.entry_val, &res_val = o.res_val;
  const int64_t num_tiles = o.num_tiles, num_entries = o.num_entries, num_res = o.num_res;
  const int64_t col_tiles = o.col_tiles, num_windows = o.num_windows;
  const int64_t nnz = num_entries + num_res;
  const bool weighted = entry_val.defined() || res_val.defined();
  const auto i64 = tile_key.options().dtype(at::kLong), i32 = tile_key.options().dtype(at::kInt);

  at::Tensor window_ptr = at::empty({num_windows + 1}, i64);
  at::Tensor res_ptr = at::empty({num_rows + 1}, i64);
  constexpr int kBoundaryThreads = 256, kRowThreads = 128;
  boundaries_kernel<<<blocks_for(num_tiles + 1, kBoundaryThreads), kBoundaryThreads, 0, stream>>>(
      int_array(tile_key), num_tiles, col_tiles, num_windows, window_ptr.data_ptr<int64_t>(), nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  boundaries_kernel<<<blocks_for(num_res + 1, kBoundaryThreads), kBoundaryThreads, 0, stream>>>(
      int_array(res_row), num_res, 1, num_rows, res_ptr.data_ptr<int64_t>(), nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  at::Tensor row_counts = at::empty({num_rows}, i64);
  at::Tensor out_ptr = at::empty({num_rows + 1}, i64);
  at::Tensor out_col = at::empty({nnz}, i32);
  at::Tensor out_val = at::empty({weighted ? nnz : 0}, i32);
  at::Tensor row_sums = at::empty({num_rows}, i64);
  const int64_t row_blocks = blocks_for(num_rows, kRowThreads);
  auto launch = [&](auto* counts) {
    count_kernel<<<row_blocks, kRowThreads, 0, stream>>>(window_ptr.data_ptr<int64_t>(), counts,
                                                        res_ptr.data_ptr<int64_t>(), num_res, num_rows, num_tiles,
                                                        row_counts.data_ptr<int64_t>(), out_ptr.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor tail = out_ptr.narrow(0, 1, num_rows);
    at::cumsum_out(tail, row_counts, 0);
    merge_kernel<<<row_blocks, kRowThreads, 0, stream>>>(
        int_array(tile_key), window_ptr.data_ptr<int64_t>(), counts, entry_col.data_ptr<uint8_t>(),
        entry_val.defined() ? entry_val.data_ptr<uint8_t>() : nullptr, num_entries, res_ptr.data_ptr<int64_t>(),
        int_array(res_col), int_array(res_val), num_res, num_rows,
        num_tiles, col_tiles, out_ptr.data_ptr<int64_t>(), nnz, out_col.data_ptr<int32_t>(),
        weighted ? out_val.data_ptr<int32_t>() : nullptr, row_sums.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (row_count.scalar_type() == at::kByte) {
    launch(row_count.data_ptr<uint8_t>());
  } else {
    launch(row_count.data_ptr<int16_t>());
  }
  return {out_ptr, out_col, out_val, row_sums};
}

}  // namespace pyg_quant
