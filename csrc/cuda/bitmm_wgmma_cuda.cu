// Any-bitwidth GEMM on Hopper's warpgroup tensor cores (wgmma m64nNk256 .b1 .and.popc, sm_90a), fed by the bulk
// tensor copy engine (TMA) in a warp-specialised pipeline.
//
// Same operands and result as bitmm_kernel (bitmm_cuda.cu): A row-layout planes [s, M_pad, W], B col-layout
// planes [t, N_pad, W], int32 C[M, N] = Σ_{p,q} 2^(p+q) · popc(A_p AND B_q).
//
// Block: three warpgroups (384 threads), a 128 x kBlockN product tile (n256 for one plane pair, n128 for several,
// n64 when N <= 64; with 2 to 8 B planes, kStack = 2, 4 or 8 slots of kBlockN / kStack output columns each, n256
// for one A plane and n128 for several: see below).  Warpgroup 0 is the producer: one thread issues the TMA
// copies, the warpgroup gives its registers away (setmaxnreg 40).  Warpgroups 1 and 2 are the consumers
// (setmaxnreg 232), rows 0-63 and 64-127 of the tile against all kBlockN columns.  K is walked in chunks of kSteps
// k256 steps (kSteps x 32 bytes of every plane row); a stage holds one chunk of every plane of the tile's A rows and
// B columns in wgmma's K-major swizzled layout, which the TMA writes itself (box = kSteps * 32 bytes x rows, swizzle
// span = the row), `stages` deep.
//
// Pipeline, per stage: a `full` mbarrier (1 arrival: the producer's arrive.expect_tx of the stage's bytes, then the
// copies' complete_tx) and an `empty` mbarrier (one arrival per consumer warp of every CTA in the cluster).  The
// producer waits on `empty`, arms `full` and issues the copies; a consumer warpgroup waits on `full`, issues its
// MMAs, and once wgmma.wait_group says a chunk's MMAs have retired (their shared-memory reads are done) each of its
// warps arrives on that stage's `empty` barrier in every CTA of the cluster.  No block-wide barrier in the loop:
// the copies run as far ahead as the stages allow, and the two consumer warpgroups drift freely.
//
// Why a 2-CTA cluster sharing B (TMA multicast), with the arithmetic.  At the b1 peak of ~15.6 binary POPS one
// m64n256k256 (8.4M ops) takes ~128 SM cycles (15.6e15 / 132 SMs / ~1.85 GHz ≈ 64K ops per cycle).  A 128 x 256
// tile's k256 step (2 MMAs, 256 cycles) reads A 128 x 32 B = 4 KB and B 256 x 32 B = 8 KB: 48 B per SM cycle,
// 132 x 1.85e9 x 48 ≈ 11.7 TB/s from L2 at peak, about twice what a Hopper L2 delivers, so 50% of peak was
// the ceiling of the unshared tile.  Two CTAs of a cluster take the M tiles 2i and 2i+1 of one N tile; each
// copies its own A tile (4 KB per step) and half of the common B tile (4 KB), multicast into both: 8 KB per SM
// per 256 cycles = 32 B/cycle, 7.8 TB/s at peak, 3.9 TB/s at 50%.  Rejected: a third consumer warpgroup (192 x
// 256: 6 + 8 KB per 384 cycles = 37 B/cycle, 9 TB/s at peak, and 3 x 128 accumulator registers); a 4-CTA
// cluster (4 + 2 KB = 24 B/cycle) would cut L2 traffic further, but 132 SMs are 66 TPC pairs and 4-CTA clusters
// leave SMs of some GPCs idle — the next step if L2 still bounds this one.  An A tile is read by every N tile of
// its rows: the n-fastest grid runs those CTAs together, so A comes from DRAM once (and from L2 once per N tile).
//
// Persistent: the grid is as many clusters as the device runs at once (cudaOccupancyMaxActiveClusters, 66 on a
// 132-SM GPU), and each walks work units (an N tile of a pair of M tiles) with a stride of the grid.  The
// producer's stages run on from one unit into the next, so a unit's first chunks are copied while the consumers
// multiply its predecessor's last ones and store its result; with one unit per cluster the SMs of a full grid
// stored their results all at once (17 MB at 16384 x 512) while no MMA ran, then filled the next wave's pipelines
// from nothing.
//
// One plane pair (s = t = 1): the MMAs accumulate straight into the result.  One A plane and 2 to 8 B planes
// (1-bit A times a t-bit X, QGTC's case): the B planes' tiles of kBlockN / kStack columns each are stacked along N
// in the stage (kStack = 2, 4 or 8 slots, those past t zero), so the t pairs are one n256 (or n128) MMA a step into
// one accumulator, as for one pair, and each thread folds its columns of plane q, shifted by q, into those of
// plane 0 before the store.  Several A planes and 2 to 8 B planes: the same stacking in n128, a pair is an A plane
// against the stacked B, and its partial folds into an output tile of 128 / kStack columns (a tile of 16 columns at
// 8 B planes: s pairs a step instead of s x t, the B operand's bytes a step 1 / t of before, A's t times more as the
// output tiles narrow).  Several pairs (stacked or, for one B plane, s of them): the MMAs of one pair over a chunk
// run into one of two partial accumulators and are folded into the result shifted by its planes' weights once they
// retire, while the next pair's MMAs run into the other; each plane's tile is copied once per chunk and read by
// every pair that uses it.
//
// Edges: rows past the padded operands and words past K are zero-filled by the TMA (and counted in the
// transaction bytes), so a partial last chunk or tile needs no predication; a box that would start wholly outside
// an operand (the unused second CTA of a cluster when the M tiles are odd, the far half of B in the last N tile)
// is pointed at the operand's last row instead: it only feeds output rows/columns that are never stored.
#include "bitmm_cuda.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include "device_limits.h"
#include "tensor_map.h"
#include "tma.cuh"
#include "wgmma.cuh"

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

