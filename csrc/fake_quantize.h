#pragma once
// Fake quantization and the MSE range search of pyg_quant.qat, shared by the CPU and CUDA kernels.
//
// One range [lo, hi] per group: the whole tensor (dim = -1), a column (dim = 0) or a row (dim = 1) of a
// 2-D float32 x.  The float32 steps are those of pyg_quant.to_bit / FakeQuantize, in the same order and
// rounded one by one (setup.py: -ffp-contract=off for C++, -fmad=false for CUDA), so both backends and
// the pure-torch reference give the same bits:
//
//   scale = (hi - lo) / (2^bits - 1),  inv = scale > 0 ? 1 / scale : 0,
//   fq(x) = lo + scale * clamp(floor((x - lo) * inv + u), 0, 2^bits - 1)       (u = 1/2 or noise)
//
// NaN stays NaN (as torch.clamp), so a non-finite input is never hidden behind a valid-looking code.
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/rand.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "macros.h"

namespace pyg_quant {

// The MSE search tries at most this many shrink factors (pyg_quant.qat.observers.MSE_GRID has 12).
constexpr int kMaxMseCandidates = 16;

struct AffineParams {
  float lo, scale, inv;
};

PYG_QUANT_HOST_DEVICE AffineParams affine_params(float lo, float hi, float levels) {
  const float scale = (hi - lo) / levels;
  return {lo, scale, scale > 0.0f ? 1.0f / scale : 0.0f};
}

PYG_QUANT_HOST_DEVICE float fake_quantize_value(float x, const AffineParams& p, float u, float levels) {
  float t = (x - p.lo) * p.inv;
  t = floorf(t + u);
  t = t < 0.0f ? 0.0f : (t > levels ? levels : t);  // NaN falls through both tests
  t = t * p.scale;
  return t + p.lo;
}

// Candidate k of the MSE search: [c + a (lo - c), c + a (hi - c)] with c the point of [lo, hi] nearest 0.
struct MseCandidate {
  AffineParams params;
  float hi;
};

PYG_QUANT_HOST_DEVICE MseCandidate mse_candidate(float lo, float hi, float shrink, float levels) {
  float center = 0.0f < lo ? lo : 0.0f;  // std::min(std::max(0, lo), hi), as torch.clamp
  center = hi < center ? hi : center;
  const float c_lo = center + shrink * (lo - center);
  const float c_hi = center + shrink * (hi - center);
  return {affine_params(c_lo, c_hi, levels), c_hi};
}

// The squared error of one element under candidate p, exact in float64 (a float32 square fits in 48 bits).
PYG_QUANT_HOST_DEVICE double squared_error(float x, const AffineParams& p, float levels) {
  const double e = static_cast<double>(fake_quantize_value(x, p, 0.5f, levels) - x);
  return e * e;
}

// The CPU kernel's rounding noise: the given tensor, U[0, 1) drawn here from `generator` (torch's default one when
// None, exactly what torch.rand(x.shape, generator=generator) draws), or none (round to nearest).  The CUDA kernels
// draw theirs inside the kernel from the generator's Philox state (fake_quantize_cuda.cu).
inline at::Tensor rounding_noise(const at::Tensor& x, const std::optional<at::Tensor>& noise, bool random_noise,
                                 std::optional<at::Generator> generator) {
  if (random_noise) return at::rand(x.sizes(), std::move(generator), x.options());
  return noise ? noise->contiguous() : at::Tensor();
}

// The ranges in use: the given ones, or x's own min / max per group (NaN propagated, as amin / amax do).
inline std::tuple<at::Tensor, at::Tensor> ranges_or_extrema(const at::Tensor& x, const std::optional<at::Tensor>& lo,
                                                            const std::optional<at::Tensor>& hi, int64_t dim) {
  if (lo.has_value()) return {lo->contiguous().reshape(-1), hi->contiguous().reshape(-1)};
  if (dim < 0) return {x.amin().reshape(1), x.amax().reshape(1)};
  return {x.amin(dim), x.amax(dim)};
}

}  // namespace pyg_quant
