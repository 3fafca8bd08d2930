#pragma once
// Order-preserving unsigned keys of float32 values, for min / max reductions on integer hardware (warp reductions,
// atomics): key(a) < key(b) whenever a < b, and -0 sorts below +0.  A positive NaN keys above +inf and a negative
// one below -inf, so a reduction over keys always sees a NaN at one end: the callers flag NaNs themselves.
#include <cstdint>

namespace pyg_quant {
namespace cuda {

__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float from_ordered_key(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

}  // namespace cuda
}  // namespace pyg_quant
