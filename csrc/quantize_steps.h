#pragma once
// The float32 steps of one range and one code, written once for the CPU and the GPU (to_bit's recipe, see
// pyg_quant/layout.py):
//   scale = (max - min) / (2^bits - 1),  inv = scale > 0 ? 1 / scale : 0,
//   code  = clamp(floor((x - lo) * inv + u), 0, 2^bits - 1)   (u = 0.5 for nearest rounding).
// Every operation is rounded to float32 on its own: on the GPU through the explicitly rounded intrinsics, on the
// CPU by plain operators under -ffp-contract=off, so the two backends produce the same ranges and codes.  The
// clamp comes before the truncation: for t >= 0 truncation is floor, for t < 0 both give 0, and a NaN t gives 0.
#include <cstdint>

#include "macros.h"

namespace pyg_quant {

PYG_QUANT_HOST_DEVICE float f32_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

PYG_QUANT_HOST_DEVICE float f32_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

PYG_QUANT_HOST_DEVICE float f32_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

PYG_QUANT_HOST_DEVICE float f32_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// A code's value, to_val's recipe: lo + scale * q, each operation rounded to float32.
PYG_QUANT_HOST_DEVICE float value_of(uint32_t q, float lo, float scale) {
  return f32_add(lo, f32_mul(scale, static_cast<float>(q)));
}

// One range of to_bit: lo = min, scale and its inverse (0 when scale is 0) correctly rounded.
struct Range {
  float lo, scale, inv;
};

PYG_QUANT_HOST_DEVICE Range range_of(float mn, float mx, float max_code) {
  const float scale = f32_div(f32_sub(mx, mn), max_code);
  return {mn, scale, scale > 0.0f ? f32_div(1.0f, scale) : 0.0f};
}

// The code of x for lo / inv (a range's or any broadcast pair), with rounding offset u.
PYG_QUANT_HOST_DEVICE uint32_t code_of(float x, float lo, float inv, float u, float max_code) {
  float t = f32_add(f32_mul(f32_sub(x, lo), inv), u);
  t = t > 0.0f ? t : 0.0f;  // NaN -> 0
  t = t < max_code ? t : max_code;
  return static_cast<uint32_t>(t);
}

PYG_QUANT_HOST_DEVICE uint32_t code_of(float x, const Range& range, float u, float max_code) {
  return code_of(x, range.lo, range.inv, u, max_code);
}

}  // namespace pyg_quant
