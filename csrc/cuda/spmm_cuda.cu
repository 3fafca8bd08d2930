// A·X on the block-sparse bit adjacency with 1-bit tensor cores.
//
// On sm_90 (with the sm_90a image) a binary adjacency's tiles with int32 sums run the wgmma kernel of
// spmm_wgmma_cuda.cu instead (128-row blocks, ~3x faster than this one on cluster batches); multi-bit adjacencies,
// int64 sums and other GPUs run this one.  A warp owns one 16-row window and 32 features.  For each stored tile of the
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
// instead, which needs no tensor cores and no shared memory: see its comment (spmm_gather.cuh holds its row loop
// and epilogue, which the wgmma kernel shares).
#include "spmm_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>
#include <type_traits>

#include "bmma.cuh"
#include "device_limits.h"
#include "epilogue.h"
#include "layout.h"
#include "quantize_cuda.h"
#include "row_codes.h"
#include "spmm_args.h"
#include "scratch_cuda.h"
#include "spmm_gather.cuh"
#include "spmm_wgmma_cuda.h"

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

constexpr int kWarpFeatures = 32, kWarpsPerBlock = 4;
constexpr int kResidualInFlight = 8;


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
  const float bias = p.bias ? p.bias[d] : 0.0f;
  for (int r = 0; r < live_rows; ++r) {
    const int64_t row = row0 + r;
    const float self_weight = p.self_weight ? p.self_weight[row * p.self_weight_stride] : 0.0f;
    const float self_code =
        p.self_weight ? static_cast<float>(row_code_at(p.codes + row * p.code_ld, d, p.code_bits)) : 0.0f;
    const float row_scale = p.row_scale ? p.row_scale[row] : 1.0f;
    p.out_float[row * p.cols + d] =
        affine_epilogue(static_cast<float>(staged[warp][r][lane]), lo, scale, static_cast<float>(p.row_sums[row]),
                        self_weight, self_code, row_scale, bias, p.relu);
  }
}


// Binary adjacency, 32-bit sums: registers capped so that 6 blocks of 128 threads share an SM at 4-bit containers
// (80 registers) and 5 at 2-bit ones (96; 80 spill there), and a 32,000-row batch at d = 64 (128,000 threads) takes
// one wave and a quarter instead of two (ptxas, sm_80 and sm_90a: no spills).  Narrower slices (8 codes a lane, twice
// the lanes and loads in flight) were slower: the width of a lane's slice is not what bounds the gather.
template <typename Acc, int kContainer, bool kWeighted>
constexpr int gather_min_blocks() {
  return kWeighted || sizeof(Acc) != 4 ? 1 : kContainer == 4 ? 6 : kContainer == 2 ? 5 : 1;
}

