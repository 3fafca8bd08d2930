// quant_mlp on the GPU: the whole chain of QuantLinear bit layers in one launch.
//
// A block stages every layer's weight codes once in shared memory in groups of 16 codes (four 32-bit words), stored
// [k4][o] (group k4 of output o at (k4·out + o)·16 bytes), so that the 32 lanes of a warp, which own consecutive
// output channels, read 32 consecutive groups with one 16-byte load each (512 bytes: four wavefronts, the least a
// warp's 16-byte load takes); the per-channel range, code sum and bias sit beside them (a layer whose input width is
// a multiple of 16 is staged 16 codes a load).  Then each warp owns kRows rows at a time (kRowsPerWarp = 4; grid-stride
// over groups of kRows rows).  The rows live in registers: lane j holds columns j, j+32, ... of each -- the same
// channels it computes as outputs, so a layer's output is already where the next layer's input must be.  Per layer and
// row: the row's min / max with order-preserving unsigned keys and one warp reduction each (__reduce_min/max_sync; a
// NaN makes both NaN, as amin / amax do), the range (lane i forms row i's, read back with shuffles) and codes with
// the float32 steps of quantize_steps.h (the row quantizer's), the codes as bytes in the row's shared buffer (so
// every lane can read the whole row 16 codes at a time), the code sum by one warp reduction, the exact int32
// product with __dp4a (u8 x u8 -> u32, at most 256·255·255 < 2^32), and bitmm's float32 epilogue (epilogue.h).
// The last layer's rows are stored coalesced, times their row_scale when one is given (GCN's D^-1/2 folded into
// its linear layer).  With col_keys (ordered_key.h), the column keys of the stored values are max-reduced into it as
// well (a warp's group of rows in registers, the block's warps in shared memory, one global atomic a column and
// block), so that quantize_pack_ranges can take the output's per-column ranges without reading it again (GIN's and
// GCN's requantization).  Those kernels are instantiated apart (kOutKeys), so the others keep their registers.
// With fixed per-column output ranges (quant_mlp_row_codes: calibrated ranges), a third instantiation (kOutCodes,
// store_codes) stores the output as the next aggregation's packed row codes instead of floats.
// Nothing but the output is allocated and nothing waits on the host.
//
// The input is float32 rows, or (quant_mlp_planes) the codes of a packed tensor, decoded with to_val's float32 steps
// as the rows are loaded, so that a layer fed the loader's codes (GCN's first X·W) skips dequantize's pass and its
// float32 round trip (12.8 MB written and read again at 32,000 x 100).  Column layout: a warp's 4 rows are 4 bits of
// one word of every column and plane; a lane loads its columns' words itself (the block's 8 warps read the same
// words, so L1 serves all but the first) and spreads the 4 bits to 4 bytes with one multiply; no shared-memory
// staging, whose barriers cost more than the reloads, and a column's range loaded once a group, since the decode's
// instructions are this path's cost.  Row layout: a lane
// reads the plane words of its columns straight from global memory (a warp's 32 columns share a word).
//
// Why kRows rows a warp: the product is bound by shared-memory loads.  With one row a warp, a lane loaded per row
// and layer words/4 × (1 LDS.128 of codes + 4·kChunks LDS.32 of weights), each weight word serving that one row:
// 4 × (1 + 8) = 36 for a 64 -> 64 layer, ~50 shared loads a row-layer with the epilogue's parameters.  With kRows
// rows each weight group (and each epilogue parameter) feeds kRows rows: words/4 × (kRows + kChunks) loads per
// kRows rows.  Each row keeps its own registers (h, acc), reductions and code buffer (32·kChunksIn bytes, a
// compile-time stride: every code's address is the lane's base plus an immediate).  The kernel is issue-bound, and
// most of a row's instructions are outside the product (its range, its codes, the float epilogue), so those are
// kept branch-free: the range is decoded by selects, the codes are stored at immediate offsets, and a product step
// is 4 + kChunks LDS.128 and 16·kChunks IDP with the steps unrolled to the widest input (mlp_layer).  Rows past the end (the last group
// only) carry zeros and store nothing; a group's rows are the same on every lane, so every warp-wide intrinsic
// still runs on the full warp.  Registers (ptxas 13.0, sm_80 / sm_90a), float input, kChunks 1, 2, 4, 8: 60 / 58,
// 66 / 64, 80 / 80, 126 / 128 at kRows = 4, no spills; with col_keys 48 / 62, 66 / 64, 79 / 80, 128 / 128.
#include "quant_mlp_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "epilogue.h"
#include "layout.h"
#include "quant_mlp_args.h"
#include "quantize_steps.h"
#include "row_codes.h"
#include "cuda/device_limits.h"
#include "cuda/scratch_cuda.h"
#include "ordered_key.h"

