#pragma once
// The CSR gather of bit_spmm, shared by the kernels of spmm_cuda.cu and spmm_wgmma_cuda.cu: the kernels' arguments,
// a row's gathered code sums (gather_row_sums) and its epilogue and store (finish_row).  Row codes: csrc/row_codes.h.
#include <cstdint>

#include "epilogue.h"

namespace pyg_quant {
namespace cuda {

struct SpmmArgs {
  const int64_t* window_ptr;
  const int32_t* tile_col;
  const uint32_t* tile_bits;
  int64_t tile_plane;
  int a_bits;
  const uint32_t* x;
  int64_t x_plane, x_words;
  const int64_t* res_ptr;
  const int32_t* res_col;
  const int32_t* res_val;
  const uint8_t* codes;  // [nodes_pad, code_ld] packed row codes of x (csrc/row_codes.h)
  int64_t code_ld;
  int code_bits;  // their container width
  int flush_every;  // gather kernel: entries a 16-bit partial sum can take without overflowing
  int byte_room;    // gather kernel, binary adjacency: entries gather_row_bytes_from's fields take between flushes
  int64_t num_windows, rows, cols;
  // affine epilogue (out_float != nullptr)
  const float* lo;
  const float* scale;
  const int64_t* row_sums;
  const float* self_weight;
  int64_t self_weight_stride;  // 1: one weight a row; 0: one for every row
  const float* row_scale;
  const float* bias;
  bool relu;
  bool params_aligned;  // lo, scale and bias (when given) start on 16-byte boundaries
  float* out_float;
  // The gather kernels' block order (sm_contiguous_block): the device's SM count, or 0 for the launch order.
  int block_sms = 0;
};

// The gather kernels' blocks in an order where the blocks one SM runs hold consecutive rows.  The block scheduler
// hands a launch's first blocks to the SMs in turn, so block b runs on the same SM as b + sms, b + 2·sms, ...;
// mapping those to one contiguous range of rows (SM slot s = b mod sms takes ranges of q or q + 1 blocks, q =
// blocks / sms) makes the blocks that share an SM, and so its L1, gather the same neighbourhoods: a METIS batch
// lists each part's nodes together and most of a row's neighbours are in its part.  A bijection of [0, gridDim.x)
// whatever the scheduler does, so it only ever costs locality (see benchmarks/RESULTS.md, Layers and kernels).
// Only for a grid of one row of blocks: a second row (feature slices) would be
// handed out after the first, so its blocks would not share SMs with the first row's.
__device__ __forceinline__ uint32_t sm_contiguous_block(int block_sms) {
  if (block_sms <= 0 || gridDim.y != 1) return blockIdx.x;
  const uint32_t sms = static_cast<uint32_t>(block_sms), slot = blockIdx.x % sms;
  const uint32_t q = gridDim.x / sms, r = gridDim.x % sms;
  return slot * q + min(slot, r) + blockIdx.x / sms;
}

// Tile-free adjacency: a group of kLanes lanes owns a row, and lane l of the group the features
// [l·K, l·K + K) of the launch's slice of K·kLanes, read from the source's packed row codes with one aligned vector
// load per entry: K = 16 codes (16, 8 or 4 bytes at containers of 8, 4 or 2 bits) or K = 32 at 1-bit containers
// (4 bytes), so a 64-feature 4-bit row is one 32-byte sector shared by four lanes.  Sums run two to a
// 32-bit register in 16-bit halves (a shift, a mask and an add per two codes, instead of unpacking every code)
// and are moved to Acc before a half could overflow: flush_every = floor(65535 / (max code · max weight))
// entries, with weights at most 255 (the 8-bit adjacency); a larger weight is added straight to Acc.  A binary
// adjacency's row shorter than flush_every runs a loop without the overflow count; a binary adjacency sums in 8-bit
// fields instead at containers of 1 to 4 bits, in 16-bit fields at 8-bit ones (gather_row_bytes).  Each lane keeps
// kGatherBatch gathers in flight and loads the next batch's columns while they land.  The kernel is bound by each
// row's chain of dependent loads (row bounds, then columns, then codes), not by bandwidth: a gather that only makes
// those loads is within ~25% of it.  So the design keeps the chain short (batches of columns loaded ahead, no
// per-entry bound checks in whole batches) and the stores whole: a warp's rows are staged in shared memory and
// stored by consecutive lanes (store_staged_rows), since each lane storing its own 64 bytes half-wrote 32 sectors a
// store instruction.  Variants that shared loads across lanes, staged codes in shared memory or reordered the
// columns were slower (see benchmarks/RESULTS.md, Layers and kernels, "bit_spmm: the CSR gather").
constexpr int kGatherThreads = 128, kGatherBatch = 8, kByteBatch = 12;
static_assert(kByteBatch <= 17, "gather_row_bytes flushes once a batch: a batch must fit in 255 / 15 entries");

template <int kContainer, typename Acc>
struct GatherSlice {
  // features per lane: 16 (a 64-feature row takes 4 lanes: twice the threads of 32, in fewer registers each,
  // since 32 codes a lane left a batch under one wave at low occupancy), 32 for 1-bit
  // containers (one 32-bit word, the smallest vector load)
  static constexpr int kCodes = kContainer == 1 ? 32 : 16;
  static constexpr int kWords = kCodes * kContainer / 32;      // 32-bit words per lane per entry
  static constexpr int kPerWord = 32 / kContainer;             // codes per word
  static constexpr int kShifts = kPerWord / 2;                 // half registers per word
  static constexpr int kHalves = kCodes / 2;
  static constexpr uint32_t kMask = ((1u << kContainer) - 1u) * 0x00010001u;  // field 0 of each 16-bit half
  // Half register i·kShifts + j holds codes kPerWord·i + j (low) and kPerWord·i + j + kShifts (high).
  static __device__ __forceinline__ int low_code(int half) { return (half / kShifts) * kPerWord + half % kShifts; }
};

// kWords consecutive 32-bit words of a packed row, one vector load (16, 8 or 4 bytes, aligned: rows are 16-byte
// multiples and a lane's slice starts at a multiple of its own size).
template <int kWords>
__device__ __forceinline__ void load_slice(const uint8_t* p, uint32_t (&w)[kWords]) {
  if constexpr (kWords == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (kWords == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const uint32_t*>(p));
  }
}

// Node `col`'s slice of the packed row codes: one IMAD.WIDE.U32 with a 32-bit row pitch (code_ld is at most a few
// hundred bytes; the 64-bit product of a 64-bit pitch took four instructions and a constant reload per entry).
__device__ __forceinline__ const uint8_t* code_slice(const uint8_t* __restrict__ source_codes, uint32_t col,
                                                     uint32_t code_ld) {
  return source_codes + static_cast<uint64_t>(col) * code_ld;
}

template <int kContainer, typename Acc>
__device__ __forceinline__ void flush_halves(uint32_t (&half)[GatherSlice<kContainer, Acc>::kHalves],
                                             Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes]) {
  using S = GatherSlice<kContainer, Acc>;
#pragma unroll
  for (int h = 0; h < S::kHalves; ++h) {
    sum[S::low_code(h)] += static_cast<Acc>(half[h] & 0xffffu);
    sum[S::low_code(h) + S::kShifts] += static_cast<Acc>(half[h] >> 16);
    half[h] = 0;
  }
}

template <int kContainer, bool kWeighted, bool kCountRoom, typename Acc>
__device__ __forceinline__ void gather_row(const SpmmArgs& p, const uint8_t* __restrict__ source_codes, int64_t begin,
                                           int64_t end, uint32_t (&half)[GatherSlice<kContainer, Acc>::kHalves],
                                           Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes]) {
  using S = GatherSlice<kContainer, Acc>;
  int room = p.flush_every;
  // The batch's columns (and weights) were loaded one batch ahead, so a batch waits for one round trip (its
  // codes), not two (its columns, then the codes they point to).
  uint32_t col[kGatherBatch], weight[kGatherBatch];
#pragma unroll
  for (int j = 0; j < kGatherBatch; ++j) {
    const bool live = begin + j < end;
    col[j] = live ? static_cast<uint32_t>(__ldg(p.res_col + begin + j)) : 0u;
    weight[j] = kWeighted && live ? static_cast<uint32_t>(__ldg(p.res_val + begin + j)) : 0u;
  }
  for (int64_t e0 = begin; e0 < end; e0 += kGatherBatch) {
    uint32_t words[kGatherBatch][S::kWords];
#pragma unroll
    for (int j = 0; j < kGatherBatch; ++j) {  // every load of the batch first: kGatherBatch in flight
      if (e0 + j < end) {
        load_slice<S::kWords>(code_slice(source_codes, col[j], static_cast<uint32_t>(p.code_ld)), words[j]);
      } else {
#pragma unroll
        for (int i = 0; i < S::kWords; ++i) words[j][i] = 0;  // dead entries of the last batch add nothing
      }
    }
    uint32_t batch_weight[kGatherBatch];
#pragma unroll
    for (int j = 0; j < kGatherBatch; ++j) {
      batch_weight[j] = weight[j];
      const int64_t next = e0 + kGatherBatch + j;
      const bool live = next < end;
      col[j] = live ? static_cast<uint32_t>(__ldg(p.res_col + next)) : 0u;
      weight[j] = kWeighted && live ? static_cast<uint32_t>(__ldg(p.res_val + next)) : 0u;
    }
#pragma unroll
    for (int j = 0; j < kGatherBatch; ++j) {
      if (kWeighted && batch_weight[j] > 255u) {  // outside the 8-bit adjacency's range: exact, the slow way
#pragma unroll
        for (int i = 0; i < S::kWords; ++i) {
#pragma unroll
          for (int s = 0; s < S::kPerWord; ++s) {
            const uint32_t code = (words[j][i] >> (kContainer * s)) & ((1u << kContainer) - 1u);
            sum[i * S::kPerWord + s] += static_cast<Acc>(code) * static_cast<Acc>(batch_weight[j]);
          }
        }
        continue;
      }
      if (kCountRoom) {
        if (room == 0) {
          flush_halves<kContainer>(half, sum);
          room = p.flush_every;
        }
        --room;
      }
#pragma unroll
      for (int i = 0; i < S::kWords; ++i) {
#pragma unroll
        for (int s = 0; s < S::kShifts; ++s) {
          const uint32_t fields = (words[j][i] >> (kContainer * s)) & S::kMask;
          half[i * S::kShifts + s] += kWeighted ? fields * batch_weight[j] : fields;
        }
      }
    }
  }
}