template <typename Acc, int kContainer, int kLanes, bool kWeighted>
__global__ void __launch_bounds__(kGatherThreads, gather_min_blocks<Acc, kContainer, kWeighted>())
    bit_spmm_gather_kernel(const SpmmArgs p, Acc* __restrict__ out_int) {
  using S = GatherSlice<kContainer, Acc>;
  constexpr int kRowValues = kLanes * S::kCodes, kWarpRows = 32 / kLanes;  // a row's slice; rows a warp
  // Rows of several lanes stage the warp's results and store them together (store_staged_rows): [warp][row]
  // [kRowValues] of Acc, or of float for the affine epilogue (never wider than Acc).  A row of one lane stores its
  // own: its stores are already whole rows, so staging would only add the shared-memory round trip.
  constexpr bool kStaged = kLanes > 1;
  __shared__ __align__(16) unsigned char staged[kStaged ? kGatherThreads * S::kCodes * sizeof(Acc) : 16];
  const int lane = threadIdx.x % 32;
  const int64_t thread = static_cast<int64_t>(sm_contiguous_block(p.block_sms)) * kGatherThreads + threadIdx.x;
  const int64_t row = thread / kLanes, warp_row0 = (thread - lane) / kLanes;
  const int64_t f_base = static_cast<int64_t>(blockIdx.y) * kRowValues;
  const int64_t f0 = f_base + (threadIdx.x % kLanes) * S::kCodes;
  const bool live = row < p.rows && f0 < p.cols;
  if (kStaged ? warp_row0 >= p.rows : !live) return;  // staged: whole warps only (the __syncwarp below)
  unsigned char* warp_staged = staged + (threadIdx.x / 32) * 32 * S::kCodes * sizeof(Acc);
  if (live) {
    const uint8_t* source_codes = p.codes + f0 * kContainer / 8;
    // Held as one 64-bit register pair, so that a slice's address is one IMAD.WIDE.U32 off it (left visible, the
    // compiler re-associated p.codes + (col · ld + offset) into three instructions an entry).
    asm("" : "+l"(source_codes));
    Acc sum[S::kCodes];
#pragma unroll
    for (int k = 0; k < S::kCodes; ++k) sum[k] = 0;
    gather_row_sums<kContainer, kWeighted>(p, source_codes, p.res_ptr[row], p.res_ptr[row + 1], sum);
    if constexpr (kStaged) {  // the lane's slot: every value, 16-byte stores (features past cols are never stored)
      const bool vector_params = f0 + S::kCodes <= p.cols && p.cols % 4 == 0 && p.params_aligned;
      finish_slice<kContainer>(p, row, f0, source_codes, sum, reinterpret_cast<Acc*>(warp_staged) + lane * S::kCodes,
                               reinterpret_cast<float*>(warp_staged) + lane * S::kCodes, S::kCodes, true,
                               vector_params);
    } else {
      finish_row<kContainer>(p, out_int, row, f0, source_codes, sum);
    }
  }
  if constexpr (kStaged) {
    __syncwarp();
    if (p.out_float == nullptr) {
      store_staged_rows<Acc, kWarpRows, kRowValues>(p, reinterpret_cast<const Acc*>(warp_staged), out_int,
                                                    warp_row0, f_base, lane);
    } else {
      store_staged_rows<float, kWarpRows, kRowValues>(p, reinterpret_cast<const float*>(warp_staged), p.out_float,
                                                      warp_row0, f_base, lane);
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
  check_spmm_operands(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols, x_codes);
  TORCH_CHECK_VALUE(res_col.size(0) <= std::numeric_limits<int32_t>::max(),
                    "res_col: at most 2^31 - 1 residual entries (the gather counts a row's entries in 32 bits)");
  Operands o{window_ptr.contiguous(), tile_col.contiguous(), tile_bits.contiguous(), res_ptr.contiguous(),
             res_col.contiguous(),    res_val.has_value() ? res_val->contiguous() : at::Tensor(), x.contiguous(),
             at::Tensor()};
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

// The gather's overflow room (SpmmArgs::flush_every, byte_room) for x's bits and the adjacency's weights.
void set_gather_room(const Operands& o, SpmmArgs& args) {
  const int max_code = (1 << static_cast<int>(o.x.size(0))) - 1, max_weight = o.res_val.defined() ? 255 : 1;
  args.flush_every = 65535 / (max_code * max_weight);
  // 8-bit fields at containers of 1 to 4 bits (255 / max code entries); 16-bit fields at 8-bit containers, exact for
  // 255 entries of any code (gather_row_bytes_from's flush).
  args.byte_room = container_bits(o.x.size(0)) == 8 ? 255 : 255 / max_code;
}

template <typename Acc>
void launch_gather(const Operands& o, SpmmArgs args, Acc* out_int, cudaStream_t stream) {
  set_gather_room(o, args);
  args.block_sms = sm_count(o.x.device().index());  // the block order (sm_contiguous_block); cached per device
  const bool weighted = o.res_val.defined();
  switch (container_bits(static_cast<int>(o.x.size(0)))) {
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
  if constexpr (std::is_same_v<Acc, int32_t>) {  // sm_90, binary adjacency: the tiles on the wgmma tensor cores
    set_gather_room(o, args);
    if (bit_spmm_wgmma(o.tile_bits, o.x, args, out_int)) return;
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
  const int64_t self_len = check_spmm_affine_vectors(lo, scale, row_sums, self_weight, row_scale, bias, x, rows, cols);
  const auto o = check_operands(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols,
                                self_weight.has_value(), x_codes);
  auto out = cuda_empty({rows, cols}, x.options().dtype(at::kFloat));
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
