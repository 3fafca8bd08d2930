// A·X on the block-sparse bit adjacency with 1-bit tensor cores.
//
// A warp owns one 16-row window and 32 features.  For each stored tile of the
// window (zero tiles are not stored, so never read) it loads the m16 x k256
// fragment of every adjacency plane once and multiplies it with the matching
// k256 x n8 fragments of every feature plane: the tile row's words line up with
// words 8c..8c+7 of the column-layout planes (pyg_quant/layout.py), so features
// are read in place.  The feature planes' count is a template parameter so that
// all of a tile's fragment loads are issued before its first MMA, and the next
// tile's column is fetched while the current one computes.
//
// The int fragments are then staged in shared memory.  The CSR residual of the
// window's 16 rows is one contiguous range of entries: the warp reads 32 entries
// at a time (one coalesced load of columns and weights), and each lane (one
// feature) adds their codes, eight loads in flight at a time, from the packed
// row codes (csrc/row_codes.h).  Finally either the integers are
// stored (bit_spmm_int) or the affine epilogue of csrc/epilogue.h runs on them
// and float32 is stored (bit_spmm_affine): both stores are coalesced rows.
//
// An adjacency without tiles (every entry in the CSR residual: what a sparse
// graph gives when blocks would be nearly empty) runs bit_spmm_gather_kernel
// instead, which needs no tensor cores and no shared memory: see its comment.
#include "spmm_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

#include "bmma.cuh"
#include "epilogue.h"
#include "quantize_cuda.h"
#include "row_codes.h"
#include "spmm_args.h"

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

constexpr int kTileRows = 16, kTileWords = 8, kWarpFeatures = 32, kWarpsPerBlock = 4;
constexpr int kResidualInFlight = 8;

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
  int byte_room;    // gather kernel, binary adjacency: entries an 8-bit partial sum can take (255 / max code)
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
};

template <typename Acc, int kXBits>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) bit_spmm_kernel(const SpmmArgs p, Acc* __restrict__ out_int) {
  __shared__ Acc staged[kWarpsPerBlock][kTileRows][kWarpFeatures + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t window = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  // Whole warps only (no block-wide barrier below); windows past the last row
  // exist only if a caller passes a longer window_ptr, and have nothing to write.
  if (window >= p.num_windows || window * kTileRows >= p.rows) return;
  const int64_t d0 = static_cast<int64_t>(blockIdx.y) * kWarpFeatures;
  const int g = lane >> 2, tig = lane & 3;

  Acc acc[4][4] = {};
  const int64_t first_tile = p.window_ptr[window], end_tile = p.window_ptr[window + 1];
  int32_t next_col = first_tile < end_tile ? p.tile_col[first_tile] : 0;
  for (int64_t tile = first_tile; tile < end_tile; ++tile) {
    const int64_t col_word = static_cast<int64_t>(next_col) * kTileWords;
    if (tile + 1 < end_tile) next_col = p.tile_col[tile + 1];
    uint32_t bf[kXBits][4][2];
#pragma unroll
    for (int q = 0; q < kXBits; ++q) {
      const uint32_t* xb = p.x + q * p.x_plane + (d0 + g) * p.x_words + col_word;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        bf[q][nt][0] = __ldg(xb + nt * 8 * p.x_words + tig);
        bf[q][nt][1] = __ldg(xb + nt * 8 * p.x_words + tig + 4);
      }
    }
    for (int pa = 0; pa < p.a_bits; ++pa) {
      const uint32_t* tb = p.tile_bits + pa * p.tile_plane + tile * kTileRows * kTileWords;
      const uint32_t af[4] = {__ldg(tb + g * kTileWords + tig), __ldg(tb + (g + 8) * kTileWords + tig),
                              __ldg(tb + g * kTileWords + tig + 4), __ldg(tb + (g + 8) * kTileWords + tig + 4)};
#pragma unroll
      for (int q = 0; q < kXBits; ++q) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          int32_t part[4] = {0, 0, 0, 0};
          bmma_and_popc(part, af, bf[q][nt]);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[nt][i] += static_cast<Acc>(part[i]) << (pa + q);
        }
      }
    }
  }

