#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the counter-based generator
// behind torch's CUDA random ops: 128 random bits are a pure function of a 64-bit key and a 128-bit counter.
#include <cstdint>

namespace pyg_quant {

__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kBump0 = 0x9E3779B9u, kBump1 = 0xBB67AE85u;  // key schedule (golden ratio, sqrt(3) - 1)
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kMul0, counter.x), lo0 = kMul0 * counter.x;
    const uint32_t hi1 = __umulhi(kMul1, counter.z), lo1 = kMul1 * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    key.x += kBump0;
    key.y += kBump1;
  }
  return counter;
}

// The 32 random bits of element i of a draw at generator state (seed, offset), laid out as curand's Philox with
// subsequence i / 4 skipped ahead by offset would give them (torch reserves [offset, offset + 4) of every
// subsequence for a call that asks its CUDA generator for 4), so no other draw of the generator reuses them.
__device__ __forceinline__ uint32_t philox_bits(uint64_t seed, uint64_t offset, uint64_t i) {
  const uint64_t step = offset / 4, sub = i / 4;
  const uint4 r = philox4x32_10(make_uint4(static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32),
                                           static_cast<uint32_t>(sub), static_cast<uint32_t>(sub >> 32)),
                                make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
  const uint32_t k = static_cast<uint32_t>(i & 3);
  return k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w;
}

// U[0, 1) on the grid of 2^-24 (24 random bits, which a float32 holds exactly).
__device__ __forceinline__ float philox_uniform(uint64_t seed, uint64_t offset, uint64_t i) {
  return static_cast<float>(philox_bits(seed, offset, i) >> 8) * 0x1p-24f;
}

}  // namespace pyg_quant
