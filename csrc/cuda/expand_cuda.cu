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
#include "expand_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace pyg_quant {
namespace {
constexpr int kTileRows = 16, kTileWords = 8, kWarp = 32, kThreads = kTileRows * kWarp;

// ptr[k] = first i with keys[i] / divisor >= k, for k in [0, m]; optionally rest[i] = keys[i] % divisor.
__global__ void boundaries_kernel(const int32_t* __restrict__ keys, int64_t n, int64_t divisor, int64_t m,
                                  int64_t* __restrict__ ptr, int32_t* __restrict__ rest) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i > n) return;
  const int64_t lo = i == 0 ? -1 : min(m, static_cast<int64_t>(keys[i - 1]) / divisor);
  const int64_t hi = i == n ? m : min(m, static_cast<int64_t>(keys[i]) / divisor);
  for (int64_t k = lo + 1; k <= hi; ++k) ptr[k] = i;
  if (rest != nullptr && i < n) rest[i] = keys[i] % divisor;
}

__device__ __forceinline__ int64_t warp_sum(int64_t v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return __shfl_sync(0xffffffffu, v, 0);
}

template <typename Count>
__global__ void __launch_bounds__(kThreads) expand_window_kernel(
    const int64_t* __restrict__ window_ptr, const int64_t* __restrict__ tile_start, const Count* __restrict__ counts,
    const uint8_t* __restrict__ entry_col, const uint8_t* __restrict__ entry_val, int64_t num_entries,
    const int64_t* __restrict__ res_ptr, const int32_t* __restrict__ res_val, int64_t num_res, int64_t num_rows,
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
      sum += res_val != nullptr ? res_val[k] : 1;
    }
  }
  sum = warp_sum(sum);
  if (row < num_rows && lane == 0) row_sums[row] = sum;
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
  const at::Tensor tile_key = tile_key_in.contiguous(), row_count = row_count_in.contiguous();
  const at::Tensor entry_col = entry_col_in.contiguous(), res_row = res_row_in.contiguous();
  const at::Tensor entry_val = entry_val_in ? entry_val_in->contiguous() : at::Tensor();
  const at::Tensor res_val = res_val_in ? res_val_in->contiguous() : at::Tensor();
  const int64_t num_tiles = tile_key.size(0), num_res = res_row.size(0);
  const int64_t col_tiles = (num_cols + 255) / 256, num_windows = (num_rows + kTileRows - 1) / kTileRows;
  const auto i64 = tile_key.options().dtype(at::kLong);

  at::Tensor window_ptr = at::empty({num_windows + 1}, i64);
  at::Tensor tile_col = at::empty({num_tiles}, tile_key.options());
  at::Tensor res_ptr = at::empty({num_rows + 1}, i64);
  constexpr int kBoundaryThreads = 256;
  boundaries_kernel<<<blocks_for(num_tiles + 1, kBoundaryThreads), kBoundaryThreads, 0, stream>>>(
      tile_key.data_ptr<int32_t>(), num_tiles, col_tiles, num_windows, window_ptr.data_ptr<int64_t>(),
      tile_col.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  boundaries_kernel<<<blocks_for(num_res + 1, kBoundaryThreads), kBoundaryThreads, 0, stream>>>(
      res_row.data_ptr<int32_t>(), num_res, 1, num_rows, res_ptr.data_ptr<int64_t>(), nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const at::Tensor tile_entries = row_count.sum(1, /*keepdim=*/false, at::kLong);
  const at::Tensor tile_start = at::cumsum(tile_entries, 0).sub_(tile_entries);
  at::Tensor tile_bits = at::empty({planes, num_tiles, kTileRows, kTileWords}, tile_key.options());
  at::Tensor row_sums = at::empty({num_rows}, i64);
  auto launch = [&](auto* counts) {
    expand_window_kernel<<<num_windows, kThreads, 0, stream>>>(
        window_ptr.data_ptr<int64_t>(), tile_start.data_ptr<int64_t>(), counts, entry_col.data_ptr<uint8_t>(),
        entry_val.defined() ? entry_val.data_ptr<uint8_t>() : nullptr, entry_col.size(0), res_ptr.data_ptr<int64_t>(),
        res_val.defined() ? res_val.data_ptr<int32_t>() : nullptr, num_res, num_rows, num_tiles, static_cast<int>(planes),
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

}  // namespace pyg_quant
