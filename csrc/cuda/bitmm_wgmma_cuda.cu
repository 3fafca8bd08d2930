// Any-bitwidth GEMM on Hopper's warpgroup tensor cores (wgmma m64nNk256 .b1 .and.popc, sm_90a).
//
// Same operands and result as bitmm_kernel (bitmm_cuda.cu): A row-layout planes
// [s, M_pad, W], B col-layout planes [t, N_pad, W], int32
// C[M, N] = Σ_{p,q} 2^(p+q) · popc(A_p AND B_q).
//
// A block of two warpgroups (256 threads) computes a 128 x kBlockN tile,
// warpgroup w the rows 64w..64w+63 against all kBlockN columns.  K is walked in
// chunks of kSteps k256 steps; a chunk of every plane of the tile's rows and
// columns is copied into shared memory with cp.async, in wgmma's K-major
// swizzled layout (one row's chunk = kSteps * 32 contiguous bytes, 16-byte
// pieces permuted; wgmma.cuh), `stages` chunks deep.  The MMAs run asynchronously:
// while the tensor cores work on chunk c, the copies of chunks c+1..c+stages-2
// are in flight, and the stage of chunk c-2 is refilled only after every
// warpgroup has seen chunk c-1's MMAs retire (wgmma.wait_group 1, then the
// block barrier).
//
// One plane pair (s = t = 1): the MMAs accumulate straight into the result.
// Several: the MMAs of one pair (p, q) over a chunk run into one of two partial
// accumulators and are folded into the result shifted by p + q once they
// retire, while the next pair's MMAs run into the other one; each plane's tile
// is copied once per chunk and read by every pair that uses it.
#include "bitmm_cuda.h"

#include <algorithm>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "bmma.cuh"
#include "wgmma.cuh"

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

constexpr int kBlockM = 128, kWarpgroupM = 64, kThreads = 256, kMaxStages = 8;
constexpr int kSlotBytes = 16;  // one cp.async

__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  switch (pending) {  // wait_group takes an immediate
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    default: cp_async_wait<5>(); break;
  }
}

template <int kRegs>
__device__ __forceinline__ void fold_shifted(int32_t (&acc)[kRegs], const int32_t (&part)[kRegs], int shift) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] += part[i] << shift;
}