namespace pyg_quant {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Rows a warp carries at a time: each weight word loaded from shared memory feeds this many rows' __dp4a.
constexpr int kRowsPerWarp = 4;

// Rows per warp of the instantiation with `chunks` values per lane (the kernel's kRows; the host sizes the code
// buffers and the grid with it).  kRowsPerWarp for every width: even kChunks = 8 does not spill at 4 rows.
constexpr int rows_per_warp(int /*chunks*/) { return kRowsPerWarp; }


struct MlpLayer {
  const uint8_t* w;  // [out, in] codes in global memory
  const float* lo;
  const float* scale;
  const int64_t* sums;
  const float* bias;  // nullptr: none
  int in, out;
  int words;          // 32-bit words of a weight row in shared memory: ceil(in / 4) rounded up to a multiple of 4
  int w_offset;       // byte offsets into the dynamic shared memory: weight words, then
  int param_offset;   // lo[out], scale[out], bias[out] and bitmm_col_term[out] (float32)
  float max_code;
  int relu;
  int aligned;  // 1: in % 4 == 0 and w 4-byte aligned (a weight row is whole 32-bit words); 2: the same for 16 bytes
};

// What the chain's first layer reads.
enum InputKind { kFloatInput = 0, kColPlanesInput = 1, kRowPlanesInput = 2 };

struct MlpInput {
  const float* x;           // kFloatInput: float32 [rows, in0]
  const uint32_t* planes;   // the others: int32 [bits, outer, words] (layout.py), values lo + scale · q
  const float* lo;
  const float* scale;
  int64_t words, plane_stride;
  int bits;
  int dim;                  // the ranges: -1 one, 0 per column, 1 per row
};

struct MlpArgs {
  MlpLayer layer[kQuantMlpMaxLayers];
  int layers;
  int codes_offset;  // per-warp code buffers, 32 · kChunksIn bytes a row
  MlpInput input;
  float* out;
  const float* row_scale;  // nullptr: none
  int64_t rows;
  unsigned long long* col_keys;  // nullptr: none; else the output's column keys, max-reduced (ordered_key.h)
  int keys_offset;               // the block's own [2 · out_cols] uint32 column keys in shared memory
  // kOutCodes: the output quantized per column with fixed ranges, stored as codes instead of floats.
  uint32_t* out_codes;   // uint8 [groups · 32, 4 · row_words]: the row codes (row_codes.h), as words
  const float* out_lo;   // [out_cols]
  const float* out_inv;  // [out_cols]
  float out_max_code;
  int out_bits, row_words;
  int64_t groups;  // 32-row groups of the padded node count (the planes' words)
};

// What the kernel stores: float rows, float rows and their column keys, or codes with fixed per-column ranges.
enum OutputKind { kOutFloat = 0, kOutKeys = 1, kOutCodes = 2 };

// Rows r0 .. r0 + kRows - 1 of the chain's input into h (lane: columns lane, lane + 32, ...); rows past args.rows and
// columns past in0 are zeros.
template <int kChunks, int kRows, int kInput>
__device__ __forceinline__ void load_rows(const MlpArgs& args, int64_t r0, int in0, int lane,
                                          float (&h)[kRows][kChunks]) {
  if constexpr (kInput == kFloatInput) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const bool valid = r0 + i < args.rows;
      const float* x_row = args.input.x + (valid ? r0 + i : 0) * in0;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int c = lane + 32 * j;
        h[i][j] = valid && c < in0 ? x_row[c] : 0.0f;
      }
    }
  } else if constexpr (kInput == kColPlanesInput) {
    const MlpInput& in = args.input;
    // Bits r0 % 32 .. r0 % 32 + 3 of word r0 / 32 of column c's plane are the group's rows (r0 % 4 == 0).  The warps
    // of a block read the same words (its 32 rows), so all but the first load of a word hit L1; no barrier ties the
    // warps together.  Four planes of every column a round trip: one round trip at <= 4 bits.
    uint32_t codes[kChunks];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) codes[j] = 0;
    const int shift = static_cast<int>(r0 & 31);
    const uint32_t* base = in.planes + (r0 >> 5);
    for (int p0 = 0; p0 < in.bits; p0 += 4) {
      uint32_t word[kChunks][4];
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int c = lane + 32 * j;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          word[j][b] = c < in0 && p0 + b < in.bits
                           ? __ldg(base + (p0 + b) * in.plane_stride + static_cast<int64_t>(c) * in.words)
                           : 0u;
        }
      }
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          // The group's 4 bits spread to bit 0 of 4 bytes (the four partial products cannot overlap or carry).
          const uint32_t nibble = (word[j][b] >> shift) & 0xfu;
          codes[j] |= ((nibble * 0x00204081u) & 0x01010101u) << (p0 + b);
        }
      }
    }
    // Byte i of codes[j] is the code of row r0 + i, column lane + 32j (kRows <= 4 rows, codes <= 8 bits).  A
    // column's range (or the tensor's) is loaded once for the group's rows.
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = lane + 32 * j;
      const bool live_col = c < in0;
      if (in.dim != 1) {
        const int64_t g = in.dim == 0 ? min(c, in0 - 1) : 0;
        const float lo = __ldg(in.lo + g), scale = __ldg(in.scale + g);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          const bool live = live_col && r0 + i < args.rows;
          h[i][j] = live ? value_of((codes[j] >> (8 * i)) & 0xffu, lo, scale) : 0.0f;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          const bool live = live_col && r0 + i < args.rows;
          h[i][j] = live ? value_of((codes[j] >> (8 * i)) & 0xffu, __ldg(in.lo + r0 + i), __ldg(in.scale + r0 + i))
                         : 0.0f;
        }
      }
    }
  } else {
    const MlpInput& in = args.input;
    // Row layout: column c = lane + 32j is bit `lane` of word j of the row (a warp's lanes share the word, one
    // broadcast load).  A run-time loop over the planes (unrolled 8 deep it held every load in flight and spilled;
    // four planes a round trip was slower).
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = lane + 32 * j;
      const bool live_col = c < in0;
      uint32_t q[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) q[i] = 0;
      const uint32_t* word = in.planes + r0 * in.words + j;
#pragma unroll 1
      for (int p = 0; p < (live_col ? in.bits : 0); ++p) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          if (r0 + i < args.rows) q[i] |= ((__ldg(word + i * in.words + p * in.plane_stride) >> lane) & 1u) << p;
        }
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int64_t g = in.dim == 0 ? c : in.dim == 1 ? r0 + i : 0;
        const bool live = live_col && r0 + i < args.rows;
        h[i][j] = live ? value_of(q[i], __ldg(in.lo + g), __ldg(in.scale + g)) : 0.0f;
      }
    }
  }
}

