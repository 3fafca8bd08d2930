// quantize_pack_ranges on the GPU: one pass that takes each row's (dim 1, row layout) or each column's (dim 0,
// column layout) range and quantizes, packs and sums with it; the other combinations compose quantize_pack.  Ranges
// and codes follow the float32 recipe of csrc/quantize_steps.h, shared with the CPU, so they equal the CPU's.
#include "quantize_cuda.h"

#include "layout.h"
#include "ordered_key.h"
#include "quantize_args.h"
#include "quantize_ranges.h"
#include "quantize_steps.h"
#include "quantize_common.cuh"
#include "scratch_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

// Per-row ranges, quantize and pack (row layout): a group of kLanes lanes owns a row, kSplit lanes a 32-column
// word (8 columns each when kSplit = 4: a 64-column row then takes 8 lanes, which keeps the GPU full at 32K rows),
// the groups' word slots stepping through the row's words.  A lane reads its columns for the min and max (reduced
// across the group with shuffles), computes the range with the float32 steps of to_bit, reads them again (from
// L1), and sets its bits of each plane word in registers; the kSplit parts of a word are OR-ed with shuffles and
// the first lane stores it.  No ballots and no shared memory; code sums come from the same codes.  Every loop
// runs the same trip count on every lane of the warp (lanes past the last row or word compute zeros and store
// nothing), so the shuffles always see the whole warp; rows past the logical shape are written as zeros.
template <int Bits, int kLanes, int kSplit>
__global__ void quantize_pack_row_ranges_kernel(const float* __restrict__ x, const float* __restrict__ noise,
                                                int64_t rows, int64_t cols, int64_t outer_pad, int64_t words,
                                                uint32_t* __restrict__ out, int64_t plane_stride,
                                                float* __restrict__ lo_out, float* __restrict__ scale_out,
                                                int64_t* __restrict__ sums_out) {
  constexpr float kMaxCode = static_cast<float>((1 << Bits) - 1);
  constexpr int kRowsPerWarp = 32 / kLanes, kWordSlots = kLanes / kSplit, kPartCols = 32 / kSplit;
  const int lane = threadIdx.x & 31, slot = lane % kLanes, word_slot = slot / kSplit, part = slot % kSplit;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t live_words = (cols + 31) / 32;
  for (int64_t base = warp * kRowsPerWarp; base < outer_pad; base += warps * kRowsPerWarp) {
    const int64_t r = base + lane / kLanes;
    const bool live_row = r < rows;
    const float* row = x + (live_row ? r : 0) * cols;
    float mn = INFINITY, mx = -INFINITY;
    bool has_nan = false;
    if (live_row) {
      for (int64_t w = word_slot; w < live_words; w += kWordSlots) {
        const int64_t c0 = w * 32 + part * kPartCols;
        const int valid = static_cast<int>(max(min(cols - c0, static_cast<int64_t>(kPartCols)), int64_t{0}));
#pragma unroll
        for (int k = 0; k < kPartCols; ++k) {
          if (k < valid) {
            const float v = row[c0 + k];
            has_nan |= v != v;
            mn = fminf(mn, v);
            mx = fmaxf(mx, v);
          }
        }
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
      mn = fminf(mn, __shfl_xor_sync(kFullMask, mn, offset));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, offset));
      has_nan |= __shfl_xor_sync(kFullMask, static_cast<int>(has_nan), offset) != 0;
    }
    if (has_nan) mn = mx = NAN;  // amin/amax propagate NaN
    const Range range = range_of(mn, mx, kMaxCode);
    if (live_row && slot == 0) {
      lo_out[r] = range.lo;
      scale_out[r] = range.scale;
    }
    const float* row_noise = noise && live_row ? noise + r * cols : nullptr;
    uint32_t* row_out = out + min(r, outer_pad - 1) * words;
    int64_t sum = 0;
    for (int64_t w0 = 0; w0 < live_words; w0 += kWordSlots) {  // the same trip count on every lane
      const int64_t w = w0 + word_slot;
      const int64_t c0 = w * 32 + part * kPartCols;
      const int valid =
          live_row && w < live_words ? static_cast<int>(max(min(cols - c0, static_cast<int64_t>(kPartCols)), int64_t{0})) : 0;
      uint32_t plane[Bits];
#pragma unroll
      for (int p = 0; p < Bits; ++p) plane[p] = 0;
#pragma unroll
      for (int k = 0; k < kPartCols; ++k) {
        if (k < valid) {
          const uint32_t q = code_of(row[c0 + k], range, row_noise ? row_noise[c0 + k] : 0.5f, kMaxCode);
          sum += q;
#pragma unroll
          for (int p = 0; p < Bits; ++p) plane[p] |= ((q >> p) & 1u) << (part * kPartCols + k);
        }
      }
#pragma unroll
      for (int offset = kSplit / 2; offset > 0; offset >>= 1) {
#pragma unroll
        for (int p = 0; p < Bits; ++p) plane[p] |= __shfl_xor_sync(kFullMask, plane[p], offset);
      }
      if (r < outer_pad && part == 0 && w < live_words) {
#pragma unroll
        for (int p = 0; p < Bits; ++p) row_out[p * plane_stride + w] = live_row ? plane[p] : 0u;
      }
    }
    if (r < outer_pad) {  // padding words of the row (and every word of a padding row past live_words)
      for (int64_t w = live_words + slot; w < words; w += kLanes) {
#pragma unroll
        for (int p = 0; p < Bits; ++p) row_out[p * plane_stride + w] = 0;
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullMask, sum, offset);
    if (r < outer_pad && slot == 0) sums_out[r] = sum;
  }
}