// The columns run one batch ahead of the codes, so that a batch waits for one round trip (its codes), not two (its
// columns, then the codes they point to).  The first batch's columns are loaded apart (load_byte_batch_columns of
// p.res_col + begin, end - begin), so that a caller which knows its rows early has them in flight meanwhile (the
// tile kernel, during its MMAs).
__device__ __forceinline__ void load_byte_batch_columns(const int32_t* __restrict__ columns, int live,
                                                        uint32_t (&col)[kByteBatch]) {
#pragma unroll
  for (int j = 0; j < kByteBatch; ++j) col[j] = j < live ? static_cast<uint32_t>(__ldg(columns + j)) : 0u;
}

// A binary adjacency's rows at containers of 1, 2 or 4 bits: sums run four to a register in 8-bit fields (a shift,
// a mask and an add per four codes: half the instructions of the 16-bit halves), moved to Acc every byte_room
// entries (255 / max code: 17 at 4 bits, 85 at 2, 255 at 1), so no row length can overflow them.  At 4-bit
// containers the high nibbles are not masked: `shifted` adds w >> 4 whole (one LEA.HI an entry and word), and the
// flush takes the low nibbles' share back out, (w >> 4) summing to H + 16 (L >> 8) with H and L the high and low
// nibbles' packed byte sums (exact mod 2^32, and H < 2^32).  The row's entries are counted in 32 bits and every
// batch but the last is whole, so the hot loop carries no bound checks (the SASS of a version with int64 bounds on
// every entry spent ~37 instructions an entry and lane, two thirds of them on 64-bit compares and addresses).  The
// columns are read through a pointer that walks the row and a slice's address is one IMAD.WIDE.U32 off a 64-bit
// base held in registers.  The last, partial batch adds its live entries four at a time.  `col` holds the first
// batch's columns (load_byte_batch_columns).
// At 8-bit containers the same loop sums in 16-bit fields, two registers a word: bytes 0 and 2 masked, and w >> 8
// whole (one LEA.HI an entry and word), the flush taking byte 2's share back out of the latter, every byte_room
// = 255 entries (exact: see flush).  sm_90a SASS: ~19 instructions an entry and lane, where
// gather_row's 16-bit halves (three instructions a word's two halves, and 64-bit bound checks on every entry)
// took ~38, so 8-bit gathers are ~15% faster this way (see benchmarks/RESULTS.md, Layers and kernels).
template <int kContainer, typename Acc>
__device__ __forceinline__ void gather_row_bytes_from(const SpmmArgs& p, const uint8_t* __restrict__ source_codes,
                                                      int64_t begin, int64_t end, uint32_t (&col)[kByteBatch],
                                                      Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes]) {
  using S = GatherSlice<kContainer, Acc>;
  // 8-bit containers: two 16-bit-field sums a word (kHalfFields), else fields of a byte.
  constexpr bool kHalfFields = kContainer == 8;
  constexpr int kFields = kHalfFields ? 2 : 8 / kContainer;  // codes per byte: field s of byte b is code b·kFields + s
  constexpr uint32_t kMask = kHalfFields ? 0x00ff00ffu : ((1u << kContainer) - 1u) * 0x01010101u;
  constexpr bool kShiftedHigh = kContainer == 4;
  // bytes[i][f]: field f's byte sums of word i (at 4-bit containers, bytes[i][1] holds the unmasked w >> 4 sums; at
  // 8-bit ones bytes[i][0] the masked bytes 0 and 2, bytes[i][1] the unmasked w >> 8)
  uint32_t bytes[S::kWords][kFields];
#pragma unroll
  for (int i = 0; i < S::kWords; ++i) {
#pragma unroll
    for (int f = 0; f < kFields; ++f) bytes[i][f] = 0;
  }
  const auto flush = [&]() {
#pragma unroll
    for (int i = 0; i < S::kWords; ++i) {
      if constexpr (kHalfFields) {
        // L = Σ b0 + 2^16 Σ b2 and H = Σ (w >> 8) = Σ b1 + 2^8 Σ b2 + 2^16 Σ b3, each below 2^32 and every Σ below
        // 2^16 for at most 255 entries of codes <= 255.
        const uint32_t low = bytes[i][0], b2 = low >> 16, rest = bytes[i][1] - (b2 << 8);
        sum[i * S::kPerWord] += static_cast<Acc>(low & 0xffffu);
        sum[i * S::kPerWord + 1] += static_cast<Acc>(rest & 0xffffu);
        sum[i * S::kPerWord + 2] += static_cast<Acc>(b2);
        sum[i * S::kPerWord + 3] += static_cast<Acc>(rest >> 16);
        bytes[i][0] = bytes[i][1] = 0;
      } else {
        if constexpr (kShiftedHigh) bytes[i][1] -= (bytes[i][0] >> 8) << 4;
#pragma unroll
        for (int f = 0; f < kFields; ++f) {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            sum[i * S::kPerWord + b * kFields + f] += static_cast<Acc>((bytes[i][f] >> (8 * b)) & 0xffu);
          }
          bytes[i][f] = 0;
        }
      }
    }
  };
  const auto add_entry = [&](const uint32_t (&words)[S::kWords]) {
#pragma unroll
    for (int i = 0; i < S::kWords; ++i) {
      if constexpr (kShiftedHigh || kHalfFields) {
        bytes[i][0] += words[i] & kMask;
        bytes[i][1] += words[i] >> (kHalfFields ? 8 : 4);
      } else {
#pragma unroll
        for (int f = 0; f < kFields; ++f) bytes[i][f] += (words[i] >> (kContainer * f)) & kMask;
      }
    }
  };
  const int count = static_cast<int>(end - begin);  // a row's length fits: res_col is indexed by int32 columns
  const int full = count - count % kByteBatch;
  const uint32_t code_ld = static_cast<uint32_t>(p.code_ld);
  int room = p.byte_room;
  const int32_t* __restrict__ next = p.res_col + begin + kByteBatch;  // the next batch's columns
  for (int e0 = 0; e0 < full; e0 += kByteBatch, next += kByteBatch) {
    uint32_t words[kByteBatch][S::kWords];
#pragma unroll
    for (int j = 0; j < kByteBatch; ++j) load_slice<S::kWords>(code_slice(source_codes, col[j], code_ld), words[j]);
    load_byte_batch_columns(next, count - e0 - kByteBatch, col);
    if (room < kByteBatch) {  // byte_room >= 17 > kByteBatch: one flush makes room for the whole batch
      flush();
      room = p.byte_room;
    }
    room -= kByteBatch;
#pragma unroll
    for (int j = 0; j < kByteBatch; ++j) add_entry(words[j]);
  }
  const int live = count - full;
  if (live > 0) {  // the last, partial batch
    uint32_t words[kByteBatch][S::kWords];
#pragma unroll
    for (int j = 0; j < kByteBatch; ++j) {
      if (j < live) {
        load_slice<S::kWords>(code_slice(source_codes, col[j], code_ld), words[j]);
      } else {
#pragma unroll
        for (int i = 0; i < S::kWords; ++i) words[j][i] = 0;
      }
    }
    if (room < kByteBatch) flush();
#pragma unroll
    for (int j0 = 0; j0 < kByteBatch; j0 += 4) {
      if (j0 >= live) break;
#pragma unroll
      for (int j = j0; j < j0 + 4; ++j) add_entry(words[j]);  // dead entries add zeros
    }
  }
  flush();
}