// One bit layer on a warp's kRows rows: each row's range and codes from x (kIn values a lane: columns lane,
// lane + 32, ...), the exact code products, and bitmm's epilogue into y (kChunks values a lane).  x and y may be one
// array: x is read whole (into the codes) before y is written.  codes: the warp's kRows code buffers, kStride bytes
// apart (a compile-time stride, so that every code's address is the lane's base plus an immediate).
template <int kIn, int kChunks, int kRows, int kStride>
__device__ __forceinline__ void mlp_layer(const MlpLayer& L, const float (&x)[kRows][kIn], float (&y)[kRows][kChunks],
                                          uint8_t* codes, int lane) {
  static_assert(kStride >= 32 * kIn && kStride % 16 == 0, "a row's codes take 32·kIn bytes, read 16 at a time");
  extern __shared__ __align__(16) unsigned char smem[];
  const int in = L.in, out = L.out;
  const float max_code = L.max_code;
  // Each row's extrema as ordered keys, one warp reduction each.  A NaN makes both NaN, as amin / amax do: a
  // positive NaN keys above +inf and a negative one below -inf, so the reduced keys tell whether a row holds one.
  // Every lane decodes the (warp-uniform) reduced keys by selects and lane i keeps row i's, so that lane i then
  // forms row i's range (the two IEEE divisions run once for all the rows, not once a row) and every lane reads
  // the rows' ranges back with shuffles.
  float mn = 0.0f, mx = 0.0f;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    unsigned key_min = 0xffffffffu, key_max = 0u;
#pragma unroll
    for (int j = 0; j < kIn; ++j) {
      const bool live = lane + 32 * j < in;
      const unsigned key = ordered_key(x[i][j]);
      key_min = min(key_min, live ? key : 0xffffffffu);
      key_max = max(key_max, live ? key : 0u);
    }
    key_min = __reduce_min_sync(kFullMask, key_min);
    key_max = __reduce_max_sync(kFullMask, key_max);
    const bool nan = key_max > ordered_key(INFINITY) || key_min < ordered_key(-INFINITY);
    const float row_mn = nan ? __int_as_float(0x7fffffff) : from_ordered_key(key_min);
    const float row_mx = nan ? __int_as_float(0x7fffffff) : from_ordered_key(key_max);
    mn = lane == i ? row_mn : mn;
    mx = lane == i ? row_mx : mx;
  }
  const Range own = range_of(mn, mx, max_code);
  // Then each row's codes into its buffer, and their sum.  Columns past `in` (zeros) are coded too, branch-free:
  // their weight codes are zero, and they are left out of the sum.
  float row_lo[kRows], row_scale[kRows];
  unsigned sum[kRows];
  uint8_t* const lane_codes = codes + lane;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const Range range{__shfl_sync(kFullMask, own.lo, i), __shfl_sync(kFullMask, own.scale, i),
                      __shfl_sync(kFullMask, own.inv, i)};
    row_lo[i] = range.lo;
    row_scale[i] = range.scale;
    unsigned s = 0;
#pragma unroll
    for (int j = 0; j < kIn; ++j) {
      const uint32_t q = code_of(x[i][j], range, 0.5f, max_code);
      lane_codes[i * kStride + 32 * j] = static_cast<uint8_t>(q);
      s += lane + 32 * j < in ? q : 0u;
    }
    sum[i] = __reduce_add_sync(kFullMask, s);
  }
  __syncwarp();
  // The exact code products of output channels lane, lane + 32, ...: 16 codes a step, each weight group (one
  // 16-byte load: 16 codes of one output) feeding kRows rows.  The steps are unrolled to the widest input the
  // instantiation takes (32·kIn codes) behind a uniform guard, so every code load is the buffer plus an immediate
  // (a run-time loop of pointer increments spilled 8-32 bytes in four instantiations under their register caps).
  const uint4* ws = reinterpret_cast<const uint4*>(smem + L.w_offset);
  const int steps = (in + 15) / 16;
  unsigned acc[kRows][kChunks];
  const uint4* w_lane[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    w_lane[j] = ws + min(lane + 32 * j, out - 1);
#pragma unroll
    for (int i = 0; i < kRows; ++i) acc[i][j] = 0;
  }
#pragma unroll
  for (int k4 = 0; k4 < 2 * kIn; ++k4) {
    if (k4 < steps) {
      uint4 a[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) a[i] = *reinterpret_cast<const uint4*>(codes + i * kStride + 16 * k4);
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        if (32 * j < out) {
          const uint4 w = w_lane[j][k4 * out];
#pragma unroll
          for (int i = 0; i < kRows; ++i) {
            acc[i][j] = __dp4a(a[i].x, w.x, acc[i][j]);
            acc[i][j] = __dp4a(a[i].y, w.y, acc[i][j]);
            acc[i][j] = __dp4a(a[i].z, w.z, acc[i][j]);
            acc[i][j] = __dp4a(a[i].w, w.w, acc[i][j]);
          }
        }
      }
    }
  }
  // bitmm's epilogue; the results stay in registers as the next layer's inputs.
  const float* lo_w = reinterpret_cast<const float*>(smem + L.param_offset);
  float row_sum[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) row_sum[i] = static_cast<float>(sum[i]);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int o = lane + 32 * j;
    if (o < out) {
      const float w_lo = lo_w[o], w_scale = lo_w[out + o], bias = lo_w[2 * out + o], col_term = lo_w[3 * out + o];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        y[i][j] = bitmm_affine_epilogue(static_cast<float>(acc[i][j]), row_sum[i], col_term,
                                        row_lo[i], row_scale[i], w_lo, w_scale, bias, L.relu != 0);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i) y[i][j] = 0.0f;
    }
  }
  __syncwarp();  // every lane is done reading the codes before the next layer writes them
}