constexpr int kBlockM = 128, kThreads = 384, kMaxStages = 8;
constexpr int kCluster = 2;  // CTAs sharing one B tile (multicast); consecutive M tiles
[[maybe_unused]] constexpr int kWarpgroupM = 64, kConsumerWarps = 8;
// 40 + 2 x 232 = 504 registers per thread row: 504 x 128 = 64,512 of the SM's 65,536 (entry: 168 x 384).
[[maybe_unused]] constexpr int kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kAlignSlack = 1024;  // the 128-byte swizzle repeats every 1024 bytes: stages start 1024-aligned

template <int kRegs>
__device__ __forceinline__ void fold_shifted(int32_t (&acc)[kRegs], const int32_t (&part)[kRegs], int shift) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] += part[i] << shift;
}

// A plane p's product with kStack stacked B planes (kTileN columns each; a thread holds column c of plane q at
// accumulator 4 (j + q kTileN / 8) + i where it holds column c of plane 0 at 4j + i) into the output tile.
template <int kTileN, int kStack, int kRegs>
__device__ __forceinline__ void fold_stacked(int32_t (&acc)[kTileN / 2], const int32_t (&part)[kRegs], int p) {
  static_assert(kRegs == kTileN / 2 * kStack, "the partial spans every slot");
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
    for (int q = 0; q < kStack; ++q) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[4 * j + i] += part[4 * (j + q * kTileN / 8) + i] << (p + q);
    }
  }
}

#ifdef PYG_QUANT_WGMMA
// A consumer warp's stage release: its share of the MMAs that read the stage has retired (wgmma.wait_group), so
// every CTA whose copies refill this stage (all of them: B is multicast) may overwrite it.
__device__ __forceinline__ void release_stage(uint32_t empty_bar, int lane) {
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kCluster; ++r) mbar_arrive_cluster(empty_bar, r);
  }
}
#endif