template <int kBlockN, bool kOnePair, int kSteps>
__global__ void __launch_bounds__(kThreads, 1)
    bitmm_wgmma_kernel(const uint32_t* __restrict__ a, const uint32_t* __restrict__ b, int s, int t, int64_t a_outer,
                       int64_t b_outer, int64_t words, int64_t rows, int64_t cols, int stages,
                       int32_t* __restrict__ out) {
#ifdef PYG_QUANT_WGMMA
  constexpr int kRowBytes = kSteps * 32;   // one plane row's share of a chunk
  constexpr int kCols = kRowBytes / kSlotBytes;
  constexpr int kRegs = kBlockN / 2;
  static_assert(kThreads % kCols == 0, "a thread copies the same 16-byte piece of every row it copies");
  extern __shared__ __align__(1024) uint4 smem[];  // the 128-byte swizzle repeats every 1024 bytes
  const int a_rows = s * kBlockM, b_rows = t * kBlockN;
  const int stage_bytes = (a_rows + b_rows) * kRowBytes;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBlockN;  // n fastest: blocks sharing A rows run together
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBlockM;
  const int warpgroup = threadIdx.x / 128;
  const int64_t chunk_words = kSteps * 8;
  const int64_t num_chunks = (words + chunk_words - 1) / chunk_words;

  // Stage layout: the rows of A's planes (s x kBlockM), then B's (t x kBlockN),
  // each kRowBytes at a pitch of kRowBytes, swizzled: 16-byte piece c of stage
  // row r sits at swizzle_offset(16 (r kCols + c)).  Each thread copies one
  // fixed piece (tid % kCols) of rows tid / kCols, + kRowsPerPass, ... of every
  // plane, so its source pointers advance by constant strides (the copy loop is
  // a few instructions per 16 bytes; with only 8 warps a slot it must be).
  // Consecutive threads copy consecutive pieces of a row: whole 32-byte sectors
  // from global memory, and 8 threads fill one 128-byte line of shared memory
  // (distinct banks).  Rows past the padded operand and words past K are
  // zero-filled.
  constexpr int kRowsPerPass = kThreads / kCols;
  const int piece = threadIdx.x % kCols, first_row = threadIdx.x / kCols;
  const int64_t a_plane = a_outer * words, b_plane = b_outer * words, pass_words = kRowsPerPass * words;
  const int a_valid_rows = static_cast<int>(std::min<int64_t>(a_outer - m0, kBlockM));
  const int b_valid_rows = static_cast<int>(std::min<int64_t>(b_outer - n0, kBlockN));
  const uint32_t* a_first = a + (m0 + first_row) * words + piece * 4;
  const uint32_t* b_first = b + (n0 + first_row) * words + piece * 4;
  char* const smem_bytes = reinterpret_cast<char*>(smem);
  auto copy_plane_rows = [&](char* stage, int stage_row0, const uint32_t* src, bool k_valid, int valid_rows,
                             auto plane_rows) {
    constexpr int kPlaneRows = decltype(plane_rows)::value;
#pragma unroll
    for (int pass = 0; pass < (kPlaneRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
      const int r = first_row + pass * kRowsPerPass;
      if (kPlaneRows % kRowsPerPass == 0 || r < kPlaneRows) {
        const bool valid = k_valid && r < valid_rows;
        const uint32_t offset = static_cast<uint32_t>(((stage_row0 + r) * kCols + piece) * kSlotBytes);
        cp_async_16(stage + swizzle_offset<kRowBytes>(offset), valid ? src + pass * pass_words : a,
                    valid ? kSlotBytes : 0);
      }
    }
  };
  auto load_chunk = [&](int64_t chunk, int stage_index) {
    if (chunk < num_chunks) {
      char* stage = smem_bytes + stage_index * stage_bytes;
      const int64_t k0 = chunk * chunk_words;
      const bool k_valid = k0 + piece * 4 < words;
      for (int p = 0; p < s; ++p)
        copy_plane_rows(stage, p * kBlockM, a_first + p * a_plane + k0, k_valid, a_valid_rows,
                        std::integral_constant<int, kBlockM>());
      for (int q = 0; q < t; ++q)
        copy_plane_rows(stage, a_rows + q * kBlockN, b_first + q * b_plane + k0, k_valid, b_valid_rows,
                        std::integral_constant<int, kBlockN>());
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
  constexpr SmemSwizzle kSwizzle = swizzle_for_row_bytes<kRowBytes>();
  auto a_desc = [&](const char* stage, int plane, int step) {
    return smem_descriptor(stage + (plane * kBlockM + warpgroup * kWarpgroupM) * kRowBytes + step * 32, kSlotBytes,
                           8 * kRowBytes, kSwizzle);
  };
  auto b_desc = [&](const char* stage, int plane, int step) {
    return smem_descriptor(stage + (a_rows + plane * kBlockN) * kRowBytes + step * 32, kSlotBytes, 8 * kRowBytes,
                           kSwizzle);
  };

  // One pair: the first MMA overwrites acc (scale-d = 0), so it starts
  // undefined; initialising it would put register moves between the
  // asynchronous MMAs of consecutive chunks, and ptxas would serialise them.
  int32_t acc[kRegs];
  if constexpr (!kOnePair) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc[i] = 0;
  }
  int32_t part[2][kOnePair ? 1 : kRegs];

  // Chunk c lives in stage c % stages; counters instead of 64-bit remainders.
  int load_stage = 0;
  for (int st = 0; st < stages - 2; ++st, ++load_stage) load_chunk(st, load_stage);
  int compute_stage = 0;
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    cp_async_wait_pending(stages - 3);  // this thread's copies of `chunk` have landed
    fence_proxy_async_shared();
    __syncthreads();  // everyone's have; and chunk - 2's MMAs have retired in both warpgroups
    load_chunk(chunk + stages - 2, load_stage);
    load_stage = load_stage + 1 == stages ? 0 : load_stage + 1;
    const char* stage = smem_bytes + compute_stage * stage_bytes;
    compute_stage = compute_stage + 1 == stages ? 0 : compute_stage + 1;
    if constexpr (kOnePair) {
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kSteps; ++k) wgmma_b1<kBlockN>(acc, a_desc(stage, 0, k), b_desc(stage, 0, k), chunk > 0 || k > 0);
      wgmma_commit();
      wgmma_wait<1>();
    } else {
      auto issue_pair = [&](int32_t(&part_acc)[kRegs], int p, int q) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kSteps; ++k) wgmma_b1<kBlockN>(part_acc, a_desc(stage, p, k), b_desc(stage, q, k), k > 0);
        wgmma_commit();
      };
      // Two pairs at a time, into part[0] and part[1]: the first is folded
      // while the second's MMAs run.  Each iteration retires all it issued
      // (ptxas keeps wgmma asynchronous only when it can see, within straight
      // code, which accumulator a wait retires).
      const int pairs = s * t;
      for (int j = 0; j < pairs; j += 2) {
        const bool second = j + 1 < pairs;
        issue_pair(part[0], j / t, j % t);
        if (second) issue_pair(part[1], (j + 1) / t, (j + 1) % t);
        if (second) {
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        fence_registers(part[0]);
        fold_shifted(acc, part[0], j / t + j % t);
        if (second) {
          wgmma_wait<0>();
          fence_registers(part[1]);
          fold_shifted(acc, part[1], (j + 1) / t + (j + 1) % t);
        }
      }
    }
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t row0 = m0 + warpgroup * kWarpgroupM + warp * 16 + lane / 4;
  const bool pairs_aligned = cols % 2 == 0;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
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
#else
  __trap();  // the host launches this only on sm_90 with the sm_90a image built
#endif
}