#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    staged[warp][g][nt * 8 + 2 * tig] = acc[nt][0];
    staged[warp][g][nt * 8 + 2 * tig + 1] = acc[nt][1];
    staged[warp][g + 8][nt * 8 + 2 * tig] = acc[nt][2];
    staged[warp][g + 8][nt * 8 + 2 * tig + 1] = acc[nt][3];
  }
  __syncwarp();

  const int64_t row0 = window * kTileRows;
  const int live_rows = static_cast<int>(min(static_cast<int64_t>(kTileRows), p.rows - row0));
  const int64_t d = d0 + lane;
  const bool live_feature = d < p.cols;
  // Lane r <= 16 holds the residual's start of row r of the window (row 16: the end).
  const int64_t bound = p.res_ptr[row0 + min(lane, live_rows)];
  const int64_t res_begin = __shfl_sync(0xffffffffu, bound, 0);
  const int64_t res_end = __shfl_sync(0xffffffffu, bound, live_rows);
  for (int64_t base = res_begin; base < res_end; base += 32) {
    const int64_t e = base + lane;
    const bool live_entry = e < res_end;
    const int32_t col = live_entry ? p.res_col[e] : 0;
    const int32_t weight = live_entry ? (p.res_val ? p.res_val[e] : 1) : 0;
    int row = 0;
    for (int r = 1; r < live_rows; ++r) row += e >= __shfl_sync(0xffffffffu, bound, r);
    const int count = static_cast<int>(min(static_cast<int64_t>(32), res_end - base));
    for (int j0 = 0; j0 < count; j0 += kResidualInFlight) {
      Acc value[kResidualInFlight];
      int entry_row[kResidualInFlight];
#pragma unroll
      for (int j = 0; j < kResidualInFlight; ++j) {
        const int src = (j0 + j) & 31;
        const int32_t c = __shfl_sync(0xffffffffu, col, src);
        const int32_t w = __shfl_sync(0xffffffffu, weight, src);
        entry_row[j] = __shfl_sync(0xffffffffu, row, src);
        const bool use = j0 + j < count && live_feature;
        value[j] = use ? static_cast<Acc>(w) *
                             static_cast<Acc>(row_code_at(p.codes + static_cast<int64_t>(c) * p.code_ld, d, p.code_bits))
                       : Acc(0);
      }
#pragma unroll
      for (int j = 0; j < kResidualInFlight; ++j) staged[warp][entry_row[j]][lane] += value[j];
    }
  }
  __syncwarp();

  if (!live_feature) return;
  if (p.out_float == nullptr) {
    for (int r = 0; r < live_rows; ++r) out_int[(row0 + r) * p.cols + d] = staged[warp][r][lane];
    return;
  }
  const float lo = p.lo[d], scale = p.scale[d];
  const double bias = p.bias ? static_cast<double>(p.bias[d]) : 0.0;
  for (int r = 0; r < live_rows; ++r) {
    const int64_t row = row0 + r;
    const double self_weight =
        p.self_weight ? static_cast<double>(p.self_weight[row * p.self_weight_stride]) : 0.0;
    const float self_code =
        p.self_weight ? static_cast<float>(row_code_at(p.codes + row * p.code_ld, d, p.code_bits)) : 0.0f;
    const double row_scale = p.row_scale ? static_cast<double>(p.row_scale[row]) : 1.0;
    p.out_float[row * p.cols + d] =
        affine_epilogue(static_cast<double>(staged[warp][r][lane]), lo, scale, static_cast<double>(p.row_sums[row]),
                        self_weight, self_code, row_scale, bias, p.relu);
  }
}

