#pragma once
#include <optional>

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

namespace pyg_quant {

// A chain of QuantLinear bit layers on each row: per layer, per-row quantization of the input to act_bits[l]
// (quantize_steps.h), the exact int32 product with the uint8 weight codes [out, in], bitmm's affine epilogue
// (epilogue.h) with bias[l] and relu[l].  Equals quantize(h, act_bits, 1, "row") + bitmm_float bit for bit; with
// row_scale, each output row is then multiplied by its scale (one float32 multiply, as `out * row_scale[:, None]`).
// With col_keys (int64 [2·out_cols]), the column keys (ordered_key.h) of the output as stored are max-reduced into
// it, so that quantize_pack_ranges can take the output's per-column ranges without a pass of its own.
at::Tensor quant_mlp_cpu(const at::Tensor& x, at::TensorList weight_codes, at::TensorList weight_lo,
                         at::TensorList weight_scale, at::TensorList weight_sums,
                         const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                         at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                         const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys);

// quant_mlp of dequantize(planes, rows, cols, col_layout, lo, scale, dim): the chain on the values of a packed
// tensor (to_val's float32 steps), so a layer fed codes need not materialize them as floats first.
at::Tensor quant_mlp_planes_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                                at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                                at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys);

// quant_mlp with its first layer's input the codes of a packed tensor taken as they are (no dequantize, no
// requantize): row layout, ranges per row (dim 1) or one range (dim -1), at most act_bits[0] bits.  The first product
// is that of bitmm(x, W) (the codes' exact integer product, bitmm's affine epilogue with x's lo / scale and code sums),
// what a QAT linear layer runs on an input quantized already; the later layers as in quant_mlp.  CPU only: elsewhere
// the torch reference runs.
at::Tensor quant_mlp_quantized_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                   const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                   at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                                   at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                                   at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                   const std::optional<at::Tensor>& row_scale,
                                   const std::optional<at::Tensor>& col_keys);

// The chain's output quantized per column with fixed ranges (quantize_pack with out_lo / out_inv_scale [out_cols],
// column layout, nearest rounding), as that tensor's packed row codes (pack_row_codes; its planes are
// planes_from_row_codes of them).  The GPU kernel writes the codes as it stores the rows, so a layer with static
// (calibrated) output ranges needs no quantizer pass over its output.
at::Tensor quant_mlp_row_codes_cpu(const at::Tensor& x, at::TensorList weight_codes, at::TensorList weight_lo,
                                   at::TensorList weight_scale, at::TensorList weight_sums,
                                   const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                   at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                   const std::optional<at::Tensor>& row_scale, const at::Tensor& out_lo,
                                   const at::Tensor& out_inv_scale, int64_t out_bits);

// quant_mlp_row_codes of dequantize(planes, rows, cols, col_layout, lo, scale, dim).
at::Tensor quant_mlp_planes_row_codes_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                          const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                          at::TensorList weight_codes, at::TensorList weight_lo,
                                          at::TensorList weight_scale, at::TensorList weight_sums,
                                          const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                          at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                          const std::optional<at::Tensor>& row_scale, const at::Tensor& out_lo,
                                          const at::Tensor& out_inv_scale, int64_t out_bits);

}  // namespace pyg_quant
