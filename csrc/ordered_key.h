#pragma once
// Order-preserving unsigned keys of float32 values, for min / max reductions on integer hardware (warp reductions,
// atomics), written once for the CPU and the GPU: key(a) < key(b) whenever a < b, and -0 sorts below +0.  A positive
// NaN keys above +inf and a negative one below -inf, so a reduction over keys always sees a NaN at one end: the
// callers flag NaNs themselves.
//
// Column keys (col_keys of quant_mlp, quant_mlp_planes and quantize_pack_ranges): an int64 [2·cols] buffer, slot c
// the max over column c's values of key(v), slot cols + c the max of 0xffffffff ^ key(v) (the complement turns the
// minimum into a maximum, so one atomicMax serves both and the result does not depend on the order of the
// updates).  Zeros mean "nothing seen": no key or complement is below 0.  Any NaN reaches one of the two slots
// (a positive one the max, a negative one the min's complement), and column_extrema then makes both ends NaN, as
// amin / amax do.  pyg_quant/ops/reference.py writes the same encoding in torch.
#include <cmath>
#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

#include "macros.h"

namespace pyg_quant {

// The least key of a non-finite value in either slot of a column's keys (+inf's key in a max slot, -inf's
// complement in a min slot; NaNs key beyond them), and a key that reads as NaN in either slot.
constexpr uint32_t kNonFiniteKey = 0xFF800000u;
constexpr uint32_t kNanKey = 0xFFC00000u;

PYG_QUANT_HOST_DEVICE uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
#endif
}

PYG_QUANT_HOST_DEVICE float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
#endif
}

PYG_QUANT_HOST_DEVICE uint32_t ordered_key(float v) {
  const uint32_t b = float_bits(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

PYG_QUANT_HOST_DEVICE float from_ordered_key(uint32_t k) {
  return bits_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// What a column's min slot holds for v (see above).
PYG_QUANT_HOST_DEVICE uint32_t min_slot_key(float v) { return 0xffffffffu ^ ordered_key(v); }

// A column's extrema from its two slots: both NaN when either is.
PYG_QUANT_HOST_DEVICE void column_extrema(uint64_t max_slot, uint64_t min_slot, float& mn, float& mx) {
  mn = from_ordered_key(0xffffffffu ^ static_cast<uint32_t>(min_slot));
  mx = from_ordered_key(static_cast<uint32_t>(max_slot));
  if (mn != mn || mx != mx) mn = mx = NAN;
}

}  // namespace pyg_quant
