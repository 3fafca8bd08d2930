// Throughput ceiling of the instruction bitmm's sm_90 kernel uses:
// wgmma.mma_async m64n256k256 .s32.b1.b1.and.popc, both operands in shared
// memory (resident, never refilled), a chain of MMAs per warpgroup with one
// group in flight, 1-3 warpgroups per SM.  Prints JSON, the best configuration.
// Build: nvcc -O3 -I../../csrc -gencode=arch=compute_90a,code=sm_90a wgmma_peak.cu -o wgmma_peak
#include <cstdint>

#include "cuda/wgmma.cuh"
#include "peak_timing.cuh"

using namespace pyg_quant::cuda;

constexpr int kChain = 4;  // MMAs per commit group

__global__ void wgmma_loop(int iters, int* sink) {
  // A: 64 rows x 256 bits per warpgroup; B: 256 rows x 256 bits (K-major core matrices).
  __shared__ __align__(128) uint4 smem[4 * 64 * 2 + 256 * 2];
  for (int i = threadIdx.x; i < 4 * 64 * 2 + 256 * 2; i += blockDim.x)
    smem[i] = make_uint4(0x9E3779B9u * i, 0x85EBCA6Bu ^ i, 0xC2B2AE35u + i, ~i);
  fence_proxy_async_shared();
  __syncthreads();
  const int warpgroup = threadIdx.x / 128;
  const uint64_t a = smem_descriptor(smem + warpgroup * 128, 64 * 16, 128);
  const uint64_t b = smem_descriptor(smem + 4 * 128, 256 * 16, 128);
  int32_t d[128];
  for (int i = 0; i < iters; ++i) {
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < kChain; ++c) wgmma_b1<256>(d, a, b, i > 0 || c > 0);
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  int s = 0;
#pragma unroll
  for (int i = 0; i < 128; ++i) s += d[i];
  if (s == 0x7fffffff) sink[0] = s;  // keeps the loop alive
}

int main() {
  const int sms = multiprocessor_count();
  int* sink;
  CHECK(cudaMalloc(&sink, sizeof(int)));
  const int iters = 2048;
  double best_tops = 0;
  int best_warpgroups = 0;
  for (int warpgroups = 1; warpgroups <= 3; ++warpgroups) {
    const float ms = best_ms([&](int n, int) { wgmma_loop<<<sms, 128 * warpgroups>>>(n, sink); }, iters);
    const double tops = 2.0 * 64 * 256 * 256 * kChain * double(iters) * sms * warpgroups / (ms * 1e-3) / 1e12;
    fprintf(stderr, "%d warpgroup(s) per SM: %.1f binary TOPS\n", warpgroups, tops);
    if (tops > best_tops) best_tops = tops, best_warpgroups = warpgroups;
  }
  printf("{\"instruction\": \"wgmma.mma_async.m64n256k256.and.popc\", \"sms\": %d, \"warpgroups\": %d, \"binary_tops\": %.1f}\n",
         sms, best_warpgroups, best_tops);
  return 0;
}