template <int kBlockN, bool kOnePair, int kStack, int kSteps>
__global__ void __launch_bounds__(kThreads, 1)
    bitmm_wgmma_tma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                           int s, int t, int a_outer, int b_outer, int64_t words, int64_t rows, int64_t cols,
                           int stages, int n_tiles, int64_t work_units, int32_t* __restrict__ out) {
#ifdef PYG_QUANT_WGMMA
  constexpr int kRowBytes = kSteps * 32;  // one plane row's share of a chunk = the TMA box's inner extent
  constexpr int kRegs = kBlockN / 2;
  constexpr int kTileN = kBlockN / kStack;      // output columns of a tile
  constexpr int kHalfN = kTileN / kCluster;     // rows of each B plane each CTA of the cluster copies (and multicasts)
  // The result's registers: the whole product tile for one pair (stacked planes fold in place at the end), one
  // output tile of kTileN columns for several pairs (each pair's partial folds into it).
  constexpr int kAccRegs = kOnePair ? kRegs : kTileN / 2;
  constexpr SmemSwizzle kSwizzle = swizzle_for_row_bytes<kRowBytes>();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Same offset in every CTA (same kernel, same layout): multicast copies and remote arrives rely on it.
  const uint32_t smem_base = (smem_u32(smem_raw) + (kAlignSlack - 1)) & ~static_cast<uint32_t>(kAlignSlack - 1);
  const uint32_t a_bytes = static_cast<uint32_t>(s * kBlockM * kRowBytes);
  // Stacked planes take kStack slots of kTileN rows, of which the first t are copied (t = 3, 5, 6, 7: the rest
  // stay zero, so their columns add nothing); otherwise a stage holds exactly what is copied.
  const uint32_t copied_bytes = a_bytes + static_cast<uint32_t>(t * kTileN * kRowBytes);
  const uint32_t stage_bytes = kStack > 1 ? a_bytes + static_cast<uint32_t>(kBlockN * kRowBytes) : copied_bytes;
  const uint32_t full_bars = smem_base + static_cast<uint32_t>(stages) * stage_bytes;  // 8 bytes each
  const uint32_t empty_bars = full_bars + 8u * static_cast<uint32_t>(stages);
  // Persistent: cluster c takes work units c, c + clusters, ...; a unit is one N tile of one pair of M tiles (this
  // CTA's is the rank-th), N fastest, so that the clusters running at once share A rows.  Both CTAs of a cluster
  // walk the same units, hence the same chunks, stages and phases.
  const uint32_t rank = cluster_ctarank();
  const int64_t first_unit = blockIdx.y / kCluster, unit_stride = gridDim.y / kCluster;
  auto tile_n0 = [&](int64_t unit) { return (unit % n_tiles) * kTileN; };
  auto tile_m0 = [&](int64_t unit) { return ((unit / n_tiles) * kCluster + rank) * kBlockM; };
  const int64_t chunk_words = kSteps * 8;
  const int64_t num_chunks = (words + chunk_words - 1) / chunk_words;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_init(full_bars + 8u * i, 1);
      mbar_init(empty_bars + 8u * i, kCluster * kConsumerWarps);
    }
    fence_mbarrier_init_cluster();
  }
  if (kStack > 1 && stage_bytes > copied_bytes) {
    // Zeroed once: no copy ever writes the empty slots.  The MMAs read them through the async proxy.
    const uint32_t empty_words = (stage_bytes - copied_bytes) / 4;
    for (int i = 0; i < stages; ++i) {
      const uint32_t slots = smem_base + static_cast<uint32_t>(i) * stage_bytes + copied_bytes;
      for (uint32_t w = threadIdx.x; w < empty_words; w += kThreads)
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(slots + 4u * w), "r"(0u) : "memory");
    }
    fence_proxy_async_shared();
  }
  __syncwarp();  // the cluster barrier is .aligned: warp 0 arrives converged
  // Every CTA's barriers exist before any peer's multicast copy or remote arrive can reach them.
  cluster_sync();

  if (warpgroup == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_tensormap(&a_map);
      prefetch_tensormap(&b_map);
      const uint16_t all_ctas = static_cast<uint16_t>((1u << kCluster) - 1);
      const uint32_t b_half = a_bytes + rank * static_cast<uint32_t>(kHalfN * kRowBytes);
      StageCursor cursor{stages};
      // The stages run on across units: the next tile's first chunks are copied while the consumers still
      // multiply the last ones and store the result (the overlap this loop is for).
      for (int64_t unit = first_unit; unit < work_units; unit += unit_stride) {
        // Box origins, clamped into the operand (see the header: such boxes only feed unstored outputs).
        const int a_row = static_cast<int>(std::min<int64_t>(tile_m0(unit), a_outer - 1));
        const int b_row = static_cast<int>(std::min<int64_t>(tile_n0(unit) + rank * kHalfN, b_outer - 1));
        for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
          // Round r of a stage waits for the consumers' r-th release (phase r - 1 of `empty`, 16 arrivals: every
          // consumer warp of both CTAs); round 0 waits on parity 1, the phase "before" a fresh barrier's, which
          // passes at once.
          mbar_wait(empty_bars + 8u * cursor.stage, cursor.phase ^ 1u);
          const uint32_t full = full_bars + 8u * cursor.stage;
          const uint32_t dst = smem_base + static_cast<uint32_t>(cursor.stage) * stage_bytes;
          // All bytes that land in this CTA's stage: its A tile and both halves of B (the peer's half arrives by the
          // peer's multicast, possibly before this arm: the transaction count may dip below zero meanwhile, the phase
          // cannot complete without this arrival).
          mbar_arrive_expect_tx(full, copied_bytes);
          const int k = static_cast<int>(chunk * chunk_words);
          for (int p = 0; p < s; ++p)
            tma_load_3d(dst + static_cast<uint32_t>(p * kBlockM * kRowBytes), &a_map, full, k, a_row, p);
          for (int q = 0; q < t; ++q)
            tma_load_3d_multicast(dst + b_half + static_cast<uint32_t>(q * kTileN * kRowBytes), &b_map, full, k, b_row,
                                  q, all_ctas);
          cursor.advance();
        }
      }
    }
    __syncwarp();
    // A CTA leaves only when its peer is done: the peer's consumers still arrive on this CTA's `empty` barriers,
    // and the peer waits for this CTA's multicast halves of B.
    cluster_sync();
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int lane = threadIdx.x % 32;
    auto a_desc = [&](uint32_t stage_addr, int plane, int step) {
      return smem_descriptor_at(
          stage_addr + static_cast<uint32_t>((plane * kBlockM + consumer * kWarpgroupM) * kRowBytes + step * 32),
          16, 8 * kRowBytes, kSwizzle);
    };
    auto b_desc = [&](uint32_t stage_addr, int plane, int step) {
      return smem_descriptor_at(stage_addr + a_bytes + static_cast<uint32_t>(plane * kTileN * kRowBytes + step * 32),
                                16, 8 * kRowBytes, kSwizzle);
    };

    // One pair: the first MMA of a tile overwrites acc (scale-d = 0), so it is never cleared; clearing it would
    // put register moves between the asynchronous MMAs of consecutive chunks, and ptxas would serialise them.
    int32_t acc[kAccRegs];
    int32_t part[2][kOnePair ? 1 : kRegs];
    const int warp = (threadIdx.x / 32) % 4;
    const bool pairs_aligned = cols % 2 == 0;

    StageCursor cursor{stages};
    for (int64_t unit = first_unit; unit < work_units; unit += unit_stride) {
      if constexpr (kOnePair) {
        int previous = 0;
        for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
          mbar_wait(full_bars + 8u * cursor.stage, cursor.phase);
          const uint32_t stage_addr = smem_base + static_cast<uint32_t>(cursor.stage) * stage_bytes;
          wgmma_fence();
#pragma unroll
          for (int k = 0; k < kSteps; ++k)
            wgmma_b1<kBlockN>(acc, a_desc(stage_addr, 0, k), b_desc(stage_addr, 0, k), chunk > 0 || k > 0);
          wgmma_commit();
          // This chunk's MMAs stay in flight; the previous chunk's have retired: its stage goes back.
          wgmma_wait<1>();
          if (chunk > 0) release_stage(empty_bars + 8u * previous, lane);
          previous = cursor.stage;
          cursor.advance();
        }
        wgmma_wait<0>();
        release_stage(empty_bars + 8u * previous, lane);  // the next unit's copies may wait for it
      } else {
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) acc[i] = 0;
        // Stacked B planes: a pair is an A plane against all of them (q = 0 names the stacked operand).
        const int b_planes = kStack > 1 ? 1 : t;
        const int pairs = s * b_planes;
        auto fold = [&](const int32_t(&part_acc)[kRegs], int p, int q) {
          if constexpr (kStack > 1) {
            fold_stacked<kTileN, kStack>(acc, part_acc, p);
          } else {
            fold_shifted(acc, part_acc, p + q);
          }
        };
        for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
          mbar_wait(full_bars + 8u * cursor.stage, cursor.phase);
          const uint32_t stage_addr = smem_base + static_cast<uint32_t>(cursor.stage) * stage_bytes;
          auto issue_pair = [&](int32_t(&part_acc)[kRegs], int p, int q) {
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < kSteps; ++k)
              wgmma_b1<kBlockN>(part_acc, a_desc(stage_addr, p, k), b_desc(stage_addr, q, k), k > 0);
            wgmma_commit();
          };
          // Two pairs at a time, into part[0] and part[1]: the first is folded while the second's MMAs run.  Each
          // iteration retires all it issued, and the lone last pair has a branch of its own: ptxas keeps wgmma
          // asynchronous only when every path shows which accumulator a wait retires (with one `if (second)`
          // before the waits and another before the second fold it assumed the path through neither and
          // injected a wait).
          for (int j = 0; j < pairs; j += 2) {
            if (j + 1 < pairs) {
              issue_pair(part[0], j / b_planes, j % b_planes);
              issue_pair(part[1], (j + 1) / b_planes, (j + 1) % b_planes);
              wgmma_wait<1>();
              fence_registers(part[0]);
              fold(part[0], j / b_planes, j % b_planes);
              wgmma_wait<0>();
              fence_registers(part[1]);
              fold(part[1], (j + 1) / b_planes, (j + 1) % b_planes);
            } else {
              issue_pair(part[0], j / b_planes, j % b_planes);
              wgmma_wait<0>();
              fence_registers(part[0]);
              fold(part[0], j / b_planes, j % b_planes);
            }
          }
          release_stage(empty_bars + 8u * cursor.stage, lane);  // every MMA of this chunk has retired
          cursor.advance();
        }
      }

      if constexpr (kOnePair && kStack > 1) fold_stacked_planes<kTileN, kStack>(acc);
      // The stores are not waited for: the next unit's MMAs start on stages the producer has already filled.
      const int64_t n0 = tile_n0(unit);
      const int64_t row0 = tile_m0(unit) + consumer * kWarpgroupM + warp * 16 + lane / 4;
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
        const int64_t col = n0 + 8 * j + 2 * (lane % 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int64_t row = row0 + 8 * half;
          if (row >= rows || col >= cols) continue;
          int32_t* dst = out + row * cols + col;
          if (pairs_aligned) {  // col is even, so both fit and dst is 8-byte aligned
            *reinterpret_cast<int2*>(dst) = make_int2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
          } else {
            dst[0] = acc[4 * j + 2 * half];
            if (col + 1 < cols) dst[1] = acc[4 * j + 2 * half + 1];
          }
        }
      }
    }
    __syncwarp();
    cluster_sync();
  }
