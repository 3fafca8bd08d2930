// Register-only throughput of the b1 tensor-core instruction the kernels use
// (mma.sync m16n8k256 .and.popc): the compute ceiling for benchmarks/gpu_kernels.py.
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a bmma_peak.cu -o bmma_peak
#include <cstdint>

#include "peak_timing.cuh"

constexpr int kChains = 8;  // independent accumulators per warp hide the MMA latency

__global__ void bmma_loop(int iters, uint32_t seed, int* sink) {
  uint32_t a[4] = {seed, seed * 3u, seed * 5u, seed * 7u}, b[2] = {~seed, seed ^ 0x5555u};
  int d[kChains][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+r"(d[c][0]), "+r"(d[c][1]), "+r"(d[c][2]), "+r"(d[c][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  int s = 0;
  for (int c = 0; c < kChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  if (s == 0x7fffffff) sink[0] = s;  // keeps the loop alive
}

int main() {
  const int sms = multiprocessor_count();
  int* sink;
  CHECK(cudaMalloc(&sink, sizeof(int)));
  const int iters = 4096, threads = 256, blocks = sms * 8;
  const float best = best_ms([&](int n, int rep) { bmma_loop<<<blocks, threads>>>(n, 12345u + rep, sink); }, iters);
  const double ops = 2.0 * 16 * 8 * 256 * double(kChains) * iters * (double(blocks) * threads / 32);
  printf("{\"instruction\": \"mma.sync.m16n8k256.and.popc\", \"sms\": %d, \"ms\": %.4f, \"binary_tops\": %.1f}\n", sms, best,
         ops / (best * 1e-3) / 1e12);
  return 0;
}