// The codes form of the output (kOutCodes): each warp runs the chain on its rows as the float kernel does and
// quantizes each value it would store with its column's fixed range (code_of, nearest: quantize_pack's steps on the
// float32 the float kernel stores), then stores the row's packed row codes (row_codes.h) itself: a lane's code
// shifted to its place in its 32-bit word, the word's lanes (32 / container of them, consecutive) OR-ed together by
// shuffles, the word stored by its first lane.  Nothing is shared between warps, so no barrier ties them (a barrier
// that let the block write the column-layout planes lined the warps' phases up and made the kernel far slower).
// The column-layout planes are made from the row codes when asked for (planes_from_row_codes).  The warps also
// cover the rows of the padded node count past args.rows (zero codes), so that every row is written: no memset.
template <int kChunks, int kRows, typename Chain>
__device__ __forceinline__ void store_codes(const MlpArgs& args, int out_cols, int lane, int warp,
                                            const Chain& run_chain) {
  const int container = container_bits(args.out_bits), per_word = 32 / container, row_words = args.row_words;
  const int slot = lane & (per_word - 1);  // the lane's place in its word (a chunk's 32 columns are whole words)
  const int64_t padded_rows = args.groups * 32;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kRows;
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kRows; r0 < padded_rows; r0 += step) {
    float h[kRows][kChunks];
    if (r0 < args.rows) {  // warp-uniform; rows wholly past args.rows read nothing
      run_chain(r0, h);
    } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
#pragma unroll
        for (int j = 0; j < kChunks; ++j) h[i][j] = 0.0f;
      }
    }
    const float own_scale =
        args.row_scale && lane < kRows && r0 + lane < args.rows ? __ldg(args.row_scale + r0 + lane) : 1.0f;
    // The lane's columns' ranges, loaded here (L1 hits after the first group) rather than held through the chain.
    float col_lo[kChunks], col_inv[kChunks];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int c = min(lane + 32 * j, out_cols - 1);
      col_lo[j] = __ldg(args.out_lo + c);
      col_inv[j] = __ldg(args.out_inv + c);
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float scale = __shfl_sync(kFullMask, own_scale, i);
      const bool live = r0 + i < args.rows;
      uint32_t* row_out = args.out_codes + (r0 + i) * row_words;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int c = lane + 32 * j;
        const uint32_t q = live && c < out_cols
                               ? code_of(__fmul_rn(h[i][j], scale), col_lo[j], col_inv[j], 0.5f, args.out_max_code)
                               : 0u;
        uint32_t word = q << (slot * container);
        for (int offset = 1; offset < per_word; offset <<= 1) word |= __shfl_xor_sync(kFullMask, word, offset);
        const int w = j * container + lane / per_word;
        if (slot == 0 && w < row_words) row_out[w] = word;
      }
      // Words past the chunks' columns (rows are padded to 16 bytes): zeros.
      for (int w = kChunks * container + lane; w < row_words; w += 32) row_out[w] = 0u;
    }
  }
}

// The code-input kernels at one chunk ask for 4 resident blocks (64 registers): ptxas's own choice was 48 with
// 8-12 bytes of spills on sm_90a.  The float kernel at four chunks with col_keys asks for 3 (80 registers, as
// without them): ptxas's own choice was 94 on sm_90a, one block less.  The column-code kernels at two chunks ask
// for 3 (80 registers): left alone, ptxas took 64 on sm_80 with col_keys and spilled 20 bytes.  0 leaves the choice
// to ptxas (no spills).
// The kernels with a wider first layer (chunks_in > chunks) ask for 4 blocks (64 registers) where that does not
// spill: at one later chunk (3 with column codes: at 4 they spilled 8 bytes with col_keys on sm_90a, and left alone
// ptxas took 48 on sm_80 and spilled 16), and at two for float input without col_keys (with them, or with column
// codes, 64 registers spilled 12-16 bytes).  The row-code kernel at four chunks with col_keys asks for 2: left
// alone, ptxas took 80 on sm_90a and spilled 8 bytes; the column-code kernels at four chunks ask for 2 as well (left
// alone they took 80 and spilled 4-16 bytes on sm_90a).  The wide-first float kernel without col_keys asks for 4 on
// sm_90a and leaves sm_80 to ptxas (64 registers: asked for 4 or 3 there it spilled 12-16 bytes).  The float
// kernels at two chunks ask for 4 on sm_90a: with col_keys ptxas took 66 registers (3 blocks, slower than the
// unkeyed kernel at 4) and, held to 64, spilled the sign word of the output row pitch until the
// store's row offset took that pitch zero-extended (sm_80 is left to ptxas: held to 64 it spilled 4 bytes).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kWideFloatBlocks = 0, kFloatTwoChunkBlocks = 0;
#else
constexpr int kWideFloatBlocks = 4, kFloatTwoChunkBlocks = 4;
#endif
constexpr int quant_mlp_min_blocks(int chunks_in, int chunks, int input, bool keys) {
  return chunks_in != chunks ? (chunks == 1   ? (input == kColPlanesInput ? 3 : 4)
                                : input == kFloatInput && !keys ? kWideFloatBlocks
                                                                : 0)
         : chunks == 4 && (input == kColPlanesInput || (input == kRowPlanesInput && keys)) ? 2
         : input != kFloatInput && chunks == 1 ? 4
         : input == kFloatInput && chunks == 2 ? kFloatTwoChunkBlocks
         : (keys && input == kFloatInput && chunks == 4) || (input == kColPlanesInput && chunks == 2) ? 3
                                                                                                    : 0;
}

