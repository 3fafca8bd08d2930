#pragma once
// Argument checks of quant_mlp, shared by the CPU and CUDA kernels: every failure is a ValueError that names the
// argument (and the layer).
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "col_keys.h"
#include "layout.h"
#include "quantize_args.h"

namespace pyg_quant {

constexpr int64_t kQuantMlpInt32Max = 2147483647;

// The widths C_0 .. C_L of a chain whose input is a rows x cols matrix on `device` (row_scale: optional float32
// [rows], multiplied into each output row last; col_keys: optional int64 [2·C_L], the output's column keys, see
// ordered_key.h).  `input` names the input in the errors ("x", or "planes").
inline std::vector<int64_t> check_quant_mlp_layers(int64_t rows, int64_t cols, const c10::Device& device,
                                                   const char* input, at::TensorList weight_codes,
                                                   at::TensorList weight_lo, at::TensorList weight_scale,
                                                   at::TensorList weight_sums,
                                                   const c10::List<std::optional<at::Tensor>>& bias,
                                                   at::IntArrayRef act_bits, at::IntArrayRef weight_bits,
                                                   const c10::List<bool>& relu,
                                                   const std::optional<at::Tensor>& row_scale,
                                                   const std::optional<at::Tensor>& col_keys) {
  const int64_t layers = static_cast<int64_t>(weight_codes.size());
  TORCH_CHECK_VALUE(layers >= 1, "weight_codes must hold at least one layer");
  const auto same_length = [&](int64_t n, const char* name) {
    TORCH_CHECK_VALUE(n == layers, name, " has ", n, " entries but weight_codes has ", layers);
  };
  same_length(static_cast<int64_t>(weight_lo.size()), "weight_lo");
  same_length(static_cast<int64_t>(weight_scale.size()), "weight_scale");
  same_length(static_cast<int64_t>(weight_sums.size()), "weight_sums");
  same_length(static_cast<int64_t>(bias.size()), "bias");
  same_length(static_cast<int64_t>(act_bits.size()), "act_bits");
  same_length(static_cast<int64_t>(weight_bits.size()), "weight_bits");
  same_length(static_cast<int64_t>(relu.size()), "relu");
  std::vector<int64_t> widths{cols};
  TORCH_CHECK_VALUE(cols >= 1, input, " must have at least one column");
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& w = weight_codes[l];
    TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kByte, "weight_codes[", l,
                      "] must be a 2-D uint8 tensor [out, in], got ", w.scalar_type(), " with ", w.dim(),
                      " dimensions");
    TORCH_CHECK_VALUE(w.size(1) == widths.back(), "weight_codes[", l, "] has ", w.size(1),
                      " input channels but its input has ", widths.back(), " columns");
    TORCH_CHECK_VALUE(w.size(0) >= 1, "weight_codes[", l, "] must have at least one output channel");
    TORCH_CHECK_VALUE(w.device() == device, "weight_codes[", l, "] is on ", w.device(), " but ", input, " is on ",
                      device);
    const int64_t out = w.size(0);
    const auto per_channel = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
      TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == out && t.scalar_type() == dtype, name, "[", l, "] must be ",
                        dtype, " [", out, "], got ", t.scalar_type(), " ", t.sizes());
      TORCH_CHECK_VALUE(t.device() == device, name, "[", l, "] is on ", t.device(), " but ", input, " is on ", device);
    };
    per_channel(weight_lo[l], at::kFloat, "weight_lo");
    per_channel(weight_scale[l], at::kFloat, "weight_scale");
    per_channel(weight_sums[l], at::kLong, "weight_sums");
    const std::optional<at::Tensor> b = bias.get(l);
    if (b.has_value()) per_channel(*b, at::kFloat, "bias");
    TORCH_CHECK_VALUE(act_bits[l] >= 1 && act_bits[l] <= kMaxBits, "act_bits[", l, "] must be in 1..8, got ",
                      act_bits[l]);
    TORCH_CHECK_VALUE(weight_bits[l] >= 1 && weight_bits[l] <= kMaxBits, "weight_bits[", l, "] must be in 1..8, got ",
                      weight_bits[l]);
    const int64_t bound = widths.back() * ((int64_t{1} << act_bits[l]) - 1) * ((int64_t{1} << weight_bits[l]) - 1);
    TORCH_CHECK_VALUE(bound <= kQuantMlpInt32Max, "weight_codes[", l,
                      "]: in_channels·(2^act_bits − 1)·(2^weight_bits − 1) = ", bound,
                      " overflows int32 (in_channels=", widths.back(), ", act_bits=", act_bits[l],
                      ", weight_bits=", weight_bits[l], ")");
    widths.push_back(out);
  }
  if (row_scale.has_value()) {
    const at::Tensor& s = *row_scale;
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == rows && s.scalar_type() == at::kFloat,
                      "row_scale must be float32 [", rows, "] (one scale per row of ", input, "), got ",
                      s.scalar_type(), " ", s.sizes());
    TORCH_CHECK_VALUE(s.device() == device, "row_scale is on ", s.device(), " but ", input, " is on ", device);
  }
  check_col_keys(col_keys, widths.back(), device, "the output", input);
  return widths;
}