// Tile-free adjacency: a group of kLanes lanes owns a row, and lane l of the group the features
// [l·K, l·K + K) of the launch's slice of K·kLanes, read from the source's packed row codes with one aligned vector
// load per entry: K = 16 codes (16, 8 or 4 bytes at containers of 8, 4 or 2 bits) or K = 32 at 1-bit containers
// (4 bytes), so a 64-feature 4-bit row is one 32-byte sector shared by four lanes.  Sums run two to a
// 32-bit register in 16-bit halves (a shift, a mask and an add per two codes, instead of unpacking every code)
// and are moved to Acc before a half could overflow: flush_every = floor(65535 / (max code · max weight))
// entries, with weights at most 255 (the 8-bit adjacency); a larger weight is added straight to Acc.  A binary
// adjacency's row shorter than flush_every runs a loop without the overflow count; a binary adjacency at containers
// of 1 to 4 bits sums in 8-bit fields instead (gather_row_bytes).  Each lane keeps kGatherBatch gathers in flight
// and loads the next batch's columns while they land.  What bounds it (ncu, H200, 32,000 rows, 1.27M entries,
// 4-bit, d = 64, fused float epilogue): instruction issue -- 8.9M warp instructions, issue slots 60% busy with 4.8
// active warps a scheduler (28% occupancy at 80 registers, 1.26 waves), L2 at 44% of its throughput.  19 us there
// (graph replay; 87.5 us for fp32 CSR).  Tried and measured there, not kept: four lanes sharing a feature slice,
// each taking every fourth entry, sums halved across lanes by shuffles, persistent threads pipelined over rows (one
// round trip a row; 11.5M instructions: the per-row work four times over; 18.5 us, worse at d = 128 and 2 bits);
// batches of 8 entries at 64 registers, one wave (19.0-19.8 us).
constexpr int kGatherThreads = 128, kGatherBatch = 8, kByteBatch = 12;
static_assert(kByteBatch <= 17, "gather_row_bytes flushes once a batch: a batch must fit in 255 / 15 entries");