// The codes kernels (kOutCodes) ask for what the float kernels ask for, except at two chunks after a wider first
// layer or on row-layout codes: there 64 registers spilled 4-16 bytes (sm_90a), so they ask for 3 blocks; and the
// float kernel at four chunks on sm_80, where ptxas left alone took 80 registers and spilled 20 bytes: 2.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kCodesFourChunkBlocks = 2;
#else
constexpr int kCodesFourChunkBlocks = 0;
#endif
constexpr int quant_mlp_codes_min_blocks(int chunks_in, int chunks, int input) {
  return chunks == 2 && (input == kRowPlanesInput || chunks_in != chunks)     ? 3
         : chunks_in == 4 && chunks == 4 && input == kFloatInput ? kCodesFourChunkBlocks
                                                                 : quant_mlp_min_blocks(chunks_in, chunks, input, false);
}

template <int kChunksIn, int kChunks, int kRows, int kInput, int kOut>
__global__ void __launch_bounds__(kThreads, kOut == kOutCodes ? quant_mlp_codes_min_blocks(kChunksIn, kChunks, kInput)
                                                              : quant_mlp_min_blocks(kChunksIn, kChunks, kInput,
                                                                                     kOut == kOutKeys))
    quant_mlp_kernel(const __grid_constant__ MlpArgs args) {
  constexpr bool kKeys = kOut == kOutKeys;
  static_assert(kRows <= 32, "lane i forms row i's range");
  static_assert(kInput == kFloatInput || kRows <= 4, "a code input's rows are the bytes of one register");
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ MlpLayer layers[kQuantMlpMaxLayers];
  if (threadIdx.x < args.layers) layers[threadIdx.x] = args.layer[threadIdx.x];
  for (int l = 0; l < args.layers; ++l) {
    const MlpLayer& L = args.layer[l];
    uint32_t* ws = reinterpret_cast<uint32_t*>(smem + L.w_offset);
    if (L.aligned == 2) {
      // Whole 16-code groups (in % 16 == 0, so words = in / 4: no padding): thread i copies group k4 of output o,
      // one 16-byte load and one 16-byte store -- consecutive threads, consecutive outputs.
      uint4* ws4 = reinterpret_cast<uint4*>(ws);
      for (int i = threadIdx.x; i < L.words / 4 * L.out; i += kThreads) {
        const int k4 = i / L.out, o = i - k4 * L.out;
        ws4[i] = *reinterpret_cast<const uint4*>(L.w + static_cast<int64_t>(o) * L.in + 16 * k4);
      }
    } else {
      for (int i = threadIdx.x; i < L.words * L.out; i += kThreads) {
        const int k = i / L.out, o = i - k * L.out;
        const uint8_t* row = L.w + static_cast<int64_t>(o) * L.in;
        uint32_t word = 0;
        if (L.aligned && 4 * k < L.in) {  // whole 4-byte words in global memory: one load
          word = *reinterpret_cast<const uint32_t*>(row + 4 * k);
        } else {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int c = 4 * k + b;
            if (c < L.in) word |= static_cast<uint32_t>(row[c]) << (8 * b);
          }
        }
        ws[((k >> 2) * L.out + o) * 4 + (k & 3)] = word;  // zero past the row: the codes there multiply by 0
      }
    }
    float* params = reinterpret_cast<float*>(smem + L.param_offset);
    for (int o = threadIdx.x; o < L.out; o += kThreads) {
      params[o] = L.lo[o];
      params[L.out + o] = L.scale[o];
      params[2 * L.out + o] = L.bias ? L.bias[o] : 0.0f;
      params[3 * L.out + o] = bitmm_col_term(static_cast<float>(L.in), L.lo[o], L.scale[o],
                                             static_cast<float>(L.sums[o]));
    }
  }
  if constexpr (kKeys) {  // the block's column keys start at "nothing seen"
    uint32_t* block_keys = reinterpret_cast<uint32_t*>(smem + args.keys_offset);
    for (int i = threadIdx.x; i < 2 * args.layer[args.layers - 1].out; i += kThreads) block_keys[i] = 0;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The warp's kRows code buffers, kStride bytes apart (the widest row's codes; a multiple of 16: uint4 reads).
  constexpr int kStride = 32 * kChunksIn;
  uint8_t* codes = smem + args.codes_offset + warp * kRows * kStride;
  const int in0 = layers[0].in, out_cols = layers[args.layers - 1].out;
  // A block takes kWarps · kRows consecutive rows at a time, warp w's from r0 (grid-stride).  A group's rows are
  // the same on every lane, so the warp-wide intrinsics below run on the full warp whatever the rows.  Rows past
  // args.rows (the last group only) carry zeros through every layer and store nothing.
  const auto run_chain = [&](int64_t r0, float (&h)[kRows][kChunks]) {
    if constexpr (kChunksIn == kChunks) {
      load_rows<kChunks, kRows, kInput>(args, r0, in0, lane, h);
      for (int l = 0; l < args.layers; ++l) mlp_layer<kChunks, kChunks, kRows, kStride>(layers[l], h, h, codes, lane);
    } else {
      // The first layer's input is wider than every later width: its values sit in their own registers, which are
      // free once the layer has turned them into codes.
      float h_in[kRows][kChunksIn];
      load_rows<kChunksIn, kRows, kInput>(args, r0, in0, lane, h_in);
      mlp_layer<kChunksIn, kChunks, kRows, kStride>(layers[0], h_in, h, codes, lane);
      for (int l = 1; l < args.layers; ++l) mlp_layer<kChunks, kChunks, kRows, kStride>(layers[l], h, h, codes, lane);
    }
  };
  if constexpr (kOut == kOutCodes) {
    store_codes<kChunks, kRows>(args, out_cols, lane, warp, run_chain);
    return;
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kRows;
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kRows; r0 < args.rows; r0 += step) {
    float h[kRows][kChunks];
    run_chain(r0, h);
    // Lane i < kRows reads row i's scale; x · 1 is x for every float32 (NaNs stay NaNs).
    const float own_scale =
        args.row_scale && lane < kRows && r0 + lane < args.rows ? __ldg(args.row_scale + r0 + lane) : 1.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float scale = __shfl_sync(kFullMask, own_scale, i);
      if constexpr (kKeys) {  // the values stored, kept for their keys
#pragma unroll
        for (int j = 0; j < kChunks; ++j) h[i][j] = __fmul_rn(h[i][j], scale);
      }
      if (r0 + i < args.rows) {
        // out_cols zero-extended: no register holds a sign word through the loop (it spilled under 4 blocks an SM)
        float* out_row = args.out + (r0 + i) * static_cast<int64_t>(static_cast<uint32_t>(out_cols));
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const int c = lane + 32 * j;
          if (c < out_cols) out_row[c] = kKeys ? h[i][j] : __fmul_rn(h[i][j], scale);
        }
      }
    }
    if constexpr (kKeys) {
      // The column keys of the values just stored: the group's rows reduced in registers (rows past args.rows by
      // selects: branches there took up to 30 more registers on sm_90a), then one shared atomic a column and slot.
      uint32_t* block_keys = reinterpret_cast<uint32_t*>(smem + args.keys_offset);
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        uint32_t key_max = 0, key_min = 0;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          const bool live = r0 + i < args.rows;
          key_max = max(key_max, live ? ordered_key(h[i][j]) : 0u);
          key_min = max(key_min, live ? min_slot_key(h[i][j]) : 0u);
        }
        const int c = lane + 32 * j;
        if (c < out_cols) {
          atomicMax(block_keys + c, key_max);
          atomicMax(block_keys + out_cols + c, key_min);
        }
      }
    }
  }
  if constexpr (kKeys) {
    // Every warp is past its last group (no return above), so the block's keys are complete: one global atomic a
    // column and slot (a zero slot saw nothing).
    __syncthreads();
    const uint32_t* block_keys = reinterpret_cast<const uint32_t*>(smem + args.keys_offset);
    for (int i = threadIdx.x; i < 2 * out_cols; i += kThreads) {
      const uint32_t key = block_keys[i];
      if (key != 0) atomicMax(args.col_keys + i, static_cast<unsigned long long>(key));
    }
  }
}