// The widths of quant_mlp's chain on a float32 x.
inline std::vector<int64_t> check_quant_mlp_args(const at::Tensor& x, at::TensorList weight_codes,
                                                 at::TensorList weight_lo, at::TensorList weight_scale,
                                                 at::TensorList weight_sums,
                                                 const c10::List<std::optional<at::Tensor>>& bias,
                                                 at::IntArrayRef act_bits, at::IntArrayRef weight_bits,
                                                 const c10::List<bool>& relu,
                                                 const std::optional<at::Tensor>& row_scale,
                                                 const std::optional<at::Tensor>& col_keys) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor, got ",
                    x.scalar_type(), " with ", x.dim(), " dimensions");
  return check_quant_mlp_layers(x.size(0), x.size(1), x.device(), "x", weight_codes, weight_lo, weight_scale,
                                weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
}

// The widths of quant_mlp_planes' chain on dequantize(planes, rows, cols, col_layout, lo, scale, dim): the planes
// and their ranges are checked first, so that the errors name planes, not the dequantized x.
inline std::vector<int64_t> check_quant_mlp_planes_args(const at::Tensor& planes, int64_t rows, int64_t cols,
                                                        bool col_layout, const at::Tensor& lo, const at::Tensor& scale,
                                                        int64_t dim, at::TensorList weight_codes,
                                                        at::TensorList weight_lo, at::TensorList weight_scale,
                                                        at::TensorList weight_sums,
                                                        const c10::List<std::optional<at::Tensor>>& bias,
                                                        at::IntArrayRef act_bits, at::IntArrayRef weight_bits,
                                                        const c10::List<bool>& relu,
                                                        const std::optional<at::Tensor>& row_scale,
                                                        const std::optional<at::Tensor>& col_keys) {
  check_unpack_shape(planes, rows, cols, col_layout);
  check_dequantize_ranges(planes, lo, scale, rows, cols, dim);
  return check_quant_mlp_layers(rows, cols, planes.device(), "planes", weight_codes, weight_lo, weight_scale,
                                weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
}

// The fixed output ranges of quant_mlp_codes / quant_mlp_planes_codes: the chain's output is quantized per column
// with out_lo / out_inv_scale (float32 [out_cols] on `device`, quantize_pack's lo and inv_scale) to out_bits.
inline void check_quant_mlp_out_codes(const at::Tensor& out_lo, const at::Tensor& out_inv_scale, int64_t out_bits,
                                      int64_t out_cols, const c10::Device& device, const char* input) {
  TORCH_CHECK_VALUE(out_bits >= 1 && out_bits <= kMaxBits, "out_bits must be in 1..8, got ", out_bits);
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&out_lo, "out_lo"},
                                std::pair<const at::Tensor*, const char*>{&out_inv_scale, "out_inv_scale"}}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == out_cols && t->scalar_type() == at::kFloat, name,
                      " must be float32 [", out_cols, "] (one range per output column), got ", t->scalar_type(), " ",
                      t->sizes());
    TORCH_CHECK_VALUE(t->device() == device, name, " is on ", t->device(), " but ", input, " is on ", device);
  }
}

}  // namespace pyg_quant