template <int kContainer, typename Acc>
__device__ __forceinline__ void gather_row_bytes(const SpmmArgs& p, const uint8_t* __restrict__ source_codes,
                                                 int64_t begin, int64_t end,
                                                 Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes]) {
  uint32_t col[kByteBatch];
  load_byte_batch_columns(p.res_col + begin, static_cast<int>(end - begin), col);
  gather_row_bytes_from<kContainer>(p, source_codes, begin, end, col, sum);
}

// The per-column parameters of features f .. f + 3 of the affine epilogue: with `vector` (f a multiple of 4, all
// four below cols, params_aligned) one 16-byte load each; else one load a feature, clamped to cols - 1 (features
// past cols are computed, not stored).
struct ColumnParams4 {
  float lo[4], scale[4], bias[4];
};

__device__ __forceinline__ ColumnParams4 load_column_params4(const SpmmArgs& p, int64_t f, bool vector) {
  ColumnParams4 c;
  if (vector) {
    const float4 lo = __ldg(reinterpret_cast<const float4*>(p.lo + f));
    const float4 scale = __ldg(reinterpret_cast<const float4*>(p.scale + f));
    const float4 bias = p.bias ? __ldg(reinterpret_cast<const float4*>(p.bias + f)) : make_float4(0.f, 0.f, 0.f, 0.f);
    c.lo[0] = lo.x, c.lo[1] = lo.y, c.lo[2] = lo.z, c.lo[3] = lo.w;
    c.scale[0] = scale.x, c.scale[1] = scale.y, c.scale[2] = scale.z, c.scale[3] = scale.w;
    c.bias[0] = bias.x, c.bias[1] = bias.y, c.bias[2] = bias.z, c.bias[3] = bias.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t fi = min(f + i, p.cols - 1);
      c.lo[i] = p.lo[fi];
      c.scale[i] = p.scale[fi];
      c.bias[i] = p.bias ? p.bias[fi] : 0.0f;
    }
  }
  return c;
}