template <int kContainer, typename Acc>
struct GatherSlice {
  // features per lane: 16 (a 64-feature row takes 4 lanes: twice the threads of 32, in fewer registers each,
  // since a 32,000-row batch at 32 codes a lane filled under one wave at 25% occupancy, measured), 32 for 1-bit
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

// A binary adjacency's rows at containers of 1, 2 or 4 bits: sums run four to a register in 8-bit fields (a shift,
// a mask and an add per four codes: half the instructions of the 16-bit halves), moved to Acc every byte_room
// entries (255 / max code: 17 at 4 bits, 85 at 2, 255 at 1), so no row length can overflow them.  The row's
// entries are counted in 32 bits and every batch but the last is whole, so the hot loop carries no bound checks:
// the SASS of the version with int64 bounds on every entry spent ~37 instructions an entry and lane, two thirds of
// them on 64-bit compares and addresses (ncu: issue 41% busy, ALU the busiest pipe, 10.5M instructions for 1.27M
// entries).  The columns are read through a pointer that walks the row (one load with an immediate offset an
// entry) and a slice's address is one IMAD.WIDE.U32 off a 64-bit base held in registers: indexing from the row's
// int64 start cost ~6 instructions an entry for the column and 3 for the slice (SASS, H200 build).
template <int kContainer, typename Acc>
__device__ __forceinline__ void gather_row_bytes(const SpmmArgs& p, const uint8_t* __restrict__ source_codes,
                                                 int64_t begin, int64_t end,
                                                 Acc (&sum)[GatherSlice<kContainer, Acc>::kCodes]) {
  using S = GatherSlice<kContainer, Acc>;
  constexpr int kFields = 8 / kContainer;  // codes per byte: field s of byte b is code b·kFields + s of its word
  constexpr uint32_t kMask = ((1u << kContainer) - 1u) * 0x01010101u;
  uint32_t bytes[S::kWords][kFields];
#pragma unroll
  for (int i = 0; i < S::kWords; ++i) {
#pragma unroll
    for (int f = 0; f < kFields; ++f) bytes[i][f] = 0;
  }
  const auto flush = [&]() {
#pragma unroll
    for (int i = 0; i < S::kWords; ++i) {
#pragma unroll
      for (int f = 0; f < kFields; ++f) {
#pragma unroll
        for (int b = 0; b < 4; ++b) sum[i * S::kPerWord + b * kFields + f] += static_cast<Acc>((bytes[i][f] >> (8 * b)) & 0xffu);
        bytes[i][f] = 0;
      }
    }
  };
  const auto accumulate = [&](const uint32_t (&words)[kByteBatch][S::kWords]) {
#pragma unroll
    for (int j = 0; j < kByteBatch; ++j) {
#pragma unroll
      for (int i = 0; i < S::kWords; ++i) {
#pragma unroll
        for (int f = 0; f < kFields; ++f) bytes[i][f] += (words[j][i] >> (kContainer * f)) & kMask;
      }
    }
  };
  const int count = static_cast<int>(end - begin);  // a row's length fits: res_col is indexed by int32 columns
  const int full = count - count % kByteBatch;
  const uint32_t code_ld = static_cast<uint32_t>(p.code_ld);
  int room = p.byte_room;
  const int32_t* __restrict__ next = p.res_col + begin;  // the next batch's columns
  uint32_t col[kByteBatch];  // one batch ahead, as in gather_row
#pragma unroll
  for (int j = 0; j < kByteBatch; ++j) col[j] = j < count ? static_cast<uint32_t>(__ldg(next + j)) : 0u;
  next += kByteBatch;
  for (int e0 = 0; e0 < full; e0 += kByteBatch, next += kByteBatch) {
    uint32_t words[kByteBatch][S::kWords];
#pragma unroll
    for (int j = 0; j < kByteBatch; ++j) load_slice<S::kWords>(code_slice(source_codes, col[j], code_ld), words[j]);
    if (e0 + 2 * kByteBatch <= count) {  // the next batch is whole too
#pragma unroll
      for (int j = 0; j < kByteBatch; ++j) col[j] = static_cast<uint32_t>(__ldg(next + j));
    } else {
#pragma unroll
      for (int j = 0; j < kByteBatch; ++j) col[j] = e0 + kByteBatch + j < count ? static_cast<uint32_t>(__ldg(next + j)) : 0u;
    }
    if (room < kByteBatch) {  // byte_room >= 17 > kByteBatch: one flush makes room for the whole batch
      flush();
      room = p.byte_room;
    }
    room -= kByteBatch;
    accumulate(words);
  }
  if (full < count) {  // the last, partial batch: its dead entries add zeros
    uint32_t words[kByteBatch][S::kWords];
#pragma unroll
    for (int j = 0; j < kByteBatch; ++j) {
      if (full + j < count) {
        load_slice<S::kWords>(code_slice(source_codes, col[j], code_ld), words[j]);
      } else {
#pragma unroll
        for (int i = 0; i < S::kWords; ++i) words[j][i] = 0;
      }
    }
    if (room < kByteBatch) flush();
    accumulate(words);
  }
  flush();
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

// Binary adjacency, 32-bit sums: registers capped so that 6 blocks of 128 threads share an SM at 4-bit containers
// (80 registers) and 5 at 2-bit ones (96; 80 spill there), and a 32,000-row batch at d = 64 (128,000 threads) takes
// one wave and a quarter instead of two (ptxas, sm_80 and sm_90a: no spills).  Tried and measured on an H100: 8 codes
// a lane at 4-bit containers (a 32-bit word: twice the lanes and loads in flight, 12 blocks of 40 registers) took
// 25.5 us against 22.3 on the products-scale batch at d = 64, so the width of a lane's slice is not what bounds it.
template <typename Acc, int kContainer, bool kWeighted>
constexpr int gather_min_blocks() {
  return kWeighted || sizeof(Acc) != 4 ? 1 : kContainer == 4 ? 6 : kContainer == 2 ? 5 : 1;
}

template <typename Acc, int kContainer, int kLanes, bool kWeighted>
__global__ void __launch_bounds__(kGatherThreads, gather_min_blocks<Acc, kContainer, kWeighted>())
    bit_spmm_gather_kernel(const SpmmArgs p, Acc* __restrict__ out_int) {
  using S = GatherSlice<kContainer, Acc>;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kGatherThreads + threadIdx.x) / kLanes;
  if (row >= p.rows) return;  // no warp-wide operations below
  const int64_t f0 = (static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x % kLanes) * S::kCodes;
  if (f0 >= p.cols) return;
  const uint8_t* source_codes = p.codes + f0 * kContainer / 8;
  // Held as one 64-bit register pair, so that a slice's address is one IMAD.WIDE.U32 off it (left visible, the
  // compiler re-associated p.codes + (col · ld + offset) into three instructions an entry).
  asm("" : "+l"(source_codes));
  Acc sum[S::kCodes];
#pragma unroll
  for (int k = 0; k < S::kCodes; ++k) sum[k] = 0;
  const int64_t begin = p.res_ptr[row], end = p.res_ptr[row + 1];
  if constexpr (!kWeighted && kContainer <= 4) {
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

  const int live = static_cast<int>(min(static_cast<int64_t>(S::kCodes), p.cols - f0));
  // 16-byte aligned when whole: row · cols and f0 are multiples of 4 (of 16 at 8-byte sums: f0 is one of kCodes).
  const bool vector_store = live == S::kCodes && p.cols % 4 == 0;
  if (p.out_float == nullptr) {
    store_sums<Acc, S::kCodes>(out_int + row * p.cols + f0, sum, live, vector_store);
    return;
  }
  const double row_sum = static_cast<double>(p.row_sums[row]);
  const double self_weight = p.self_weight ? static_cast<double>(p.self_weight[row * p.self_weight_stride]) : 0.0;
  const double row_scale = p.row_scale ? static_cast<double>(p.row_scale[row]) : 1.0;
  uint32_t self_words[S::kWords];
#pragma unroll
  for (int i = 0; i < S::kWords; ++i) self_words[i] = 0;
  if (p.self_weight) load_slice<S::kWords>(source_codes + row * p.code_ld, self_words);
  float* out_row = p.out_float + row * p.cols + f0;
  // Four codes at a time, each group stored before the next is computed (fewer live registers: the kernel is capped).
#pragma unroll
  for (int g = 0; g < S::kCodes / 4; ++g) {
    const ColumnParams4 c = load_column_params4(p, f0 + 4 * g, vector_store && p.params_aligned);
    float value[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = 4 * g + i;
      const float self_code = static_cast<float>((self_words[k / S::kPerWord] >> (kContainer * (k % S::kPerWord))) &
                                                 ((1u << kContainer) - 1u));
      value[i] = affine_epilogue(static_cast<double>(sum[k]), c.lo[i], c.scale[i], row_sum, self_weight, self_code,
                                 row_scale, static_cast<double>(c.bias[i]), p.relu);
    }
    if (vector_store) {
      reinterpret_cast<float4*>(out_row)[g] = make_float4(value[0], value[1], value[2], value[3]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (4 * g + i < live) out_row[4 * g + i] = value[i];
      }
    }
  }
}

struct Operands {
  at::Tensor window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, codes;
};

Operands check_operands(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                        const at::Tensor& res_ptr, const at::Tensor& res_col, const std::optional<at::Tensor>& res_val,
                        const at::Tensor& x, int64_t rows, int64_t cols, bool need_codes,
                        const std::optional<at::Tensor>& x_codes) {
  TORCH_CHECK_VALUE(window_ptr.dim() == 1 && window_ptr.scalar_type() == at::kLong, "window_ptr must be int64[num_windows + 1]");
  TORCH_CHECK_VALUE(tile_col.dim() == 1 && tile_col.scalar_type() == at::kInt, "tile_col must be int32[num_tiles]");
  TORCH_CHECK_VALUE(tile_bits.dim() == 4 && tile_bits.scalar_type() == at::kInt && tile_bits.size(1) == tile_col.size(0) &&
                        tile_bits.size(2) == kTileRows && tile_bits.size(3) == kTileWords,
                    "tile_bits must be int32[bits, num_tiles, 16, 8]");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.scalar_type() == at::kInt && x.size(2) % kTileWords == 0 && x.size(1) % 64 == 0,
                    "x_planes must be column-layout int32[bits, outer (padded to 64), words]");
  TORCH_CHECK_VALUE(tile_bits.size(0) >= 1 && tile_bits.size(0) <= 8 && x.size(0) >= 1 && x.size(0) <= 8,
                    "1 to 8 bit planes per operand");
  TORCH_CHECK_VALUE(cols >= 0 && cols <= x.size(1), "cols exceeds x_planes' padded feature count");
  TORCH_CHECK_VALUE(rows >= 0 && res_ptr.dim() == 1 && res_ptr.scalar_type() == at::kLong && res_ptr.size(0) == rows + 1,
                    "res_ptr must be int64[rows + 1]");
  TORCH_CHECK_VALUE(res_col.dim() == 1 && res_col.scalar_type() == at::kInt, "res_col must be int32[res_nnz]");
  TORCH_CHECK_VALUE(res_col.size(0) <= std::numeric_limits<int32_t>::max(),
                    "res_col: at most 2^31 - 1 residual entries (the gather counts a row's entries in 32 bits)");
  if (res_val.has_value()) {
    TORCH_CHECK_VALUE(res_val->scalar_type() == at::kInt && res_val->sizes() == res_col.sizes(),
                      "res_val must be int32 with res_col's shape");
  }
  TORCH_CHECK_VALUE((window_ptr.size(0) - 1) * kTileRows >= rows, "rows exceeds the adjacency's row windows");
  for (const auto* t : {&window_ptr, &tile_col, &tile_bits, &res_ptr, &res_col}) {
    TORCH_CHECK_VALUE(t->device() == x.device(), "the adjacency and x_planes must be on one device");
  }
  if (res_val.has_value()) TORCH_CHECK_VALUE(res_val->device() == x.device(), "res_val must be on x_planes' device");
  Operands o{window_ptr.contiguous(), tile_col.contiguous(), tile_bits.contiguous(), res_ptr.contiguous(),
             res_col.contiguous(),    res_val.has_value() ? res_val->contiguous() : at::Tensor(), x.contiguous(),
             at::Tensor()};
  // Index bounds are the format's invariants (BitAdjacency builds them); they are
  // not re-checked here because that would need a device-to-host copy.
  check_row_codes(x_codes, o.x, cols);
  if (x_codes.has_value()) {
    o.codes = *x_codes;
  } else if (need_codes || o.res_col.numel() > 0) {
    o.codes = pack_row_codes_cuda(o.x, cols, /*col_layout=*/true);
  }
  return o;
}

template <typename Acc, int kContainer>
void launch_gather_container(const SpmmArgs& args, bool weighted, Acc* out_int, cudaStream_t stream) {
  constexpr int kCodes = GatherSlice<kContainer, Acc>::kCodes;
  // Lanes per row: enough slices of kCodes features for the row, a power of two up to a warp.
  int lanes = 1;
  while (lanes < 32 && lanes * kCodes < args.cols) lanes *= 2;
  const int64_t rows_per_block = kGatherThreads / lanes;
  const dim3 grid(static_cast<unsigned>((args.rows + rows_per_block - 1) / rows_per_block),
                  static_cast<unsigned>((args.cols + lanes * kCodes - 1) / (lanes * kCodes)));
  TORCH_CHECK_VALUE(grid.y <= 65535, "too many feature columns for one launch");
  switch (lanes) {
#define PYG_QUANT_GATHER_CASE(LANES)                                                                            \
  case LANES:                                                                                                   \
    if (weighted) {                                                                                             \
      bit_spmm_gather_kernel<Acc, kContainer, LANES, true><<<grid, kGatherThreads, 0, stream>>>(args, out_int);  \
    } else {                                                                                                    \
      bit_spmm_gather_kernel<Acc, kContainer, LANES, false><<<grid, kGatherThreads, 0, stream>>>(args, out_int); \
    }                                                                                                           \
    break;
    PYG_QUANT_GATHER_CASE(1) PYG_QUANT_GATHER_CASE(2) PYG_QUANT_GATHER_CASE(4) PYG_QUANT_GATHER_CASE(8)
    PYG_QUANT_GATHER_CASE(16) PYG_QUANT_GATHER_CASE(32)
#undef PYG_QUANT_GATHER_CASE
  }
}

template <typename Acc>
void launch_gather(const Operands& o, SpmmArgs args, Acc* out_int, cudaStream_t stream) {
  const int bits = static_cast<int>(o.x.size(0));
  const int max_code = (1 << bits) - 1, max_weight = o.res_val.defined() ? 255 : 1;
  args.flush_every = 65535 / (max_code * max_weight);
  args.byte_room = 255 / max_code;
  const bool weighted = o.res_val.defined();
  switch (container_bits(bits)) {
    case 1: launch_gather_container<Acc, 1>(args, weighted, out_int, stream); break;
    case 2: launch_gather_container<Acc, 2>(args, weighted, out_int, stream); break;
    case 4: launch_gather_container<Acc, 4>(args, weighted, out_int, stream); break;
    default: launch_gather_container<Acc, 8>(args, weighted, out_int, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Acc>
void launch(const Operands& o, SpmmArgs args, Acc* out_int) {
  args.window_ptr = o.window_ptr.data_ptr<int64_t>();
  args.tile_col = o.tile_col.data_ptr<int32_t>();
  args.tile_bits = reinterpret_cast<const uint32_t*>(o.tile_bits.data_ptr<int32_t>());
  args.tile_plane = o.tile_bits.size(1) * kTileRows * kTileWords;
  args.a_bits = static_cast<int>(o.tile_bits.size(0));
  args.x = reinterpret_cast<const uint32_t*>(o.x.data_ptr<int32_t>());
  args.x_plane = o.x.size(1) * o.x.size(2);
  args.x_words = o.x.size(2);
  args.res_ptr = o.res_ptr.data_ptr<int64_t>();
  args.res_col = o.res_col.data_ptr<int32_t>();
  args.res_val = o.res_val.defined() ? o.res_val.data_ptr<int32_t>() : nullptr;
  args.codes = o.codes.defined() ? o.codes.data_ptr<uint8_t>() : nullptr;
  args.code_ld = o.codes.defined() ? o.codes.size(1) : 0;
  args.code_bits = container_bits(o.x.size(0));
  args.num_windows = o.window_ptr.size(0) - 1;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (o.tile_col.size(0) == 0) {
    launch_gather(o, args, out_int, stream);
    return;
  }
  const dim3 grid((args.num_windows + kWarpsPerBlock - 1) / kWarpsPerBlock,
                  (args.cols + kWarpFeatures - 1) / kWarpFeatures);
  TORCH_CHECK_VALUE(grid.y <= 65535, "too many feature columns for one launch");
  switch (o.x.size(0)) {
#define PYG_QUANT_SPMM_CASE(BITS) \
  case BITS:                      \
    bit_spmm_kernel<Acc, BITS><<<grid, kWarpsPerBlock * 32, 0, stream>>>(args, out_int); \
    break;
    PYG_QUANT_SPMM_CASE(1) PYG_QUANT_SPMM_CASE(2) PYG_QUANT_SPMM_CASE(3) PYG_QUANT_SPMM_CASE(4)
    PYG_QUANT_SPMM_CASE(5) PYG_QUANT_SPMM_CASE(6) PYG_QUANT_SPMM_CASE(7) PYG_QUANT_SPMM_CASE(8)
#undef PYG_QUANT_SPMM_CASE
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_vector(const std::optional<at::Tensor>& t, at::ScalarType dtype, int64_t n, const at::Tensor& x,
                  const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == n && t->scalar_type() == dtype && t->device() == x.device(), name,
                    " must be a 1-D ", c10::toString(dtype), " tensor of ", n, " entries on x_planes' device");
}

}  // namespace

at::Tensor bit_spmm_int_cuda(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                             const at::Tensor& res_ptr, const at::Tensor& res_col,
                             const std::optional<at::Tensor>& res_val, const at::Tensor& x, int64_t rows,
                             int64_t cols, bool wide, const std::optional<at::Tensor>& x_codes) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto o = check_operands(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols, false,
                                x_codes);
  auto out = at::empty({rows, cols}, x.options().dtype(wide ? at::kLong : at::kInt));
  if (rows == 0 || cols == 0) return out;
  SpmmArgs args{};
  args.rows = rows;
  args.cols = cols;
  if (wide) {
    launch(o, args, out.data_ptr<int64_t>());
  } else {
    launch(o, args, out.data_ptr<int32_t>());
  }
  return out;
}

at::Tensor bit_spmm_affine_cuda(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                                const at::Tensor& res_ptr, const at::Tensor& res_col,
                                const std::optional<at::Tensor>& res_val, const at::Tensor& x, const at::Tensor& lo,
                                const at::Tensor& scale, const at::Tensor& row_sums,
                                const std::optional<at::Tensor>& self_weight,
                                const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& bias,
                                bool relu, int64_t rows, int64_t cols, bool wide,
                                const std::optional<at::Tensor>& x_codes) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_vector(lo, at::kFloat, cols, x, "lo");
  check_vector(scale, at::kFloat, cols, x, "scale");
  check_vector(row_sums, at::kLong, rows, x, "row_sums");
  const int64_t self_len = self_weight_length(self_weight, rows);
  check_vector(self_weight, at::kFloat, self_len, x, "self_weight");
  check_vector(row_scale, at::kFloat, rows, x, "row_scale");
  check_vector(bias, at::kFloat, cols, x, "bias");
  if (self_weight.has_value()) {
    TORCH_CHECK_VALUE(rows <= x.size(2) * 32, "self_weight needs a square adjacency (rows <= x's nodes)");
  }
  const auto o = check_operands(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols,
                                self_weight.has_value(), x_codes);
  auto out = at::empty({rows, cols}, x.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return out;
  const auto lo_c = lo.contiguous(), scale_c = scale.contiguous(), row_sums_c = row_sums.contiguous();
  const auto self_c = self_weight.has_value() ? self_weight->contiguous() : at::Tensor();
  const auto row_scale_c = row_scale.has_value() ? row_scale->contiguous() : at::Tensor();
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  SpmmArgs args{};
  args.rows = rows;
  args.cols = cols;
  args.lo = lo_c.data_ptr<float>();
  args.scale = scale_c.data_ptr<float>();
  args.row_sums = row_sums_c.data_ptr<int64_t>();
  args.self_weight = self_c.defined() ? self_c.data_ptr<float>() : nullptr;
  args.self_weight_stride = self_len == 1 ? 0 : 1;
  args.row_scale = row_scale_c.defined() ? row_scale_c.data_ptr<float>() : nullptr;
  args.bias = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  args.relu = relu;
  args.params_aligned = (reinterpret_cast<uintptr_t>(args.lo) | reinterpret_cast<uintptr_t>(args.scale) |
                         reinterpret_cast<uintptr_t>(args.bias)) % 16 == 0;
  args.out_float = out.data_ptr<float>();
  if (wide) {
    launch<int64_t>(o, args, nullptr);
  } else {
    launch<int32_t>(o, args, nullptr);
  }
  return out;
}

}  // namespace pyg_quant
