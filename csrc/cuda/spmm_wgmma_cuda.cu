// bit_spmm on Hopper's warpgroup tensor cores (wgmma m64nNk256 .b1 .and.popc, sm_90a) for a binary adjacency with
// bit tiles: the tiles of 8 consecutive 16-row windows (a 128-row "row block") that share a 256-column chunk form
// one 128 x 256 A operand, multiplied with that chunk's feature planes once.
//
// Why 128 rows.  A 16 x 256 tile's multiply reads the chunk's 256 feature rows (64 features x 4 bits = 8 KB) for
// 16 rows of output; on a products-scale cluster batch (32,000 rows, 1.27M entries, 2% dense diagonal blocks) the
// tiles holding 81% of the entries would read 114 MB of features that way, more
// than the CSR gather's one 32-byte code row per entry.  A 128-row block reads the chunk once for 8 windows: the
// same entries need ~2,000 k256 steps of 4 KB adjacency + 8 KB features, and the MMAs (two m64n256k256 a step,
// ~256 SM cycles) take a few microseconds for the whole batch at the b1 peak.
//
// Layout in shared memory.  The tiles stay in the canonical format (pyg_quant/layout.py, tile_bits[0, t] = 16 rows x
// 8 words): each present tile of a chunk is one TMA box of 16 x 32 bytes, written with the 32-byte swizzle at
// offset 512·w of the stage (w = its window within the block), which is exactly where a 128-row box with the same
// swizzle would put those rows (the swizzle is a function of the shared-memory address, and 512 is a multiple of its
// 256-byte period).  A window without a tile at the chunk gets zeros (below).  The feature planes are the B operand
// as in the dense kernel (bitmm_wgmma_cuda.cu): t planes of kTileN features each stacked along N (kStack slots, those
// past t zeroed once), one n(kBlockN) MMA a step, folded in registers (fold_stacked_planes, wgmma.cuh).
//
// Block: three warpgroups.  Warpgroup 0's first warp produces: per work unit (a row block and a slice of kTileN
// features) lanes 0-7 walk their windows' tile lists in a merge by column (__reduce_min_sync), and each step claims
// a stage (the `empty` mbarrier), writes its flags (the unit's last step; a unit without tiles gets one step of no
// data) and issues the copies that complete on the stage's `full` mbarrier: one 3-D box for the t feature planes,
// one 16-row box per window (a window without a tile at the chunk copies the box one past the last tile, wholly
// outside the tensor, which the TMA fills with zeros and counts: no generic stores into a stage, no proxy fence).
// A unit's tile columns are loaded a unit ahead (kListRounds a lane) and its windows' bounds two ahead.  Warpgroups
// 1 and 2 consume rows 0-63 and 64-127 of the block: one MMA a step, the stage released once wgmma.wait_group says
// its MMA retired; after the unit's last step they fold the planes, stage the integer sums in shared memory (the
// gather's layout: a row's kCodes consecutive features a thread) and finish each row as the CSR gather kernel does
// (spmm_gather.cuh): the row's residual entries (those of tiles too sparse to store), then the epilogue or the
// int32 store.  Persistent: one block an SM walks units with a stride of the grid; the producer's stages run on into
// the next unit while the consumers finish the last one's rows.
//
// Why the tile kernel is not the default for cluster batches: its time is the step protocol (merge, barriers, flags)
// and the rows' finishing, chains of dependent loads at low occupancy, not its MMAs, so on ~2%-full tiles the CSR
// gather is as fast or faster and "auto" keeps the CSR form (see benchmarks/RESULTS.md, Layers and kernels).  The
// residual bounds are loaded a unit ahead and each finishing pass's first batch of columns during the MMAs, to take
// round trips off that chain.  The finishing runs in two passes because one pass with 32-code slices spilled: ptxas
// keeps the two accumulators' registers reserved through it (~90 of the 224 left); finishing warps of their own do not fit
// (a 512-thread CTA caps ptxas at 128 registers a thread, and the m64n256 wgmma needs 154).
#include "spmm_wgmma_cuda.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include "bitmm_cuda.h"
#include "device_limits.h"
#include "layout.h"
#include "tensor_map.h"
#include "tma.cuh"
#include "wgmma.cuh"