// The fixed output ranges of the row-codes ops (checked), and the row codes the kernel fills.
struct OutCodes {
  at::Tensor lo, inv;
  int64_t bits;
  at::Tensor row_codes;  // set by launch_quant_mlp
};

// The launch shared by quant_mlp and quant_mlp_planes (and their row-codes ops, `codes` non-null): `input` says what
// the first layer reads (its pointers set), `widths` are the checked widths C_0 .. C_L.  Returns the float output,
// or an undefined tensor when `codes` takes the output (its row codes).
at::Tensor launch_quant_mlp(MlpInput input, int kind, const char* input_name, int64_t rows,
                            const std::vector<int64_t>& widths,
                            const at::TensorOptions& options, at::TensorList weight_codes, at::TensorList weight_lo,
                            at::TensorList weight_scale, at::TensorList weight_sums,
                            const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                            const c10::List<bool>& relu, const std::optional<at::Tensor>& row_scale,
                            const std::optional<at::Tensor>& col_keys, OutCodes* codes = nullptr) {
  const int64_t layers = static_cast<int64_t>(weight_codes.size());
  TORCH_CHECK_VALUE(layers <= kQuantMlpMaxLayers, "weight_codes: the CUDA kernel takes at most ",
                    kQuantMlpMaxLayers, " layers, got ", layers);
  for (int64_t l = 0; l <= layers; ++l) {
    TORCH_CHECK_VALUE(widths[l] <= kQuantMlpMaxWidth, l == 0 ? input_name : "weight_codes", l == 0 ? "" : "[",
                      l == 0 ? "" : std::to_string(l - 1), l == 0 ? "" : "]", ": the CUDA kernel takes widths up to ",
                      kQuantMlpMaxWidth, ", got ", widths[l]);
  }
  at::Tensor out;
  MlpArgs args{};
  if (codes == nullptr) {
    out = cuda_empty({rows, widths.back()}, options);
  } else {
    const int64_t out_cols = widths.back(), groups = packed_words(rows);
    const int64_t row_bytes = row_code_bytes(out_cols, codes->bits);
    codes->row_codes = cuda_empty({groups * 32, row_bytes}, options.dtype(at::kByte));
    args.out_codes = reinterpret_cast<uint32_t*>(codes->row_codes.data_ptr<uint8_t>());
    args.out_lo = codes->lo.data_ptr<float>();
    args.out_inv = codes->inv.data_ptr<float>();
    args.out_bits = static_cast<int>(codes->bits);
    args.out_max_code = static_cast<float>((1 << codes->bits) - 1);
    args.row_words = static_cast<int>(row_bytes / 4);
    args.groups = groups;
  }

  std::vector<at::Tensor> keep;  // no-ops for contiguous inputs (what the callers pass)
  args.input = input;
  args.layers = static_cast<int>(layers);
  int offset = 0, max_width = 0;
  for (int64_t l = 0; l < layers; ++l) {
    MlpLayer& L = args.layer[l];
    keep.push_back(weight_codes[l].contiguous());
    L.w = keep.back().data_ptr<uint8_t>();
    keep.push_back(weight_lo[l].contiguous());
    L.lo = keep.back().data_ptr<float>();
    keep.push_back(weight_scale[l].contiguous());
    L.scale = keep.back().data_ptr<float>();
    keep.push_back(weight_sums[l].contiguous());
    L.sums = keep.back().data_ptr<int64_t>();
    const std::optional<at::Tensor> b = bias.get(l);
    if (b.has_value()) {
      keep.push_back(b->contiguous());
      L.bias = keep.back().data_ptr<float>();
    }
    L.in = static_cast<int>(widths[l]);
    L.out = static_cast<int>(widths[l + 1]);
    L.words = round_up((L.in + 3) / 4, 4);
    const uintptr_t w_address = reinterpret_cast<uintptr_t>(L.w);
    L.aligned = L.in % 16 == 0 && w_address % 16 == 0 ? 2 : L.in % 4 == 0 && w_address % 4 == 0 ? 1 : 0;
    L.max_code = static_cast<float>((1 << act_bits[l]) - 1);
    L.relu = relu.get(l) ? 1 : 0;
    offset = round_up(offset, 16);  // the kernel reads a weight group as one 16-byte load
    L.w_offset = offset;
    offset += L.words * L.out * 4;
    L.param_offset = offset;
    offset += 4 * L.out * 4;
    max_width = std::max(max_width, std::max(L.in, L.out));
  }
  // The kernel's instantiation: values per lane, and rows per warp (kRows code buffers per warp).  A first layer
  // of 65 to 128 inputs before widths of at most 64 (GIN's and GCN's first layers on 100 features) takes a kernel
  // that holds the first layer's values in their own registers and every later layer's in fewer.
  const auto chunks_of = [](int width) { return width <= 32 ? 1 : width <= 64 ? 2 : width <= 128 ? 4 : 8; };
  const int chunks = chunks_of(max_width);
  int later_width = 0;
  for (int64_t l = 1; l <= layers; ++l) later_width = std::max(later_width, static_cast<int>(widths[l]));
  const int later_chunks = chunks_of(later_width);
  // Not for row-layout codes: their plane-at-a-time loads are slower in this kernel, while float input and
  // column codes gain from it (see benchmarks/RESULTS.md, Layers and kernels, quant_mlp).
  const bool wide_first = chunks == 4 && later_chunks <= 2 && kind != kRowPlanesInput;
  const int rows_per = rows_per_warp(chunks);
  args.codes_offset = round_up(offset, 16);
  // A row's code buffer holds 32 codes a chunk of the kernel's first layer (chunks: the wide-first kernels take
  // four, the others `chunks` throughout): the kernel's kStride.
  const int codes_stride = 32 * chunks;
  int smem = args.codes_offset + kWarps * rows_per * codes_stride;
  if (codes == nullptr) args.out = out.data_ptr<float>();
  if (row_scale.has_value()) {
    keep.push_back(row_scale->contiguous());
    args.row_scale = keep.back().data_ptr<float>();
  }
  if (col_keys.has_value()) {  // checked: int64 [2 · out_cols], contiguous, on the device
    args.col_keys = reinterpret_cast<unsigned long long*>(col_keys->data_ptr<int64_t>());
    args.keys_offset = smem;
    smem += 2 * static_cast<int>(widths.back()) * 4;
  }
  args.rows = rows;
  if (codes != nullptr && rows == 0) {  // zero codes: the padding
    codes->row_codes.zero_();
    return out;
  }
  if (rows == 0) return out;

  const int device = options.device().index();
  const int smem_optin = cuda::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  TORCH_CHECK_VALUE(smem + static_cast<int>(sizeof(MlpLayer)) * kQuantMlpMaxLayers <= smem_optin,
                    "weight_codes: the layers' codes need ", smem, " bytes of shared memory, more than the ",
                    smem_optin, " this GPU gives a block");
  const auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    const int64_t resident = static_cast<int64_t>(cuda::sm_count(device)) *
                             cuda::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem, device);
    const int64_t rows_per_block = static_cast<int64_t>(kWarps) * rows_per;
    const int64_t padded_rows = codes != nullptr ? args.groups * 32 : rows;
    const int64_t blocks = std::min<int64_t>((padded_rows + rows_per_block - 1) / rows_per_block, resident);
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const auto launch_input = [&](auto chunks_in_tag, auto chunks_tag) {
    constexpr int kChunksIn = decltype(chunks_in_tag)::value;
    constexpr int kChunks = decltype(chunks_tag)::value;
    constexpr int kRows = rows_per_warp(kChunksIn);
    const auto launch_keys = [&](auto input_tag) {
      constexpr int kInput = decltype(input_tag)::value;
      if (codes != nullptr) {
        launch(quant_mlp_kernel<kChunksIn, kChunks, kRows, kInput, kOutCodes>);
      } else if (args.col_keys != nullptr) {
        launch(quant_mlp_kernel<kChunksIn, kChunks, kRows, kInput, kOutKeys>);
      } else {
        launch(quant_mlp_kernel<kChunksIn, kChunks, kRows, kInput, kOutFloat>);
      }
    };
    if (kind == kColPlanesInput) {
      launch_keys(std::integral_constant<int, kColPlanesInput>{});
    } else if (kind == kRowPlanesInput) {
      if constexpr (kChunksIn == kChunks) {  // row codes never take the wide-first kernels (not instantiated)
        launch_keys(std::integral_constant<int, kRowPlanesInput>{});
      } else {
        TORCH_INTERNAL_ASSERT(false, "quant_mlp: row-layout codes with a wide first layer");
      }
    } else {
      launch_keys(std::integral_constant<int, kFloatInput>{});
    }
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  using Eight = std::integral_constant<int, 8>;
  if (wide_first && later_chunks == 1) {
    launch_input(Four{}, One{});
  } else if (wide_first) {
    launch_input(Four{}, Two{});
  } else if (chunks == 1) {
    launch_input(One{}, One{});
  } else if (chunks == 2) {
    launch_input(Two{}, Two{});
  } else if (chunks == 4) {
    launch_input(Four{}, Four{});
  } else {
    launch_input(Eight{}, Eight{});
  }
  return out;
}

}  // namespace

