#pragma once
// Stochastic rounding's noise drawn inside a kernel from a CUDA generator's Philox state, with torch's own engine
// (at::Philox4_32, Philox4x32-10) in curand's counter layout: element i takes the 32 bits of subsequence i / 4
// skipped ahead by the generator's offset (torch reserves [offset, offset + 4) of every subsequence for a call that
// asks its generator for 4), so no other draw of the generator reuses them.
#include <ATen/core/PhiloxRNGEngine.h>

#include <cstdint>

namespace pyg_quant {

__device__ __forceinline__ uint32_t philox_bits(uint64_t seed, uint64_t offset, uint64_t i) {
  at::Philox4_32 engine(seed, i / 4, offset / 4);
  uint32_t bits = engine();  // output 0 of the 128-bit block; outputs 1..3 follow without another block
  for (uint64_t k = i & 3; k > 0; --k) bits = engine();
  return bits;
}

// U[0, 1) on the grid of 2^-24 (24 random bits, which a float32 holds exactly).
__device__ __forceinline__ float philox_uniform(uint64_t seed, uint64_t offset, uint64_t i) {
  return static_cast<float>(philox_bits(seed, offset, i) >> 8) * 0x1p-24f;
}

}  // namespace pyg_quant
