#pragma once
// ema_range / ema_fake_quantize: a static range's training step (pyg_quant.qat's EMA min/max and MSE observers) as
// one op: the batch's range (its min/max, or the MSE-optimal clipping range of mse_range), the moving average
// stored + m·(batch − stored) in the observers' float32 steps, and (ema_fake_quantize) fake_quantize of x over the new
// range with narrow ranges collapsed (pyg_quant.quantization.affine.collapse_narrow_range).  A training step runs it
// for every static quantizer, and the same ops composed in Python cost more host time than their kernels.
// Composite (registered for CompositeImplicitAutograd): the range takes no gradient, x gets fake_quantize's.
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sub.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/amin.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/where.h>

#include <optional>
#include <tuple>
#include <vector>

#include "autograd.h"  // fake_quantize_op
#include "layout.h"    // kMinRangeWidth

namespace pyg_quant {

using MseRangeSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t,
                                                             at::ArrayRef<double>);

inline const c10::TypedOperatorHandle<MseRangeSignature>& mse_range_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyg_quant::mse_range", "").typed<MseRangeSignature>();
  return op;
}

// grid empty: the batch's min/max (per tensor for dim -1, else reduced over dim); else mse_range's search at
// grid_bits.  stored_lo / stored_hi: the stored 1-D range, which the batch's must match in size.
inline std::tuple<at::Tensor, at::Tensor> ema_range(const at::Tensor& x, const at::Tensor& stored_lo,
                                                    const at::Tensor& stored_hi, double momentum, int64_t dim,
                                                    at::ArrayRef<double> grid, int64_t grid_bits) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.numel() > 0, "ema_range: x must be a non-empty 2-D tensor");
  TORCH_CHECK_VALUE(dim >= -1 && dim <= 1, "ema_range: dim must be -1 (per tensor), 0 or 1, got ", dim);
  const at::Tensor x32 = x.detach().to(at::kFloat);
  at::Tensor lo, hi;
  if (!grid.empty()) {
    std::tie(lo, hi) = mse_range_op().call(x32, dim, grid_bits, grid);
  } else if (dim < 0) {
    std::tie(lo, hi) = at::aminmax(x32);
    lo = lo.view({1});
    hi = hi.view({1});
  } else {
    lo = x32.amin(dim);
    hi = x32.amax(dim);
  }
  TORCH_CHECK_VALUE(stored_lo.sizes() == lo.sizes() && stored_hi.sizes() == hi.sizes(), "ema_range: x has ",
                    lo.numel(), " ranges but ", stored_lo.numel(), " are stored");
  // Both ends at once (three launches, not six), the observers' own foreach steps.
  const std::vector<at::Tensor> stored{stored_lo, stored_hi};
  const std::vector<at::Tensor> moved =
      at::_foreach_add(stored, at::_foreach_mul(at::_foreach_sub({lo, hi}, stored), momentum));
  return {moved[0], moved[1]};
}

// (fake_quantize(x) over the new range, its clipping mask, the new range): the range as ema_range stores it, the
// fake quantization over it with ranges narrower than kMinRangeWidth collapsed to hi = lo.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ema_fake_quantize(
    const at::Tensor& x, const at::Tensor& stored_lo, const at::Tensor& stored_hi, double momentum, int64_t dim,
    at::ArrayRef<double> grid, int64_t grid_bits, int64_t bits, bool with_mask, bool random_noise,
    std::optional<at::Generator> generator) {
  auto [lo, hi] = ema_range(x, stored_lo, stored_hi, momentum, dim, grid, grid_bits);
  const at::Tensor used_hi = at::where(at::lt(at::sub(hi, lo), kMinRangeWidth), lo, hi);
  auto [out, inside] = fake_quantize_op().call(x.to(at::kFloat), lo, used_hi, bits, dim, std::nullopt, with_mask,
                                               random_noise, std::move(generator));
  return {out, inside, lo, hi};
}

}  // namespace pyg_quant