namespace pyg_quant {
namespace cuda {
namespace {

[[maybe_unused]] constexpr int kBlockRows = 128, kWindows = kBlockRows / kTileRows, kThreads = 384;
constexpr int kRowBytes = kTileCols / 8;  // a tile row: one k256 step
[[maybe_unused]] constexpr uint32_t kTileBytes = kTileRows * kRowBytes, kABytes = kBlockRows * kRowBytes;
constexpr int kMaxStages = 8, kAlignSlack = 1024;
// Tile columns of a unit kept in shared memory (loaded a unit ahead, kListRounds a lane); the rest are read from
// global memory as the merge reaches them.
constexpr int kListRounds = 4, kListCapacity = 32 * kListRounds;
[[maybe_unused]] constexpr uint32_t kLastStep = 1u, kNoData = 2u;  // a stage's flags
// 56 + 2 x 224 = 504 registers per thread row (the producer holds two units' tile columns).
[[maybe_unused]] constexpr int kProducerRegs = 56, kConsumerRegs = 224;

[[maybe_unused]] __device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

[[maybe_unused]] __device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// A stage's flags, read by lane 0 and passed to the warp: the lane that later releases the stage is then the only
// one that read it (the other lanes' reads would not be ordered before that release).
[[maybe_unused]] __device__ __forceinline__ uint32_t read_flags(uint32_t addr, int lane) {
  return __shfl_sync(0xffffffffu, lane == 0 ? ld_shared_u32(addr) : 0u, 0);
}

struct SharedLayout {
  uint32_t stage_bytes, staged, list, full_bars, empty_bars, flags;
  size_t total;  // bytes of dynamic shared memory, alignment slack included
};

// Stages (1024-aligned, 32-byte swizzled rows), the consumers' integer sums (64 rows x (kTileN + 4) int32 each: the
// pitch keeps 16-byte rows aligned and spreads a warp's stores over banks), the unit's tile columns, then the
// barriers and flags.  Offsets from the aligned base.
template <int kBlockN, int kStack>
__host__ __device__ constexpr SharedLayout shared_layout(int stages) {
  constexpr int kTileN = kBlockN / kStack;
  SharedLayout l{};
  l.stage_bytes = kABytes + static_cast<uint32_t>(kBlockN * kRowBytes);
  l.staged = static_cast<uint32_t>(stages) * l.stage_bytes;
  l.list = l.staged + 2u * 64u * (kTileN + 4) * 4u;
  l.full_bars = l.list + 4u * kListCapacity;
  l.empty_bars = l.full_bars + 8u * static_cast<uint32_t>(stages);
  l.flags = l.empty_bars + 8u * static_cast<uint32_t>(stages);
  l.total = kAlignSlack + l.flags + 4u * static_cast<uint32_t>(stages);
  return l;
}

template <int kBlockN, int kStack, int kContainer>
__global__ void __launch_bounds__(kThreads, 1)
    bit_spmm_wgmma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap x_map,
                          const SpmmArgs p, int t, int stages, int n_tiles, int64_t work_units, int num_tiles,
                          int32_t* __restrict__ out_int) {
#ifdef PYG_QUANT_WGMMA
  constexpr int kTileN = kBlockN / kStack;
  using S = GatherSlice<kContainer, int32_t>;
  constexpr int kLanes = kTileN / S::kCodes;  // threads a row in the finishing pass
  static_assert(kTileN % S::kCodes == 0 && 128 % kLanes == 0, "a feature tile is whole gather slices");
  constexpr int kPassRows = 128 / kLanes;
  constexpr int kPasses = 64 / kPassRows;  // 2 at containers of 2 and 4 bits, else 1
  // Binary rows at containers of 1 to 4 bits sum in bytes (gather_row_bytes_from): a pass's first batch of residual
  // columns is loaded ahead (the first pass's as the unit starts, so that it lands during the MMAs; the second's
  // as the first pass starts), and every pass's bounds a unit ahead.
  constexpr bool kEarlyColumns = kContainer <= 4;
  constexpr int kPitch = kTileN + 4;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + (kAlignSlack - 1)) & ~static_cast<uint32_t>(kAlignSlack - 1);
  const SharedLayout l = shared_layout<kBlockN, kStack>(stages);
  const uint32_t full_bars = base + l.full_bars, empty_bars = base + l.empty_bars, flags = base + l.flags;
  const int warpgroup = threadIdx.x / 128;
  auto unit_rows = [&](int64_t unit) { return (unit / n_tiles) * kBlockRows; };
  auto unit_n0 = [&](int64_t unit) { return static_cast<int>(unit % n_tiles) * kTileN; };

  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_init(full_bars + 8u * i, 1);
      mbar_init(empty_bars + 8u * i, 8);  // every consumer warp
    }
    fence_mbarrier_init_cluster();  // a CTA is a cluster of one: makes the inits visible to the async proxy
  }
  if (kStack > t) {
    // Stacked slots past t are never copied: zero once.
    const uint32_t empty_words = static_cast<uint32_t>((kStack - t) * kTileN * kRowBytes / 4);
    for (int i = 0; i < stages; ++i) {
      const uint32_t slots = base + static_cast<uint32_t>(i) * l.stage_bytes + kABytes +
                             static_cast<uint32_t>(t * kTileN * kRowBytes);
      for (uint32_t w = threadIdx.x; w < empty_words; w += kThreads)
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(slots + 4u * w), "r"(0u) : "memory");
    }
    fence_proxy_async_shared();
  }
  __syncthreads();

  if (warpgroup == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      if (lane == 0) {
        prefetch_tensormap(&a_map);
        prefetch_tensormap(&x_map);
      }
      const uint32_t list = base + l.list;
      const uint32_t copied_b = static_cast<uint32_t>(t * kTileN * kRowBytes);
      StageCursor cursor{stages};
      // A unit's tile columns and its windows' bounds are loaded one unit ahead (the bounds of the unit after
      // next, two ahead), so that their round trips overlap the current unit's steps instead of starting each unit.
      auto unit_bound = [&](int64_t unit) -> int64_t {  // lane w <= 8: where window w of the unit's block starts
        if (unit >= work_units || lane > kWindows) return 0;
        return __ldg(p.window_ptr + min(unit_rows(unit) / kTileRows + lane, p.num_windows));
      };
      auto load_columns = [&](int64_t bound, int32_t(&columns)[kListRounds]) {
        const int64_t first = __shfl_sync(0xffffffffu, bound, 0);
        const int64_t count = __shfl_sync(0xffffffffu, bound, kWindows) - first;
#pragma unroll
        for (int r = 0; r < kListRounds; ++r)
          columns[r] = lane + 32 * r < count ? __ldg(p.tile_col + first + lane + 32 * r) : 0;
      };
      int64_t bound = unit_bound(blockIdx.x), next_bound = unit_bound(blockIdx.x + gridDim.x);
      int32_t columns[kListRounds];
      load_columns(bound, columns);
      for (int64_t unit = blockIdx.x; unit < work_units; unit += gridDim.x) {
        const int n0 = unit_n0(unit);
        const int64_t first = __shfl_sync(0xffffffffu, bound, 0);
        __syncwarp();  // the previous unit's reads of the list are done
#pragma unroll
        for (int r = 0; r < kListRounds; ++r)
          asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(list + 4u * (lane + 32 * r)), "r"(columns[r]) : "memory");
        __syncwarp();
        int32_t next_columns[kListRounds];
        load_columns(next_bound, next_columns);
        const int64_t after_bound = unit_bound(unit + 2 * static_cast<int64_t>(gridDim.x));
        auto column_at = [&](int i) {  // past the list's capacity, from global memory (long lists only)
          return i < kListCapacity ? static_cast<int>(ld_shared_u32(list + 4u * i)) : __ldg(p.tile_col + first + i);
        };
        // This lane's window: its tiles are list entries [next, end).
        int next = static_cast<int>(__shfl_sync(0xffffffffu, bound, min(lane, kWindows)) - first);
        const int end = static_cast<int>(__shfl_sync(0xffffffffu, bound, min(lane + 1, kWindows)) - first);
        int col = lane < kWindows && next < end ? column_at(next) : INT_MAX;
        int chunk = static_cast<int>(__reduce_min_sync(0xffffffffu, static_cast<unsigned>(col)));
        if (chunk == INT_MAX) {  // no tiles: one step without data, so that the consumers still store the rows
          mbar_wait(empty_bars + 8u * cursor.stage, cursor.phase ^ 1u);
          if (lane == 0) {
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(flags + 4u * cursor.stage), "r"(kLastStep | kNoData)
                         : "memory");
            mbar_arrive(full_bars + 8u * cursor.stage);
          }
          __syncwarp();
          cursor.advance();
        }
        while (chunk != INT_MAX) {
          const bool present = col == chunk;
          const int tile = static_cast<int>(first) + next;  // valid where present
          if (present) {
            ++next;
            col = next < end ? column_at(next) : INT_MAX;
          }
          const int following = static_cast<int>(__reduce_min_sync(0xffffffffu, static_cast<unsigned>(col)));
          mbar_wait(empty_bars + 8u * cursor.stage, cursor.phase ^ 1u);
          const uint32_t full = full_bars + 8u * cursor.stage;
          const uint32_t dst = base + static_cast<uint32_t>(cursor.stage) * l.stage_bytes;
          if (lane == 0) {
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(flags + 4u * cursor.stage),
                         "r"(following == INT_MAX ? kLastStep : 0u)
                         : "memory");
            mbar_arrive_expect_tx(full, kABytes + copied_b);
            tma_load_3d(dst + kABytes, &x_map, full, chunk * 8, n0, 0);  // all t planes: one box
          }
          __syncwarp();
          // A window without a tile at this chunk copies the box one past the last tile: wholly outside the tensor,
          // so the TMA writes zeros (and counts their bytes); no generic stores into the stage, no proxy fence.
          if (lane < kWindows) tma_load_3d(dst + lane * kTileBytes, &a_map, full, 0, 0, present ? tile : num_tiles);
          cursor.advance();
          chunk = following;
        }
        bound = next_bound;
        next_bound = after_bound;