// Integer results of `count` consecutive features: 16-byte stores when `vector` (count a multiple of 16 bytes' worth,
// the address 16-byte aligned), else one a feature up to `live`.
template <typename Acc, int kCount>
__device__ __forceinline__ void store_sums(Acc* __restrict__ out, const Acc (&sum)[kCount], int live, bool vector) {
  constexpr int kPerVector = 16 / static_cast<int>(sizeof(Acc));
  if (vector) {
#pragma unroll
    for (int v = 0; v < kCount / kPerVector; ++v) {
      if constexpr (kPerVector == 4) {
        reinterpret_cast<int4*>(out)[v] = make_int4(sum[4 * v], sum[4 * v + 1], sum[4 * v + 2], sum[4 * v + 3]);
      } else {
        reinterpret_cast<longlong2*>(out)[v] = make_longlong2(sum[2 * v], sum[2 * v + 1]);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kCount; ++k) {
      if (k < live) out[k] = sum[k];
    }
  }
}

// Adds row `begin..end` of the CSR residual's codes to `sum` (a lane's kCodes features starting where
// `source_codes` points, in every source's packed row codes).  kByteLoopAt8: binary rows at 8-bit containers take
// gather_row_bytes_from's 16-bit fields (else gather_row's halves, in fewer registers: the wgmma kernel, whose
// 168-register budget spilled 48 bytes with the 12-entry loop).
template <int kContainer, bool kWeighted, typename Acc, bool kByteLoopAt8 = true>
__device__ __forceinline__ void gather_row_sums(const SpmmArgs& p, const uint8_t* __restrict__ source_codes,
                                                int64_t begin, int64_t end,
                                                Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes]) {
  using S = GatherSlice<kContainer, Acc>;
  if constexpr (!kWeighted && (kContainer <= 4 || kByteLoopAt8)) {
    gather_row_bytes<kContainer>(p, source_codes, begin, end, sum);
  } else {
    uint32_t half[S::kHalves];
#pragma unroll
    for (int h = 0; h < S::kHalves; ++h) half[h] = 0;
    if (kWeighted || end - begin > p.flush_every) {
      gather_row<kContainer, kWeighted, true>(p, source_codes, begin, end, half, sum);
    } else {
      gather_row<kContainer, false, false>(p, source_codes, begin, end, half, sum);
    }
    flush_halves<kContainer>(half, sum);
  }
}