// Per-column ranges in two passes.  Pass 1 reduces each column's extrema into its column keys (ordered_key.h) with
// atomicMax, so the result does not depend on the order of the atomics; pass 2 decodes them (a NaN anywhere makes
// both ends NaN, as amin/amax do).  A caller that has the keys already (quant_mlp's col_keys, made as its kernel
// stores the values) skips pass 1.

// Pass 1 (column layout): extrema of 32 columns over 256-row slabs, one atomic per column and block.  (Smaller slabs
// with more loads in flight are slower: twice the same-address atomics.)
constexpr int kRangeCols = 32, kRangeWarps = 8, kRangeRowsPerThread = 32;

__global__ void column_extrema_kernel(const float* __restrict__ x, int64_t rows, int64_t cols,
                                      unsigned long long* __restrict__ max_bits,
                                      unsigned long long* __restrict__ min_bits) {
  __shared__ unsigned long long block_max[kRangeWarps][kRangeCols], block_min[kRangeWarps][kRangeCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kRangeCols + tx;
  unsigned long long hi = 0, lo = 0;
  if (c < cols) {
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRangeWarps * kRangeRowsPerThread;
    const int64_t r_end = min(rows, r0 + kRangeWarps * kRangeRowsPerThread);
    for (int64_t r = r0 + ty; r < r_end; r += kRangeWarps) {
      const float v = x[r * cols + c];
      hi = max(hi, static_cast<unsigned long long>(ordered_key(v)));
      lo = max(lo, static_cast<unsigned long long>(min_slot_key(v)));
    }
  }
  block_max[ty][tx] = hi;
  block_min[ty][tx] = lo;
  __syncthreads();
  if (ty == 0 && c < cols) {
    for (int i = 1; i < kRangeWarps; ++i) {
      hi = max(hi, block_max[i][tx]);
      lo = max(lo, block_min[i][tx]);
    }
    atomicMax(max_bits + c, hi);
    atomicMax(min_bits + c, lo);
  }
}

// A 32 x 32 bit matrix held one row a lane (bit b of lane r's word is element (r, b)), transposed across the warp:
// lane b returns column b (bit r = element (r, b)).  Five rounds that swap the off-diagonal blocks of halving size:
// the upper rows of a pair of lanes take the lower rows' left bits into their right half, the lower rows the upper
// rows' right bits into their left half.  Every lane of the warp takes part.
__device__ __forceinline__ uint32_t transpose_bits32(uint32_t x, int lane) {
#pragma unroll
  for (int j = 16; j > 0; j >>= 1) {
    const uint32_t left = j == 16 ? 0x0000ffffu : j == 8 ? 0x00ff00ffu : j == 4 ? 0x0f0f0f0fu
                        : j == 2 ? 0x33333333u : 0x55555555u;  // bit positions b with (b & j) == 0
    const uint32_t y = __shfl_xor_sync(kFullMask, x, j);
    const bool upper = (lane & j) == 0;
    const uint32_t keep = upper ? left : ~left;
    const uint32_t moved = upper ? y << j : y >> j;
    x = (x & keep) | (moved & ~keep);
  }
  return x;
}

// Pass 2 (column layout): a warp owns one 32-row slab (plane word w, lane = row) and 16 columns; a block of
// kColWarps warps owns kColSlabs consecutive slabs and one chunk of 32 padded columns (two warps a slab).  A lane
// issues its row's 16 loads, lane c < 16 decodes column c's range meanwhile (each warp its own), and a lane forms
// the 16 codes and packs them into its row's code words (the row codes, container(bits) bits a code); those words,
// transposed across the warp (transpose_bits32), are the plane words: lane b of word j holds plane b % container of
// column 16 j / (32 / container) + b / container.  Column sums: each plane word's popcount, shifted by its plane and
// added over the column's lanes, then over the block's slabs in shared memory (skipped when sums is null).
// Counted, 4 bits: ~7 instructions a code and ~30 a transposed word (two words for 16 columns), for 32 rows at
// once: building the plane words by transposing the row codes needs far fewer instructions than ballots per plane
// and column (which also ran for the padding columns).  The kernel is latency-bound (loads, range, codes, five
// shuffle rounds, stores, a block barrier, one atomic a column; see benchmarks/RESULTS.md, Layers and kernels).
// Columns past cols and rows past rows get code 0: zero plane words, zero row codes, nothing summed.
constexpr int kColWarps = 8, kColGroup = 16, kGroupsPerChunk = 32 / kColGroup, kColSlabs = kColWarps / kGroupsPerChunk;

template <int kBits, bool kNoise>
__global__ void __launch_bounds__(kColWarps * 32) quantize_pack_col_ranges_kernel(
    const float* __restrict__ x, const float* __restrict__ noise, int64_t rows, int64_t cols, int64_t words,
    const unsigned long long* __restrict__ max_bits, const unsigned long long* __restrict__ min_bits,
    const unsigned long long* __restrict__ stored_max, const unsigned long long* __restrict__ stored_min,
    uint32_t* __restrict__ out, int64_t plane_stride, float* __restrict__ lo_out, float* __restrict__ scale_out,
    unsigned long long* __restrict__ sums, uint8_t* __restrict__ row_codes, int64_t row_bytes, bool vector_loads) {
  constexpr float kMaxCode = static_cast<float>((1 << kBits) - 1);
  constexpr int kContainer = container_bits(kBits), kPerWord = 32 / kContainer;
  constexpr int kCodeBytes = kColGroup * kContainer / 8;  // a group's codes of one row: 2, 4, 8 or 16 bytes
  constexpr int kCodeWords = (kCodeBytes + 3) / 4;
  __shared__ uint32_t partial_sums[kColSlabs][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp % kGroupsPerChunk, slab = warp / kGroupsPerChunk;
  const int64_t chunk0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = chunk0 + kColGroup * group;
  const int64_t left = cols - c0;
  const int live_cols = left <= 0 ? 0 : left >= kColGroup ? kColGroup : static_cast<int>(left);
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kColSlabs + slab;
  const int64_t r = w * 32 + lane;
  const bool live_row = r < rows;
  const bool work = w < words && live_cols > 0;  // the same on every lane of the warp
  // The row's values first: their loads are in flight while the ranges are decoded.
  float v[kColGroup], u[kColGroup];
#pragma unroll
  for (int c = 0; c < kColGroup; ++c) v[c] = 0.0f, u[c] = 0.0f;
  if (work && live_row) {
    const int64_t offset = r * cols + c0;
    if (vector_loads) {  // cols % 4 == 0 and 16-byte aligned rows: live_cols is a multiple of 4
#pragma unroll
      for (int g = 0; g < kColGroup / 4; ++g) {
        if (4 * g < live_cols) {
          const float4 a = __ldg(reinterpret_cast<const float4*>(x + offset) + g);
          v[4 * g] = a.x, v[4 * g + 1] = a.y, v[4 * g + 2] = a.z, v[4 * g + 3] = a.w;
          if constexpr (kNoise) {
            const float4 b = __ldg(reinterpret_cast<const float4*>(noise + offset) + g);
            u[4 * g] = b.x, u[4 * g + 1] = b.y, u[4 * g + 2] = b.z, u[4 * g + 3] = b.w;
          }
        }
      }
    } else {
#pragma unroll
      for (int c = 0; c < kColGroup; ++c) {
        if (c < live_cols) {
          v[c] = __ldg(x + offset + c);
          if constexpr (kNoise) u[c] = __ldg(noise + offset + c);
        }
      }
    }
  }
  // Lane c < 16 decodes column c0 + c's range (every warp its own: no block barrier before the codes), read by
  // the warp with shuffles.
  Range range{0.0f, 0.0f, 0.0f};
  if (work && lane < live_cols) {
    float mn, mx;
    const unsigned long long seen_max = max_bits[c0 + lane], seen_min = min_bits[c0 + lane];
    if (stored_max == nullptr) {
      column_extrema(seen_max, seen_min, mn, mx);
    } else if (seen_max < kNonFiniteKey && seen_min < kNonFiniteKey) {
      column_extrema(stored_max[c0 + lane], stored_min[c0 + lane], mn, mx);
    } else {  // the column holds a NaN or inf: a NaN range, so that it reaches the output
      mn = mx = NAN;
    }
    range = range_of(mn, mx, kMaxCode);
    if (blockIdx.x == 0 && slab == 0) {
      lo_out[c0 + lane] = range.lo;
      scale_out[c0 + lane] = range.scale;
    }
  }
  const bool want_sums = sums != nullptr;  // the same in every thread of the grid
  // The row's codes, packed as its row codes: column c at bits c·container of the group's words.
  uint32_t code_words[kCodeWords];
#pragma unroll
  for (int j = 0; j < kCodeWords; ++j) code_words[j] = 0;
  if (work) {
#pragma unroll
    for (int c = 0; c < kColGroup; ++c) {
      const float lo = __shfl_sync(kFullMask, range.lo, c), inv = __shfl_sync(kFullMask, range.inv, c);
      const uint32_t q = live_row && c < live_cols ? code_of(v[c], lo, inv, kNoise ? u[c] : 0.5f, kMaxCode) : 0u;
      code_words[c / kPerWord] |= q << (kContainer * (c % kPerWord));
    }
  }
  // Every warp writes all kColGroup slots of its slab and group in partial_sums, zeros where it has no work (a
  // slab past the last word, a group past the last column), so the slots need no zeroing pass and no barrier
  // before these writes.
#pragma unroll
  for (int j = 0; j < kCodeWords; ++j) {
    const uint32_t word = work ? transpose_bits32(code_words[j], lane) : 0u;
    const int p = lane % kContainer, c = j * kPerWord + lane / kContainer;
    if (w < words && p < kBits && c < kColGroup) out[p * plane_stride + (c0 + c) * words + w] = word;
    if (want_sums) {
      uint32_t column_sum = static_cast<uint32_t>(__popc(word)) << p;
#pragma unroll
      for (int offset = 1; offset < kContainer; offset <<= 1)
        column_sum += __shfl_xor_sync(kFullMask, column_sum, offset);
      if (p == 0 && c < kColGroup) partial_sums[slab][kColGroup * group + c] = column_sum;
    }
  }
  if (w < words) {
    if (row_codes != nullptr) {
      // This group's bytes of the row (those below row_bytes: a row ends on a 16-byte boundary, which may fall
      // inside a group at 8-bit containers); the chunks' last group also zeroes the row's padding past them
      // (1-bit containers: 64 columns fill half of a 128-bit row).
      uint8_t* row = row_codes + r * row_bytes;
      const int64_t b0 = c0 * kContainer / 8;
      if constexpr (kCodeBytes == 2) {
        if (b0 + 2 <= row_bytes) *reinterpret_cast<uint16_t*>(row + b0) = static_cast<uint16_t>(code_words[0]);
      } else if constexpr (kCodeBytes == 4) {
        if (b0 + 4 <= row_bytes) *reinterpret_cast<uint32_t*>(row + b0) = code_words[0];
      } else if constexpr (kCodeBytes == 8) {
        if (b0 + 8 <= row_bytes) *reinterpret_cast<uint2*>(row + b0) = make_uint2(code_words[0], code_words[1]);
      } else {
        if (b0 + 16 <= row_bytes) {
          *reinterpret_cast<uint4*>(row + b0) = make_uint4(code_words[0], code_words[1], code_words[2], code_words[3]);
        }
      }
      if (blockIdx.y + 1 == gridDim.y && group + 1 == kGroupsPerChunk) {
        for (int64_t b = b0 + kCodeBytes; b < row_bytes; b += 4) *reinterpret_cast<uint32_t*>(row + b) = 0u;
      }
    }
  }
  if (!want_sums) return;
  __syncthreads();
  if (warp == 0 && chunk0 + lane < cols) {
    unsigned long long column_sum = 0;
#pragma unroll
    for (int i = 0; i < kColSlabs; ++i) column_sum += partial_sums[i][lane];
    if (column_sum != 0) atomicAdd(sums + chunk0 + lane, column_sum);
  }
}

}  // namespace

at::Tensor zeros_cuda(int64_t numel, const at::TensorOptions& options) {
  auto out = cuda_empty({numel}, options);
  if (numel > 0) {
    const c10::cuda::CUDAGuard guard(options.device());
    C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), c10::cuda::getCurrentCUDAStream()));
  }
  return out;
}