#pragma unroll
        for (int r = 0; r < kListRounds; ++r) columns[r] = next_columns[r];
      }
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int32_t* staged = reinterpret_cast<int32_t*>(smem_raw + (base - raw) + l.staged) + consumer * 64 * kPitch;
    constexpr SmemSwizzle kSwizzle = SmemSwizzle::k32B;
    int32_t acc[kBlockN / 2];
    StageCursor cursor{stages};
    const int tid = threadIdx.x % 128;
    const int f_local = (tid % kLanes) * S::kCodes;
    auto pass_row = [&](int pass) {  // this thread's row in a pass, within its warpgroup's 64
      return pass * kPassRows + tid / kLanes;
    };
    // This thread's rows' residual entries in a unit, [begin, end) of res_col (empty past the rows or the units),
    // in 32 bits (res_col holds fewer than 2^31 entries: check_operands).
    int32_t res_begin[kPasses], res_end[kPasses];
    auto residual_bounds = [&](int64_t unit, int32_t(&begin)[kPasses], int32_t(&end)[kPasses]) {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int64_t row = unit_rows(unit) + consumer * 64 + pass_row(pass);
        begin[pass] = end[pass] = 0;
        if (unit < work_units && row < p.rows) {
          begin[pass] = static_cast<int32_t>(__ldg(p.res_ptr + row));
          end[pass] = static_cast<int32_t>(__ldg(p.res_ptr + row + 1));
        }
      }
    };
    residual_bounds(blockIdx.x, res_begin, res_end);
    for (int64_t unit = blockIdx.x; unit < work_units; unit += gridDim.x) {
      uint32_t columns[kPasses][kByteBatch];  // each pass's first batch of residual columns
      if constexpr (kEarlyColumns) {
        load_byte_batch_columns(p.res_col + res_begin[0], res_end[0] - res_begin[0], columns[0]);
      }
      int32_t next_begin[kPasses], next_end[kPasses];
      residual_bounds(unit + gridDim.x, next_begin, next_end);
      mbar_wait(full_bars + 8u * cursor.stage, cursor.phase);
      uint32_t flag = read_flags(flags + 4u * cursor.stage, lane);
      if (flag & kNoData) {
        if (lane == 0) mbar_arrive(empty_bars + 8u * cursor.stage);
        cursor.advance();
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0;
      } else {
        int previous = -1;
        bool first = true;
        while (true) {
          const uint32_t stage_addr = base + static_cast<uint32_t>(cursor.stage) * l.stage_bytes;
          wgmma_fence();
          wgmma_b1<kBlockN>(acc,
                            smem_descriptor_at(stage_addr + static_cast<uint32_t>(consumer * 64 * kRowBytes), 16,
                                               8 * kRowBytes, kSwizzle),
                            smem_descriptor_at(stage_addr + kABytes, 16, 8 * kRowBytes, kSwizzle), first ? 0 : 1);
          wgmma_commit();
          first = false;
          // This step's MMA stays in flight; the previous one's has retired: its stage goes back.
          wgmma_wait<1>();
          if (previous >= 0 && lane == 0) mbar_arrive(empty_bars + 8u * previous);
          previous = cursor.stage;
          cursor.advance();
          if (flag & kLastStep) break;
          mbar_wait(full_bars + 8u * cursor.stage, cursor.phase);
          flag = read_flags(flags + 4u * cursor.stage, lane);
        }
        wgmma_wait<0>();
        fence_registers(acc);
        if (lane == 0) mbar_arrive(empty_bars + 8u * previous);
      }
      if constexpr (kStack > 1) fold_stacked_planes<kTileN, kStack>(acc);
      // The sums through shared memory, into the gather's layout (a row's kCodes consecutive features a thread),
      // then each row finished as the CSR gather kernel finishes it: its residual entries, then the epilogue.
      named_barrier(1 + consumer, 128);  // the previous unit's rows are finished
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp * 16 + lane / 4 + 8 * half;
          *reinterpret_cast<int2*>(staged + r * kPitch + 8 * j + 2 * (lane % 4)) =
              make_int2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        }
      }
      named_barrier(1 + consumer, 128);
      const int64_t row_block = unit_rows(unit) + consumer * 64, f0 = unit_n0(unit) + f_local;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        if constexpr (kEarlyColumns) {
          if (pass + 1 < kPasses) {
            load_byte_batch_columns(p.res_col + res_begin[pass + 1], res_end[pass + 1] - res_begin[pass + 1],
                                    columns[pass + 1]);
          }
        }
        const int r = pass_row(pass);
        const int64_t row = row_block + r;
        if (row < p.rows && f0 < p.cols) {
          int32_t sum[S::kCodes];
#pragma unroll
          for (int k = 0; k < S::kCodes; k += 4) {
            const int4 v = *reinterpret_cast<const int4*>(staged + r * kPitch + f_local + k);
            sum[k] = v.x, sum[k + 1] = v.y, sum[k + 2] = v.z, sum[k + 3] = v.w;
          }
          const uint8_t* source_codes = p.codes + f0 * kContainer / 8;
          asm("" : "+l"(source_codes));  // one IMAD.WIDE.U32 an entry (see the gather kernel)
          if constexpr (kEarlyColumns) {
            gather_row_bytes_from<kContainer>(p, source_codes, res_begin[pass], res_end[pass], columns[pass], sum);
          } else {
            gather_row_sums<kContainer, false, int32_t, /*kByteLoopAt8=*/false>(p, source_codes, res_begin[pass],
                                                                                res_end[pass], sum);
          }
          finish_row<kContainer>(p, out_int, row, f0, source_codes, sum);
        }
      }
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) res_begin[pass] = next_begin[pass], res_end[pass] = next_end[pass];
    }
  }