at::Tensor quant_mlp_cuda(const at::Tensor& x_in, at::TensorList weight_codes, at::TensorList weight_lo,
                          at::TensorList weight_scale, at::TensorList weight_sums,
                          const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                          at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                          const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys) {
  const std::vector<int64_t> widths = check_quant_mlp_args(x_in, weight_codes, weight_lo, weight_scale, weight_sums,
                                                           bias, act_bits, weight_bits, relu, row_scale, col_keys);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  MlpInput input{};
  input.x = x.data_ptr<float>();
  return launch_quant_mlp(input, kFloatInput, "x", x.size(0), widths, x.options(), weight_codes, weight_lo,
                          weight_scale, weight_sums, bias, act_bits, relu, row_scale, col_keys);
}

namespace {

// The first layer's input read from packed codes (checked, contiguous, kept alive by the caller).
MlpInput planes_input(const at::Tensor& planes, const at::Tensor& lo, const at::Tensor& scale, int64_t dim) {
  MlpInput input{};
  input.planes = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  input.lo = lo.data_ptr<float>();
  input.scale = scale.data_ptr<float>();
  input.words = planes.size(2);
  input.plane_stride = planes.size(1) * planes.size(2);
  input.bits = static_cast<int>(planes.size(0));
  input.dim = static_cast<int>(dim);
  return input;
}

}  // namespace