namespace {

// Ranges per column, codes in column layout (the layers' features before A·X): three launches (zeros for the
// reductions and sums, extrema, quantize + pack + sums, and the row codes when asked for) in place of amin, amax,
// the range arithmetic, the pack, the sums and pack_row_codes.  Given col_keys, the extrema are read from them:
// the zeros are the sums' alone and the extrema pass is skipped; without the sums either (want_sums false), nothing
// is zeroed: the quantizer is the only launch.
QuantizedRangesAndRowCodes quantize_pack_col_ranges(const at::Tensor& x_in, int64_t bits,
                                                    const std::optional<at::Tensor>& noise_in, bool want_row_codes,
                                                    const std::optional<at::Tensor>& col_keys, bool want_sums,
                                                    const at::Tensor* stored_keys = nullptr) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto noise = noise_in ? noise_in->contiguous() : at::Tensor();
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t outer_pad = padded_outer(cols), words = packed_words(rows);
  auto planes = cuda_empty({bits, outer_pad, words}, x.options().dtype(at::kInt));
  auto lo = cuda_empty({cols}, x.options()), scale = cuda_empty({cols}, x.options());
  const int64_t row_bytes = row_code_bytes(cols, bits);
  auto codes = cuda_empty({want_row_codes ? words * 32 : 0, want_row_codes ? row_bytes : 0},
                          x.options().dtype(at::kByte));
  // One zeroed buffer: code sums (padded columns stay 0), then (without col_keys) the encoded maxima and minima.
  // Empty (no fill launched) when there is neither.
  const int64_t sums_len = want_sums ? outer_pad : 0;
  auto scratch = zeros_cuda(sums_len + (col_keys ? 0 : 2 * cols), x.options().dtype(at::kLong));
  auto* scratch_words = reinterpret_cast<unsigned long long*>(scratch.data_ptr<int64_t>());
  unsigned long long* sums = want_sums ? scratch_words : nullptr;
  const unsigned long long* max_bits =
      col_keys ? reinterpret_cast<const unsigned long long*>(col_keys->data_ptr<int64_t>()) : scratch_words + sums_len;
  const unsigned long long* min_bits = max_bits + cols;
  const unsigned long long* stored_max =
      stored_keys ? reinterpret_cast<const unsigned long long*>(stored_keys->data_ptr<int64_t>()) : nullptr;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t col_blocks = (cols + kRangeCols - 1) / kRangeCols;
  TORCH_CHECK_VALUE(col_blocks <= 65535 && outer_pad / 32 <= 65535, "too many columns for one launch");
  if (!col_keys) {
    const dim3 extrema_grid((rows + kRangeWarps * kRangeRowsPerThread - 1) / (kRangeWarps * kRangeRowsPerThread),
                            col_blocks);
    TORCH_CHECK_VALUE(extrema_grid.x <= 2147483647u, "too many rows for one launch");
    column_extrema_kernel<<<extrema_grid, dim3(kRangeCols, kRangeWarps), 0, stream>>>(
        x.data_ptr<float>(), rows, cols, scratch_words + sums_len, scratch_words + sums_len + cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t slab_blocks = (words + kColSlabs - 1) / kColSlabs;
  TORCH_CHECK_VALUE(slab_blocks <= 2147483647, "too many rows for one launch");
  const dim3 grid(static_cast<unsigned>(slab_blocks), outer_pad / 32);
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vector_loads =
      cols % 4 == 0 && aligned16(x.data_ptr<float>()) && (!noise.defined() || aligned16(noise.data_ptr<float>()));
  dispatch_bits(bits, [&](auto bits_tag) {
    constexpr int kBits = decltype(bits_tag)::value;
    const auto launch = [&](auto kernel) {
      kernel<<<grid, kColWarps * 32, 0, stream>>>(
          x.data_ptr<float>(), noise.defined() ? noise.data_ptr<float>() : nullptr, rows, cols, words, max_bits,
          min_bits, stored_max, stored_max ? stored_max + cols : nullptr,
          reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>()), outer_pad * words,
          lo.data_ptr<float>(), scale.data_ptr<float>(), sums, want_row_codes ? codes.data_ptr<uint8_t>() : nullptr,
          row_bytes, vector_loads);
    };
    if (noise.defined()) {
      launch(quantize_pack_col_ranges_kernel<kBits, true>);
    } else {
      launch(quantize_pack_col_ranges_kernel<kBits, false>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // (no sums: an empty tensor of its own, which does not keep the extrema's memory)
  at::Tensor sums_out = sums_len == scratch.numel() ? scratch
                        : sums_len == 0             ? at::empty({0}, scratch.options())
                                                    : scratch.narrow(0, 0, sums_len);
  return {planes, lo, scale, sums_out, codes};
}

}  // namespace

QuantizedRangesAndRowCodes quantize_pack_ranges_cuda(
    const at::Tensor& x_in, int64_t bits, int64_t dim, bool col_layout, const std::optional<at::Tensor>& noise_in,
    bool row_codes, const std::optional<at::Tensor>& col_keys, bool code_sums) {
  check_quantize_ranges_args(x_in, bits, dim, col_layout, noise_in, col_keys);
  if (dim == 0 && col_layout) return quantize_pack_col_ranges(x_in, bits, noise_in, row_codes, col_keys, code_sums);
  if (dim != 1 || col_layout) {
    return with_row_codes(quantize_pack_ranges_composed(x_in, bits, dim, col_layout, noise_in, quantize_pack_cuda,
                                                        code_sums_if(code_sums, packed_code_sums_cuda)),
                          x_in.size(1), col_layout, row_codes, pack_row_codes_cuda);
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto noise = noise_in ? noise_in->contiguous() : at::Tensor();
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t outer_pad = padded_outer(rows), words = packed_words(cols);
  auto planes = at::empty({bits, outer_pad, words}, x.options().dtype(at::kInt));
  auto lo = at::empty({rows}, x.options()), scale = at::empty({rows}, x.options());
  auto sums = at::empty({outer_pad}, x.options().dtype(at::kLong));
  // Up to 8 words a row: 4 lanes a word (so 4 to 32 lanes a row); longer rows: a warp, a lane a word.
  int word_slots = 1;
  while (word_slots < 8 && word_slots < (cols + 31) / 32) word_slots *= 2;
  const int lanes = (cols + 31) / 32 <= 8 ? 4 * word_slots : 32;
  const auto launch = [&](auto kernel) {
    kernel<<<blocks_for(outer_pad * lanes, 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), noise.defined() ? noise.data_ptr<float>() : nullptr, rows, cols, outer_pad, words,
        reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>()), outer_pad * words, lo.data_ptr<float>(),
        scale.data_ptr<float>(), sums.data_ptr<int64_t>());
  };
  const auto launch_lanes = [&](auto bits_tag) {
    constexpr int kBits = decltype(bits_tag)::value;
    if ((cols + 31) / 32 > 8) return launch(quantize_pack_row_ranges_kernel<kBits, 32, 1>);
    switch (lanes) {
      case 4: launch(quantize_pack_row_ranges_kernel<kBits, 4, 4>); break;
      case 8: launch(quantize_pack_row_ranges_kernel<kBits, 8, 4>); break;
      case 16: launch(quantize_pack_row_ranges_kernel<kBits, 16, 4>); break;
      default: launch(quantize_pack_row_ranges_kernel<kBits, 32, 4>); break;
    }
  };
  dispatch_bits(bits, launch_lanes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The row kernel forms the code sums in its pass anyway (one store a row): they are dropped when not asked for.
  return with_row_codes({planes, lo, scale, code_sums ? sums : no_code_sums(sums)}, cols, col_layout, row_codes,
                        pack_row_codes_cuda);
}

QuantizedRangesAndRowCodes quantize_pack_stored_ranges_cuda(const at::Tensor& x, int64_t bits,
                                                              const std::optional<at::Tensor>& col_keys,
                                                              const at::Tensor& stored_keys, bool row_codes,
                                                              bool code_sums) {
  check_quantize_ranges_args(x, bits, 0, true, std::nullopt, col_keys);
  check_col_keys(stored_keys, x.size(1), x.device(), "x", "stored_keys");
  return quantize_pack_col_ranges(x, bits, std::nullopt, row_codes, col_keys, code_sums, &stored_keys);
}

}  // namespace pyg_quant