#else
  __trap();  // the host launches this only on sm_90 with the sm_90a image built
#endif
}

// How many clusters of `kernel` the device runs at once with `config`'s block, cluster and shared memory, per
// device and kernel: the occupancy query costs a few microseconds, the launches are many.
template <typename Kernel>
int64_t max_active_clusters(Kernel kernel, const cudaLaunchConfig_t& config, int device) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, size_t>, int64_t> known;
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), config.dynamicSmemBytes);
  std::lock_guard<std::mutex> lock(mutex);
  auto found = known.find(key);
  if (found != known.end()) return found->second;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; one cluster per work unit is then launched, as before persistence
    clusters = 0;
  }
  const int64_t result = clusters > 0 ? clusters : int64_t{1} << 30;
  known.emplace(key, result);
  return result;
}

template <int kBlockN, bool kOnePair, int kStack, int kSteps>
bool launch_tma(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, int stages, size_t smem,
                at::Tensor& out) {
  constexpr int kTileN = kBlockN / kStack;
  CUtensorMap a_map, b_map;
  if (!encode_planes(&a_map, a, kSteps * 8, kBlockM) || !encode_planes(&b_map, b, kSteps * 8, kTileN / kCluster))
    return false;
  auto kernel = bitmm_wgmma_tma_kernel<kBlockN, kOnePair, kStack, kSteps>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t n_tiles = (cols + kTileN - 1) / kTileN;
  const int64_t m_pairs = ((rows + kBlockM - 1) / kBlockM + kCluster - 1) / kCluster;
  const int64_t work_units = n_tiles * m_pairs;
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1;
  attribute[0].val.clusterDim.y = kCluster;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  // As many clusters as fit at once (one CTA an SM), each looping over work units; when fewer units than that,
  // one each.
  config.gridDim = dim3(1, kCluster);
  const int64_t resident = max_active_clusters(kernel, config, a.device().index());
  const int64_t clusters = std::min<int64_t>({work_units, std::max<int64_t>(resident, 1), 65535 / kCluster});
  config.gridDim = dim3(1, static_cast<unsigned>(clusters * kCluster));
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a_map, b_map, static_cast<int>(a.size(0)),
                                    static_cast<int>(b.size(0)), static_cast<int>(a.size(1)),
                                    static_cast<int>(b.size(1)), a.size(2), rows, cols, stages,
                                    static_cast<int>(n_tiles), work_units, out.data_ptr<int32_t>()));
  return true;
}