at::Tensor quant_mlp_planes_cuda(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout,
                                 const at::Tensor& lo_in, const at::Tensor& scale_in, int64_t dim,
                                 at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                                 at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                                 at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                 const std::optional<at::Tensor>& row_scale,
                                 const std::optional<at::Tensor>& col_keys) {
  const std::vector<int64_t> widths =
      check_quant_mlp_planes_args(planes_in, rows, cols, col_layout, lo_in, scale_in, dim, weight_codes, weight_lo,
                                  weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
  c10::cuda::CUDAGuard guard(planes_in.device());
  const at::Tensor planes = planes_in.contiguous(), lo = lo_in.contiguous(), scale = scale_in.contiguous();
  return launch_quant_mlp(planes_input(planes, lo, scale, dim), col_layout ? kColPlanesInput : kRowPlanesInput,
                          "planes", rows, widths, planes.options().dtype(at::kFloat), weight_codes, weight_lo,
                          weight_scale, weight_sums, bias, act_bits, relu, row_scale, col_keys);
}

at::Tensor quant_mlp_row_codes_cuda(const at::Tensor& x_in, at::TensorList weight_codes, at::TensorList weight_lo,
                                    at::TensorList weight_scale, at::TensorList weight_sums,
                                    const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                    at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                    const std::optional<at::Tensor>& row_scale, const at::Tensor& out_lo,
                                    const at::Tensor& out_inv_scale, int64_t out_bits) {
  const std::vector<int64_t> widths = check_quant_mlp_args(x_in, weight_codes, weight_lo, weight_scale, weight_sums,
                                                           bias, act_bits, weight_bits, relu, row_scale, std::nullopt);
  check_quant_mlp_out_codes(out_lo, out_inv_scale, out_bits, widths.back(), x_in.device(), "x");
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  MlpInput input{};
  input.x = x.data_ptr<float>();
  OutCodes codes{out_lo.contiguous(), out_inv_scale.contiguous(), out_bits};
  launch_quant_mlp(input, kFloatInput, "x", x.size(0), widths, x.options(), weight_codes, weight_lo, weight_scale,
                   weight_sums, bias, act_bits, relu, row_scale, std::nullopt, &codes);
  return codes.row_codes;
}

at::Tensor quant_mlp_planes_row_codes_cuda(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout,
                                           const at::Tensor& lo_in, const at::Tensor& scale_in, int64_t dim,
                                           at::TensorList weight_codes, at::TensorList weight_lo,
                                           at::TensorList weight_scale, at::TensorList weight_sums,
                                           const c10::List<std::optional<at::Tensor>>& bias,
                                           at::IntArrayRef act_bits, at::IntArrayRef weight_bits,
                                           const c10::List<bool>& relu, const std::optional<at::Tensor>& row_scale,
                                           const at::Tensor& out_lo, const at::Tensor& out_inv_scale,
                                           int64_t out_bits) {
  const std::vector<int64_t> widths =
      check_quant_mlp_planes_args(planes_in, rows, cols, col_layout, lo_in, scale_in, dim, weight_codes, weight_lo,
                                  weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale,
                                  std::nullopt);
  check_quant_mlp_out_codes(out_lo, out_inv_scale, out_bits, widths.back(), planes_in.device(), "planes");
  c10::cuda::CUDAGuard guard(planes_in.device());
  const at::Tensor planes = planes_in.contiguous(), lo = lo_in.contiguous(), scale = scale_in.contiguous();
  OutCodes codes{out_lo.contiguous(), out_inv_scale.contiguous(), out_bits};
  launch_quant_mlp(planes_input(planes, lo, scale, dim), col_layout ? kColPlanesInput : kRowPlanesInput, "planes",
                   rows, widths, planes.options().dtype(at::kFloat), weight_codes, weight_lo, weight_scale,
                   weight_sums, bias, act_bits, relu, row_scale, std::nullopt, &codes);
  return codes.row_codes;
}

}  // namespace pyg_quant
