#pragma once
// Argument checks of fake_quantize, mse_range and ema_range, shared by the CPU and CUDA kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "fake_quantize.h"  // kMaxMseCandidates
#include "layout.h"

namespace pyg_quant {

// Ranges of a 2-D x: one (dim -1), one a column (dim 0) or one a row (dim 1).
inline int64_t num_groups(const at::Tensor& x, int64_t dim) { return dim < 0 ? 1 : x.size(1 - dim); }

// fake_quantize's arguments: lo and hi given together (one value a range) or not at all.
inline void check_fake_quantize_args(const at::Tensor& x, const std::optional<at::Tensor>& lo,
                                     const std::optional<at::Tensor>& hi, int64_t bits, int64_t dim,
                                     const std::optional<at::Tensor>& noise, bool random_noise) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK_VALUE(x.numel() > 0, "x must not be empty");
  TORCH_CHECK_VALUE(bits >= 1 && bits <= kMaxBits, "bits must be in 1..8, got ", bits);
  TORCH_CHECK_VALUE(dim >= -1 && dim <= 1, "dim must be -1 (per tensor), 0 (per column) or 1 (per row), got ", dim);
  TORCH_CHECK_VALUE(lo.has_value() == hi.has_value(), "lo and hi must be given together (or both None)");
  for (const auto* range : {&lo, &hi}) {
    if (!range->has_value()) continue;
    const at::Tensor& t = **range;
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.device() == x.device() && t.numel() == num_groups(x, dim),
                      "lo and hi must be float32 on x's device with one value per group (", num_groups(x, dim),
                      "), got ", t.numel());
  }
  TORCH_CHECK_VALUE(!noise || (noise->sizes() == x.sizes() && noise->scalar_type() == at::kFloat &&
                               noise->device() == x.device()),
                    "noise must be float32 with x's shape and device");
  TORCH_CHECK_VALUE(!(noise && random_noise), "pass noise or random_noise=True, not both");
}

// mse_range's arguments; returns the grid's shrink factors as float32.
inline std::vector<float> check_mse_args(const at::Tensor& x, int64_t bits, int64_t dim, at::ArrayRef<double> grid) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK_VALUE(x.numel() > 0, "x must not be empty");
  TORCH_CHECK_VALUE(bits >= 1 && bits <= kMaxBits, "bits must be in 1..8, got ", bits);
  TORCH_CHECK_VALUE(dim >= -1 && dim <= 1, "dim must be -1 (per tensor), 0 (per column) or 1 (per row), got ", dim);
  TORCH_CHECK_VALUE(!grid.empty() && grid.size() <= static_cast<size_t>(kMaxMseCandidates),
                    "grid must hold 1 to ", kMaxMseCandidates, " shrink factors, got ", grid.size());
  std::vector<float> factors;
  for (double a : grid) {
    TORCH_CHECK_VALUE(a > 0.0 && a <= 1.0, "grid factors must lie in (0, 1], got ", a);
    factors.push_back(static_cast<float>(a));
  }
  return factors;
}

// ema_range's arguments (its grid, where not empty, is mse_range's): x a non-empty 2-D tensor, the stored range 1-D
// float32 on x's device, one value per group of x.
inline void check_ema_range_args(const at::Tensor& x, const at::Tensor& stored_lo, const at::Tensor& stored_hi,
                                 int64_t dim) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.numel() > 0, "ema_range: x must be a non-empty 2-D tensor");
  TORCH_CHECK_VALUE(dim >= -1 && dim <= 1, "ema_range: dim must be -1 (per tensor), 0 or 1, got ", dim);
  const int64_t groups = num_groups(x, dim);
  TORCH_CHECK_VALUE(stored_lo.dim() == 1 && stored_hi.dim() == 1, "ema_range: the stored range must be 1-D");
  TORCH_CHECK_VALUE(stored_lo.numel() == groups && stored_hi.numel() == groups, "ema_range: x has ", groups,
                    " ranges but ", stored_lo.numel(), " are stored");
  TORCH_CHECK_TYPE(stored_lo.scalar_type() == at::kFloat && stored_hi.scalar_type() == at::kFloat,
                   "ema_range: the stored range (stored_lo, stored_hi) must be float32");
  TORCH_CHECK_VALUE(stored_lo.device() == x.device() && stored_hi.device() == x.device(),
                    "ema_range: the stored range must be on x's device");
}

}  // namespace pyg_quant