// Row `row`'s features f0 .. f0 + kCodes - 1 from their code sums, written to `int_dst` as integers (p.out_float
// null) or through the affine epilogue to `float_dst` as float32, the self term's codes read from `source_codes` (the
// row's own slice): the first `live` values, with 16-byte stores when `vector_store` (the destination 16-byte aligned
// and all kCodes live).  `vector_params`: the column parameters of f0 .. f0 + kCodes - 1 may be read 16 bytes at a
// time.  The destination is the output row (finish_row) or a warp's staging slot in shared memory.
template <int kContainer, typename Acc>
__device__ __forceinline__ void finish_slice(const SpmmArgs& p, int64_t row, int64_t f0,
                                             const uint8_t* __restrict__ source_codes,
                                             const Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes],
                                             Acc* __restrict__ int_dst, float* __restrict__ float_dst, int live,
                                             bool vector_store, bool vector_params) {
  using S = GatherSlice<kContainer, Acc>;
  if (p.out_float == nullptr) {
    store_sums<Acc, S::kCodes>(int_dst, sum, live, vector_store);
    return;
  }
  const float row_sum = static_cast<float>(p.row_sums[row]);
  const float self_weight = p.self_weight ? p.self_weight[row * p.self_weight_stride] : 0.0f;
  const float row_scale = p.row_scale ? p.row_scale[row] : 1.0f;
  uint32_t self_words[S::kWords];
#pragma unroll
  for (int i = 0; i < S::kWords; ++i) self_words[i] = 0;
  if (p.self_weight) load_slice<S::kWords>(source_codes + row * p.code_ld, self_words);
  // Four codes at a time, each group stored before the next is computed (fewer live registers: the kernels are capped).
#pragma unroll
  for (int g = 0; g < S::kCodes / 4; ++g) {
    const ColumnParams4 c = load_column_params4(p, f0 + 4 * g, vector_params);
    float value[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = 4 * g + i;
      const float self_code = static_cast<float>((self_words[k / S::kPerWord] >> (kContainer * (k % S::kPerWord))) &
                                                 ((1u << kContainer) - 1u));
      value[i] = affine_epilogue(static_cast<float>(sum[k]), c.lo[i], c.scale[i], row_sum, self_weight, self_code,
                                 row_scale, c.bias[i], p.relu);
    }
    if (vector_store) {
      reinterpret_cast<float4*>(float_dst)[g] = make_float4(value[0], value[1], value[2], value[3]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (4 * g + i < live) float_dst[4 * g + i] = value[i];
      }
    }
  }
}