template <int kBlockN, bool kOnePair, int kStack = 1>
bool launch_tma_steps(int steps, const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, int stages,
                      size_t smem, at::Tensor& out) {
  switch (steps) {
    case 1: return launch_tma<kBlockN, kOnePair, kStack, 1>(a, b, rows, cols, stages, smem, out);
    case 2: return launch_tma<kBlockN, kOnePair, kStack, 2>(a, b, rows, cols, stages, smem, out);
    default: return launch_tma<kBlockN, kOnePair, kStack, 4>(a, b, rows, cols, stages, smem, out);
  }
}

}  // namespace

bool bitmm_wgmma_available(const at::Device& device) {
#ifdef PYG_QUANT_SM90A
  const int major = cuda::device_attribute(cudaDevAttrComputeCapabilityMajor, device.index());
  const int minor = cuda::device_attribute(cudaDevAttrComputeCapabilityMinor, device.index());
  return major == 9 && minor == 0;
#else
  (void)device;
  return false;  // the build has no sm_90a image (TORCH_CUDA_ARCH_LIST without 9.0a)
#endif
}

bool bitmm_int_wgmma(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, at::Tensor& out) {
  if (!bitmm_wgmma_available(a.device())) return false;
  const int s = a.size(0), t = b.size(0);
  const int64_t words = a.size(2), k_steps = words / 8;
  // What the tensor maps and the kernel's int32 coordinates take; otherwise the mma.sync kernel runs.  (The
  // planes' rows are padded to 64 and K to 256 bits, so the row pitch is a multiple of 32 bytes.)
  if (k_steps == 0 || a.size(1) >= (int64_t{1} << 31) ||
      b.size(1) >= (int64_t{1} << 31) || words >= (int64_t{1} << 31))
    return false;
  const bool one_pair = s == 1 && t == 1;
  // 2 to 8 B planes: their tiles are stacked along N into one operand of 2, 4 or 8 slots (n256 for one A plane,
  // n128 for several), so that one A plane's pairs run as one pair does (one accumulator, MMAs back to back) and
  // several A planes make s pairs instead of s x t, each plane's columns folded into the result in registers.
  // 3, 5, 6 or 7 planes leave slots empty (zeros): up to 1/3 of the MMAs wasted, against t times the pairs, each
  // waiting for its partial's fold (see benchmarks/RESULTS.md, Layers and kernels, Dense bitmm).
  const int stack = t >= 2 ? (t <= 2 ? 2 : t <= 4 ? 4 : 8) : 1;
  // One pair keeps a single accumulator and can afford n256 (128 registers); several keep three (result + two
  // partials), so n128 at most.
  const int block_n = stack > 1 ? (s == 1 && !(stack == 2 && cols <= 64) ? 256 : 128)
                                : cols <= 64 ? 64 : (cols <= 128 || !one_pair ? 128 : 256);
  const int tile_n = block_n / stack;
  const int smem_optin = cuda::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, a.device().index());
  auto stage_bytes = [&](int steps) {
    return static_cast<int64_t>(s * kBlockM + (stack > 1 ? stack : t) * tile_n) * 32 * steps;
  };
  auto stages_for = [&](int steps) {
    return std::min<int64_t>(kMaxStages, (smem_optin - kAlignSlack) / (stage_bytes(steps) + 16));
  };
  // Chunks of 4, 2 or 1 k256 steps (128, 64 or 32-byte swizzled rows): the longest that leaves three stages
  // (two at least), so that the copies of two chunks are in flight while the MMAs of a third run.
  int steps = k_steps >= 4 ? 4 : (k_steps >= 2 ? 2 : 1);
  while (steps > 1 && stages_for(steps) < 3) steps /= 2;
  const int64_t chunks = (k_steps + steps - 1) / steps;
  const int64_t stages = std::min<int64_t>(stages_for(steps), std::max<int64_t>(2, chunks));
  if (stages < 2) return false;
  const size_t smem = static_cast<size_t>(kAlignSlack + stages * (stage_bytes(steps) + 16));
  const int st = static_cast<int>(stages);
  if (s > 1 && stack > 1) {
    if (stack == 2) return launch_tma_steps<128, false, 2>(steps, a, b, rows, cols, st, smem, out);
    if (stack == 4) return launch_tma_steps<128, false, 4>(steps, a, b, rows, cols, st, smem, out);
    return launch_tma_steps<128, false, 8>(steps, a, b, rows, cols, st, smem, out);
  }
  if (stack == 2) {
    if (block_n == 128) return launch_tma_steps<128, true, 2>(steps, a, b, rows, cols, st, smem, out);
    return launch_tma_steps<256, true, 2>(steps, a, b, rows, cols, st, smem, out);
  }
  if (stack == 4) return launch_tma_steps<256, true, 4>(steps, a, b, rows, cols, st, smem, out);
  if (stack == 8) return launch_tma_steps<256, true, 8>(steps, a, b, rows, cols, st, smem, out);
  if (one_pair) {
    if (block_n == 64) return launch_tma_steps<64, true>(steps, a, b, rows, cols, st, smem, out);
    if (block_n == 128) return launch_tma_steps<128, true>(steps, a, b, rows, cols, st, smem, out);
    return launch_tma_steps<256, true>(steps, a, b, rows, cols, st, smem, out);
  }
  if (block_n == 64) return launch_tma_steps<64, false>(steps, a, b, rows, cols, st, smem, out);
  return launch_tma_steps<128, false>(steps, a, b, rows, cols, st, smem, out);
}

}  // namespace pyg_quant