#else
  __trap();  // the host launches this only on sm_90 with the sm_90a image built
#endif
}

template <int kBlockN, int kStack, int kContainer>
bool launch(const at::Tensor& tile_bits, const at::Tensor& x, const SpmmArgs& args, int32_t* out_int) {
  constexpr int kTileN = kBlockN / kStack;
  const int64_t num_tiles = tile_bits.size(1);
  CUtensorMap a_map, x_map;
  if (!encode_planes(&a_map, tile_bits.view({num_tiles, kTileRows, kRowBytes / 4}), kRowBytes / 4, kTileRows) ||
      !encode_planes(&x_map, x, kRowBytes / 4, kTileN, static_cast<int>(x.size(0))))
    return false;
  const int device = x.device().index();
  const int smem_optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  int stages = kMaxStages;
  while (stages > 2 && shared_layout<kBlockN, kStack>(stages).total > static_cast<size_t>(smem_optin)) --stages;
  const size_t smem = shared_layout<kBlockN, kStack>(stages).total;
  if (smem > static_cast<size_t>(smem_optin)) return false;
  auto kernel = bit_spmm_wgmma_kernel<kBlockN, kStack, kContainer>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t n_tiles = (args.cols + kTileN - 1) / kTileN;
  const int64_t work_units = (args.rows + kBlockRows - 1) / kBlockRows * n_tiles;
  const int64_t grid = std::min<int64_t>(work_units, sm_count(device));
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      a_map, x_map, args, static_cast<int>(x.size(0)), stages, static_cast<int>(n_tiles), work_units,
      static_cast<int>(num_tiles), out_int);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace

bool bit_spmm_wgmma(const at::Tensor& tile_bits, const at::Tensor& x, const SpmmArgs& args, int32_t* out_int) {
  if (!bitmm_wgmma_available(x.device())) return false;
  const int64_t num_tiles = tile_bits.size(1);
  // A binary adjacency with tiles, int32 sums, coordinates the tensor maps' int32 take; otherwise the mma.sync
  // tile kernel runs.
  if (tile_bits.size(0) != 1 || num_tiles == 0 || num_tiles * kTileRows >= (int64_t{1} << 31) ||
      x.size(1) >= (int64_t{1} << 31) || x.size(2) >= (int64_t{1} << 31))
    return false;
  switch (x.size(0)) {
    case 1: return launch<64, 1, 1>(tile_bits, x, args, out_int);
    case 2: return launch<128, 2, 2>(tile_bits, x, args, out_int);
    case 3:
    case 4: return launch<256, 4, 4>(tile_bits, x, args, out_int);
    default: return launch<256, 8, 8>(tile_bits, x, args, out_int);
  }
}

}  // namespace cuda
}  // namespace pyg_quant