// Row `row`'s features f0 .. f0 + kCodes - 1 (those below cols) stored straight into the output row.
template <int kContainer, typename Acc>
__device__ __forceinline__ void finish_row(const SpmmArgs& p, Acc* __restrict__ out_int, int64_t row, int64_t f0,
                                           const uint8_t* __restrict__ source_codes,
                                           const Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes]) {
  using S = GatherSlice<kContainer, Acc>;
  const int live = static_cast<int>(min(static_cast<int64_t>(S::kCodes), p.cols - f0));
  // 16-byte aligned when whole: row · cols and f0 are multiples of 4 (of 16 at 8-byte sums: f0 is one of kCodes).
  const bool vector_store = live == S::kCodes && p.cols % 4 == 0;
  const int64_t offset = row * p.cols + f0;
  finish_slice<kContainer>(p, row, f0, source_codes, sum, out_int + offset,
                           p.out_float != nullptr ? p.out_float + offset : nullptr, live, vector_store,
                           vector_store && p.params_aligned);
}

// A warp's results staged in shared memory ([rows of the warp][kRowValues] of T, the lanes of a row side by side),
// stored with consecutive lanes writing consecutive 16-byte pieces of a row, so that every store instruction writes
// whole 32-byte sectors (stored from the lanes' registers, one 16-byte store instruction of a warp writes half of
// each of 32 sectors: see the gather's comment above for what that cost).  `row0`: the warp's first row; `f_base`:
// the launch slice's first feature.
template <typename T, int kRows, int kRowValues>
__device__ __forceinline__ void store_staged_rows(const SpmmArgs& p, const T* __restrict__ staged, T* __restrict__ out,
                                                  int64_t row0, int64_t f_base, int lane) {
  constexpr int kPerVector = 16 / static_cast<int>(sizeof(T)), kChunks = kRowValues / kPerVector;
  static_assert(kRowValues % kPerVector == 0, "a staged row is whole 16-byte pieces");
  const bool vector = p.cols % kPerVector == 0;  // then every piece below cols is whole and 16-byte aligned
#pragma unroll
  for (int k0 = 0; k0 < kRows * kChunks; k0 += 32) {
    const int k = k0 + lane, r = k / kChunks, c = k % kChunks;
    const int64_t row = row0 + r, f = f_base + c * kPerVector;
    if (k >= kRows * kChunks || row >= p.rows || f >= p.cols) continue;
    const T* src = staged + r * kRowValues + c * kPerVector;
    T* dst = out + row * p.cols + f;
    if (vector) {
      *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
    } else {
#pragma unroll
      for (int i = 0; i < kPerVector; ++i) {
        if (f + i < p.cols) dst[i] = src[i];
      }
    }
  }
}
}  // namespace cuda
}  // namespace pyg_quant
