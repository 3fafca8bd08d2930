#pragma once
// ema_range / ema_fake_quantize: a static range's training step (pyg_quant.qat's EMA min/max and MSE observers) as
// one op: the batch's range (its min/max, or the MSE-optimal clipping range of mse_range), the moving average
// stored + m·(batch − stored) in the observers' float32 steps, the hi that fake quantization uses (hi = lo where the
// range is narrower than kMinRangeWidth: pyg_quant.quantization.affine.collapse_narrow_range), and
// (ema_fake_quantize) fake_quantize of x over it.  A training step runs it for every static quantizer, and the same
// ops composed in Python cost more host time than their kernels.
// ema_range has a kernel per backend (CUDA: csrc/cuda/fake_quantize_cuda.cu, one to four launches instead of the ten
// of the composition below, which is the CPU's); ema_fake_quantize is composite (CompositeImplicitAutograd): the
// range takes no gradient, x gets fake_quantize's.
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
#include "fake_quantize_args.h"  // check_ema_range_args
#include "layout.h"    // kMinRangeWidth

namespace pyg_quant {

using MseRangeSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t,
                                                             at::ArrayRef<double>);

inline const c10::TypedOperatorHandle<MseRangeSignature>& mse_range_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyg_quant::mse_range", "").typed<MseRangeSignature>();
  return op;
}

// (lo, hi, used_hi): the new range and the hi that fake quantization uses.  grid empty: the batch's min/max (per tensor
// for dim -1, else reduced over dim); else mse_range's search at grid_bits.  stored_lo / stored_hi: the stored 1-D
// range, which the batch's must match in size.  The CPU's kernel; the CUDA kernel computes the same float32 steps.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> ema_range_cpu(const at::Tensor& x, const at::Tensor& stored_lo,
                                                                    const at::Tensor& stored_hi, double momentum,
                                                                    int64_t dim, at::ArrayRef<double> grid,
                                                                    int64_t grid_bits) {
  check_ema_range_args(x, stored_lo, stored_hi, dim);
  const at::Tensor x32 = x.to(at::kFloat);
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
  // Both ends at once (three launches, not six), the observers' own foreach steps.
  const std::vector<at::Tensor> stored{stored_lo, stored_hi};
  const std::vector<at::Tensor> moved =
      at::_foreach_add(stored, at::_foreach_mul(at::_foreach_sub({lo, hi}, stored), momentum));
  const at::Tensor used_hi = at::where(at::lt(at::sub(moved[1], moved[0]), kMinRangeWidth), moved[0], moved[1]);
  return {moved[0], moved[1], used_hi};
}

using EmaRangeSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                         const at::Tensor&, double, int64_t,
                                                                         at::ArrayRef<double>, int64_t);

inline const c10::TypedOperatorHandle<EmaRangeSignature>& ema_range_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyg_quant::ema_range", "").typed<EmaRangeSignature>();
  return op;
}

// (fake_quantize(x) over the new range, its clipping mask, the new range): the range as ema_range stores it, the
// fake quantization over its used_hi.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ema_fake_quantize(
    const at::Tensor& x, const at::Tensor& stored_lo, const at::Tensor& stored_hi, double momentum, int64_t dim,
    at::ArrayRef<double> grid, int64_t grid_bits, int64_t bits, bool with_mask, bool random_noise,
    std::optional<at::Generator> generator) {
  // x detached: the range takes no gradient (ema_range has no autograd kernel).
  auto [lo, hi, used_hi] = ema_range_op().call(x.detach(), stored_lo, stored_hi, momentum, dim, grid, grid_bits);
  auto [out, inside] = fake_quantize_op().call(x.to(at::kFloat), lo, used_hi, bits, dim, std::nullopt, with_mask,
                                               random_noise, std::move(generator));
  return {out, inside, lo, hi};
}

}  // namespace pyg_quant
