#pragma once
// quantize_pack_ranges composed from ATen ops and a backend's quantize_pack / packed_code_sums: the ranges are
// computed with exactly the float32 steps of pyg_quant.to_bit (amin, amax, (hi - lo) / (2^bits - 1),
// where(scale > 0, 1 / scale, 0)), so every backend's codes, ranges and sums agree bit for bit.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <optional>
#include <tuple>

#include "quantize_args.h"

namespace pyg_quant {

using QuantizedRanges = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // planes, lo, scale, code_sums

// lo / hi, when given, are the ranges' ends (keepdim shape) in place of x.amin(dim) / x.amax(dim).
template <typename Pack, typename Sums>
QuantizedRanges quantize_pack_ranges_composed(const at::Tensor& x_in, int64_t bits, int64_t dim, bool col_layout,
                                              const std::optional<at::Tensor>& noise, Pack pack, Sums sums,
                                              const std::optional<at::Tensor>& lo_given = std::nullopt,
                                              const std::optional<at::Tensor>& hi_given = std::nullopt) {
  check_quantize_ranges_args(x_in, bits, dim, noise);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor lo = lo_given ? *lo_given : x.amin(dim, /*keepdim=*/true);
  const at::Tensor hi = hi_given ? *hi_given : x.amax(dim, /*keepdim=*/true);
  const at::Tensor scale = (hi - lo) / at::full_like(hi, static_cast<double>((1 << bits) - 1));
  const at::Tensor inv = at::where(scale > 0, at::ones_like(scale) / scale, at::zeros_like(scale));
  at::Tensor planes = pack(x, lo, inv, bits, col_layout, noise);
  return {planes, lo.reshape(-1), scale.reshape(-1), sums(planes)};
}

// quantize_pack_ranges' result: the ranges above, then the row codes of the planes (a backend's pack_row_codes) when
// asked for, else an empty uint8 tensor.
using QuantizedRangesAndRowCodes = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline at::Tensor no_row_codes(const at::Tensor& like) { return at::empty({0, 0}, like.options().dtype(at::kByte)); }

template <typename PackRowCodes>
QuantizedRangesAndRowCodes with_row_codes(QuantizedRanges ranges, int64_t cols, bool col_layout, bool row_codes,
                                          PackRowCodes pack_row_codes) {
  const at::Tensor& planes = std::get<0>(ranges);
  at::Tensor codes = row_codes ? pack_row_codes(planes, cols, col_layout) : no_row_codes(planes);
  return {planes, std::get<1>(ranges), std::get<2>(ranges), std::get<3>(ranges), codes};
}

// The code sums of quantize_pack_ranges when asked for (code_sums), else an empty int64 tensor, not computed: for a
// caller that never reads them, such as the layers' outputs bound for bit_spmm (BitTensor.code_sums() makes them
// when asked).  `sums` is a backend's packed_code_sums.
inline at::Tensor no_code_sums(const at::Tensor& like) { return at::empty({0}, like.options().dtype(at::kLong)); }

template <typename Sums>
auto code_sums_if(bool code_sums, Sums sums) {
  return [code_sums, sums](const at::Tensor& planes) { return code_sums ? sums(planes) : no_code_sums(planes); };
}

}  // namespace pyg_quant