template <int kBlockN, bool kOnePair, int kSteps>
void launch_wgmma(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, int stages, size_t smem,
                  at::Tensor& out) {
  auto kernel = bitmm_wgmma_kernel<kBlockN, kOnePair, kSteps>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid((cols + kBlockN - 1) / kBlockN, (rows + kBlockM - 1) / kBlockM);
  kernel<<<grid, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(a.data_ptr<int32_t>()), reinterpret_cast<const uint32_t*>(b.data_ptr<int32_t>()),
      a.size(0), b.size(0), a.size(1), b.size(1), a.size(2), rows, cols, stages, out.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int kBlockN, bool kOnePair>
void launch_wgmma_steps(int steps, const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, int stages,
                        size_t smem, at::Tensor& out) {
  switch (steps) {
    case 1: launch_wgmma<kBlockN, kOnePair, 1>(a, b, rows, cols, stages, smem, out); break;
    case 2: launch_wgmma<kBlockN, kOnePair, 2>(a, b, rows, cols, stages, smem, out); break;
    default: launch_wgmma<kBlockN, kOnePair, 4>(a, b, rows, cols, stages, smem, out); break;
  }
}

}  // namespace

bool bitmm_wgmma_available(const at::Device& device) {
#ifdef PYG_QUANT_SM90A
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device.index()));
  return major == 9 && minor == 0;
#else
  (void)device;
  return false;  // the build has no sm_90a image (TORCH_CUDA_ARCH_LIST without 9.0a)
#endif
}

bool bitmm_int_wgmma(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, at::Tensor& out) {
  if (!bitmm_wgmma_available(a.device())) return false;
  const int s = a.size(0), t = b.size(0);
  const bool one_pair = s == 1 && t == 1;
  // One pair keeps a single accumulator and can afford n256 (128 registers);
  // several keep three (result + two partials), so n128 at most.
  const int block_n = cols <= 64 ? 64 : (cols <= 128 || !one_pair ? 128 : 256);
  const int64_t k_steps = a.size(2) / 8;
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, a.device().index()));
  const int64_t smem_limit = smem_optin;
  auto stage_bytes = [&](int steps) { return static_cast<int64_t>(s * kBlockM + t * block_n) * 2 * steps * kSlotBytes; };
  // Chunks of 4, 2 or 1 k256 steps (128, 64 or 32-byte swizzled rows): the
  // longest that leaves three stages.  Measured on an H100: longer chunks beat
  // deeper pipelines (16384 x 16384 x 512, one pair: 4 steps x 4 stages 5.2
  // POPS, 2 x 8 4.6; 4 x 4 bits: 2 x 3 4.9, 1 x 7 2.9), the per-chunk barrier
  // and fold cost more than the copies' latency.
  auto stages_for = [&](int steps) { return std::min<int64_t>(kMaxStages, smem_limit / stage_bytes(steps)); };
  int steps = k_steps >= 4 ? 4 : (k_steps >= 2 ? 2 : 1);
  while (steps > 1 && stages_for(steps) < 3) steps /= 2;
  const int64_t chunks = (k_steps + steps - 1) / steps;
  const int64_t stages = std::min<int64_t>(stages_for(steps), chunks + 2);
  if (stages < 3 || (rows + kBlockM - 1) / kBlockM > 65535) return false;  // the mma.sync kernel takes it
  const size_t smem = static_cast<size_t>(stages * stage_bytes(steps));
  const int st = static_cast<int>(stages);
  if (one_pair) {
    if (block_n == 64) launch_wgmma_steps<64, true>(steps, a, b, rows, cols, st, smem, out);
    else if (block_n == 128) launch_wgmma_steps<128, true>(steps, a, b, rows, cols, st, smem, out);
    else launch_wgmma_steps<256, true>(steps, a, b, rows, cols, st, smem, out);
  } else {
    if (block_n == 64) launch_wgmma_steps<64, false>(steps, a, b, rows, cols, st, smem, out);
    else launch_wgmma_steps<128, false>(steps, a, b, rows, cols, st, smem, out);
  }
  return true;
}

}  // namespace pyg_quant
