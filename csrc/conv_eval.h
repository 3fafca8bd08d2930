#pragma once
// gin_conv_eval and gcn_conv_eval: a QGINConv / QGCNConv layer's eval forward on a BitAdjacency as one op.  Each is
// the fixed sequence of the package's kernels that the layers would call one by one from Python (aggregation,
// fused MLP, quantizer), composed here so that a layer call costs one dispatch: the quantized layers' eager
// forward is bound by host time, not by its kernels.  Written once over the backends' kernel functions (the
// template arguments), registered for the CPU and CUDA in library.cpp; pyg_quant/ops/reference.py composes the
// same steps from the reference ops.
//
// Results: [out] with out_bits == 0, else [out, planes, lo, scale, code_sums, row_codes].  `out` is the layer's
// float32 output; the next five are quantize_pack_ranges of it (ranges per column, out_dim 0, in the column layout;
// per row, out_dim 1, in the row layout), as pyg_quant.quantization.quantize.quantize makes them: on CUDA the
// per-column codes come with their row codes (what the next aggregation gathers) and no code sums, elsewhere with
// code sums.  A list, so that a float output costs no placeholder tensors.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addcmul.h>

#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

#include "layout.h"
#include "quant_mlp_keys.h"  // MlpKernel, MlpPlanesKernel, new_col_keys
#ifdef WITH_CUDA
#include "cuda/scratch_cuda.h"
#endif

namespace pyg_quant {

// Tensors of one op from one block on a GPU (cuda/scratch_cuda.h: each allocation costs a layer call host time):
// the steps' tensors that the op does not hand back, or the parts of one result that live together; nothing on
// the CPU.  `pieces`: their sizes in bytes, which size the block (a tensor that does not fit is allocated apart).
class StepScratch {
 public:
  StepScratch(const at::Tensor& like, std::initializer_list<int64_t> pieces) {
#ifdef WITH_CUDA
    if (like.defined() && like.is_cuda()) scope_.emplace(scratch_bytes(pieces), like.options());
#endif
  }
  // Later steps allocate their own tensors (the op's results).
  void close() {
#ifdef WITH_CUDA
    scope_.reset();
#endif
  }

 private:
#ifdef WITH_CUDA
  std::optional<ScratchScope> scope_;
#endif
};

// Bytes of a float32 [rows, cols] matrix, and of its codes per column with their ranges and row codes (what
// quantize_output makes on CUDA; the empty sums take none).
inline int64_t float_bytes(int64_t rows, int64_t cols) { return rows * cols * 4; }
inline int64_t planes_bytes(int64_t rows, int64_t cols, int64_t bits) {
  return bits * padded_outer(cols) * packed_words(rows) * 4;
}
inline int64_t row_codes_bytes(int64_t rows, int64_t cols, int64_t bits) {
  return packed_words(rows) * kWordBits * row_code_bytes(cols, bits);
}

using SpmmAffineKernel = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                        const std::optional<at::Tensor>&, bool, int64_t, int64_t, bool,
                                        const std::optional<at::Tensor>&);
using RangesKernel = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> (*)(
    const at::Tensor&, int64_t, int64_t, bool, const std::optional<at::Tensor>&, bool,
    const std::optional<at::Tensor>&, bool);
// quantize_pack_ranges per column over stored column keys, a column holding NaN/inf over a NaN range
// (quantize_pack_stored_ranges_cpu / _cuda).
using StoredRangesKernel = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> (*)(
    const at::Tensor&, int64_t, const std::optional<at::Tensor>&, const at::Tensor&, bool, bool);
using DequantizeKernel = at::Tensor (*)(const at::Tensor&, int64_t, int64_t, bool, const at::Tensor&,
                                        const at::Tensor&, int64_t);
using ConvEvalResult = std::vector<at::Tensor>;

// The quantizer's call for codes with ranges along `dim` (0: per column, in the column layout), as
// pyg_quant.quantization.quantize.quantize makes them (see above).  `handed_back`: false for codes an op uses for
// its aggregation and drops, which take the op's step block (open around the call) and need no code sums; handed
// back, each part is its own allocation (a registered op's outputs may not share storage: torch.compile's rule).
template <RangesKernel Ranges>
ConvEvalResult quantize_output(const at::Tensor& out, int64_t bits, int64_t dim,
                               const std::optional<at::Tensor>& col_keys, bool handed_back = true) {
  TORCH_CHECK_VALUE(dim == 0 || dim == 1, "out_dim must be 0 or 1 when out_bits is set, got ", dim);
  const bool row_codes = out.is_cuda() && dim == 0;
  auto [planes, lo, scale, sums, codes] =
      Ranges(out, bits, dim, /*col_layout=*/dim == 0, std::nullopt, row_codes, col_keys, !row_codes && handed_back);
  return {out, planes, lo, scale, sums, codes};
}

template <SpmmAffineKernel Spmm, MlpKernel Mlp, RangesKernel Ranges>
ConvEvalResult gin_conv_eval(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                             const at::Tensor& res_ptr, const at::Tensor& res_col,
                             const std::optional<at::Tensor>& res_val, const at::Tensor& row_sums, bool wide,
                             const at::Tensor& x_planes, const std::optional<at::Tensor>& x_codes,
                             const at::Tensor& lo, const at::Tensor& scale, const at::Tensor& self_weight,
                             at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                             at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                             at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                             int64_t out_bits, int64_t out_dim) {
  TORCH_CHECK_VALUE(res_ptr.dim() == 1 && res_ptr.size(0) >= 1, "res_ptr must be int64[rows + 1]");
  TORCH_CHECK_VALUE(lo.dim() == 1, "lo must hold one range per column");
  const int64_t rows = res_ptr.size(0) - 1, cols = lo.size(0);
  const int64_t channels = weight_codes.empty() ? 0 : weight_codes.back().size(0);
  // The aggregation, and with a quantized output the MLP output's column keys: not handed back.  (The MLP's output
  // is handed back: its own allocation, made after the block closes.)
  StepScratch scratch(x_planes, {float_bytes(rows, cols), out_bits == 0 ? 0 : 2 * channels * 8});
  // (A + (1 + eps)·I)·X: the self term in the aggregation's epilogue
  const at::Tensor aggregated = Spmm(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x_planes, lo, scale,
                                     row_sums, self_weight, std::nullopt, std::nullopt, false, rows, cols, wide,
                                     x_codes);
  if (out_bits == 0) {
    scratch.close();
    return {Mlp(aggregated, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
                std::nullopt, std::nullopt)};
  }
  // On CUDA the MLP kernel hands the quantizer its output's column extrema, sparing it a pass over the output.
  std::optional<at::Tensor> keys;
  if (aggregated.is_cuda() && out_dim == 0) keys = new_col_keys(aggregated, weight_codes);
  scratch.close();
  const at::Tensor out = Mlp(aggregated, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits,
                             weight_bits, relu, std::nullopt, keys);
  return quantize_output<Ranges>(out, out_bits, out_dim, keys);
}

template <SpmmAffineKernel Spmm, MlpKernel Mlp, MlpPlanesKernel MlpPlanes, RangesKernel Ranges>
ConvEvalResult gcn_conv_eval(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                             const at::Tensor& res_ptr, const at::Tensor& res_col,
                             const std::optional<at::Tensor>& res_val, const at::Tensor& row_sums,
                             const at::Tensor& diag, const at::Tensor& deg_inv_sqrt,
                             const std::optional<at::Tensor>& bias, int64_t act_bits, bool wide, const at::Tensor& x,
                             const std::optional<at::Tensor>& x_lo, const std::optional<at::Tensor>& x_scale,
                             int64_t x_rows, at::TensorList weight_codes, at::TensorList weight_lo,
                             at::TensorList weight_scale, at::TensorList weight_sums,
                             const c10::List<std::optional<at::Tensor>>& weight_bias, at::IntArrayRef mlp_act_bits,
                             at::IntArrayRef weight_bits, const c10::List<bool>& relu, int64_t out_bits,
                             int64_t out_dim) {
  TORCH_CHECK_VALUE(res_ptr.dim() == 1 && res_ptr.size(0) >= 1, "res_ptr must be int64[rows + 1]");
  TORCH_CHECK_VALUE(!weight_codes.empty(), "weight_codes must hold the linear layer");
  TORCH_CHECK_VALUE(x_lo.has_value() == x_scale.has_value(), "x_lo and x_scale go together (codes of x)");
  const int64_t rows = res_ptr.size(0) - 1, channels = weight_codes.back().size(0);
  const bool cuda = x.is_cuda();
  // h = D^-1/2 (X W), its column keys and its codes: not handed back.
  StepScratch scratch(x, {2 * channels * 8, float_bytes(rows, channels), planes_bytes(rows, channels, act_bits),
                          channels * 4, channels * 4, row_codes_bytes(rows, channels, act_bits)});
  std::optional<at::Tensor> keys;
  if (cuda) keys = new_col_keys(x, weight_codes);
  // D^-1/2 (X W): the row scale is the MLP kernel's last multiply; codes of x (per column, column layout) are read
  // by the kernel itself.
  const at::Tensor h =
      x_lo.has_value()
          ? MlpPlanes(x, x_rows, x_lo->size(0), true, *x_lo, *x_scale, 0, weight_codes, weight_lo, weight_scale,
                      weight_sums, weight_bias, mlp_act_bits, weight_bits, relu, deg_inv_sqrt, keys)
          : Mlp(x, weight_codes, weight_lo, weight_scale, weight_sums, weight_bias, mlp_act_bits, weight_bits, relu,
                deg_inv_sqrt, keys);
  // h per column to act_bits; on CUDA with its row codes, which the aggregation gathers (its self term reads them)
  const ConvEvalResult codes = quantize_output<Ranges>(h, act_bits, 0, keys, /*handed_back=*/false);
  const std::optional<at::Tensor> gathered = cuda ? std::optional<at::Tensor>(codes[5]) : std::nullopt;
  scratch.close();
  // D^-1/2 Â (D^-1/2 X W) + b: the row scale and the bias in the aggregation's epilogue
  const at::Tensor out = Spmm(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, codes[1], codes[2], codes[3],
                              row_sums, diag, deg_inv_sqrt, bias, false, rows, channels, wide, gathered);
  if (out_bits == 0) return {out};
  return quantize_output<Ranges>(out, out_bits, out_dim, std::nullopt);
}

// qat_gcn_conv_eval and qat_gin_conv_eval: a converted QAT layer's eval forward on a BitAdjacency as one op, the
// steps of pyg_quant/qat/conv.py's bit path (hence its float32 roundings: the QAT layers add GCN's normalization and
// bias, and GIN's float self term, after the aggregation's rounding, as their training forward does; on codes of x
// the self term is the aggregation epilogue's).  The aggregation's quantizer reads `agg_keys` (its frozen stored
// range as column keys) where given, else each channel's own range; a channel whose values hold a NaN or inf takes
// a NaN range instead of the stored one, so that the NaN reaches the output with no host synchronization (the
// callers raise on the CPU).  A QGINConv on float features is qat_gin_conv_eval without agg_keys: the same steps.

template <SpmmAffineKernel Spmm, MlpKernel Mlp, MlpPlanesKernel MlpPlanes, RangesKernel Ranges,
          StoredRangesKernel StoredRanges>
at::Tensor qat_gcn_conv_eval(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                             const at::Tensor& res_ptr, const at::Tensor& res_col,
                             const std::optional<at::Tensor>& res_val, const at::Tensor& row_sums,
                             const at::Tensor& diag, const at::Tensor& deg_inv_sqrt,
                             const std::optional<at::Tensor>& bias, int64_t agg_bits, bool wide,
                             const std::optional<at::Tensor>& agg_keys, const at::Tensor& x,
                             const std::optional<at::Tensor>& x_lo, const std::optional<at::Tensor>& x_scale,
                             int64_t x_rows, int64_t x_cols, bool x_col_layout, int64_t x_dim,
                             at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                             at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& weight_bias,
                             at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu) {
  TORCH_CHECK_VALUE(res_ptr.dim() == 1 && res_ptr.size(0) >= 1, "res_ptr must be int64[rows + 1]");
  TORCH_CHECK_VALUE(!weight_codes.empty(), "weight_codes must hold the linear layer");
  TORCH_CHECK_VALUE(x_lo.has_value() == x_scale.has_value(), "x_lo and x_scale go together (codes of x)");
  const int64_t rows = res_ptr.size(0) - 1, channels = weight_codes.back().size(0);
  TORCH_CHECK_VALUE(!agg_keys.has_value() || agg_keys->numel() == 2 * channels,
                    "agg_keys must hold 2 keys a channel (", 2 * channels, "), got ", agg_keys->numel());
  const bool cuda = x.is_cuda();
  StepScratch scratch(x, {2 * channels * 8, float_bytes(rows, channels), planes_bytes(rows, channels, agg_bits),
                          channels * 4, channels * 4, row_codes_bytes(rows, channels, agg_bits)});
  // D^-1/2 (X W) and its column keys, from the fused MLP kernel (codes of x are read by the kernel itself)
  const at::Tensor keys = new_col_keys(x, weight_codes);
  const at::Tensor h =
      x_lo.has_value()
          ? MlpPlanes(x, x_rows, x_cols, x_col_layout, *x_lo, *x_scale, x_dim, weight_codes, weight_lo, weight_scale,
                      weight_sums, weight_bias, act_bits, weight_bits, relu, deg_inv_sqrt, keys)
          : Mlp(x, weight_codes, weight_lo, weight_scale, weight_sums, weight_bias, act_bits, weight_bits, relu,
                deg_inv_sqrt, keys);
  // (no code sums: the aggregation does not read them)
  auto [planes, lo, scale, sums, codes] = agg_keys.has_value()
                                              ? StoredRanges(h, agg_bits, keys, *agg_keys, cuda, false)
                                              : Ranges(h, agg_bits, 0, true, std::nullopt, cuda, keys, false);
  scratch.close();
  // · D^-1/2 and + b in the aggregation's epilogue: the same float32 steps, in the same order, as after it
  return Spmm(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, planes, lo, scale, row_sums, diag,
              deg_inv_sqrt, bias, false, rows, channels, wide, cuda ? std::optional<at::Tensor>(codes) : std::nullopt);
}

template <SpmmAffineKernel Spmm, MlpKernel Mlp, RangesKernel Ranges, StoredRangesKernel StoredRanges,
          DequantizeKernel Dequantize>
at::Tensor qat_gin_conv_eval(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                             const at::Tensor& res_ptr, const at::Tensor& res_col,
                             const std::optional<at::Tensor>& res_val, const at::Tensor& row_sums,
                             const std::optional<at::Tensor>& diag, bool wide, const at::Tensor& x,
                             const std::optional<at::Tensor>& x_lo, const std::optional<at::Tensor>& x_scale,
                             const std::optional<at::Tensor>& x_codes, int64_t x_cols, int64_t x_dim,
                             int64_t agg_bits,
                             const std::optional<at::Tensor>& agg_keys, const at::Tensor& one_plus_eps,
                             at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                             at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                             at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu) {
  TORCH_CHECK_VALUE(res_ptr.dim() == 1 && res_ptr.size(0) >= 1, "res_ptr must be int64[rows + 1]");
  TORCH_CHECK_VALUE(x_lo.has_value() == x_scale.has_value(), "x_lo and x_scale go together (codes of x)");
  const int64_t rows = res_ptr.size(0) - 1;
  const bool cuda = x.is_cuda();
  if (x_lo.has_value() && !diag.has_value()) {
    // Codes of x and no diagonal: (1 + eps)·to_val(x) is the epilogue's self term (A·x rounded, then a float32
    // multiply and add of (1 + eps)·(lo + scale·q)), with no decoded x.
    TORCH_CHECK_VALUE(x_dim == 0 || x_dim == -1, "x_dim must be 0 (per column) or -1 (per tensor), got ", x_dim);
    TORCH_CHECK_VALUE(x_lo->dim() == 1 && x_lo->numel() == (x_dim == 0 ? x_cols : 1),
                      "x_lo must hold one range a column (x_dim 0) or one for the tensor (x_dim -1)");
    TORCH_CHECK_VALUE(x.dim() == 3, "x must hold bit planes [bits, cols_pad, words] when x_lo is given");
    StepScratch scratch(x, {float_bytes(rows, x_cols)});
    const at::Tensor lo = x_dim == 0 ? *x_lo : x_lo->expand({x_cols}).contiguous();
    const at::Tensor scale = x_dim == 0 ? *x_scale : x_scale->expand({x_cols}).contiguous();
    const at::Tensor out = Spmm(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, lo, scale, row_sums,
                                one_plus_eps.reshape({-1}), std::nullopt, std::nullopt, false, rows, x_cols, wide,
                                x_codes);
    scratch.close();
    return Mlp(out, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
               std::nullopt, std::nullopt);
  }
  // Codes of x: their float values and the aggregation; float x: its codes and the aggregation.  Not handed back.
  const int64_t in_cols = x_lo.has_value() ? x_cols : x.dim() == 2 ? x.size(1) : 0;
  StepScratch scratch(x, {float_bytes(rows, in_cols),
                          x_lo.has_value() ? float_bytes(rows, in_cols) : planes_bytes(rows, in_cols, agg_bits),
                          x_lo.has_value() ? 0 : in_cols * 4, x_lo.has_value() ? 0 : in_cols * 4,
                          x_lo.has_value() ? 0 : 2 * in_cols * 8,
                          x_lo.has_value() ? 0 : row_codes_bytes(rows, in_cols, agg_bits)});
  at::Tensor planes, lo, scale, values;
  std::optional<at::Tensor> gathered;
  int64_t cols;
  if (x_lo.has_value()) {
    // codes of x (column layout, ranges per column or per tensor): the aggregation's operand as they are, and
    // their values the self term
    TORCH_CHECK_VALUE(x_dim == 0 || x_dim == -1, "x_dim must be 0 (per column) or -1 (per tensor), got ", x_dim);
    TORCH_CHECK_VALUE(x_lo->dim() == 1, "x_lo must be 1-D");
    TORCH_CHECK_VALUE(x.dim() == 3, "x must hold bit planes [bits, cols_pad, words] when x_lo is given");
    TORCH_CHECK_VALUE(x_lo->numel() == (x_dim == 0 ? x_cols : 1), "x_lo must hold one range a column (x_dim 0) or ",
                      "one for the tensor (x_dim -1), got ", x_lo->numel());
    cols = x_cols;
    planes = x;
    lo = x_dim == 0 ? *x_lo : x_lo->expand({cols}).contiguous();
    scale = x_dim == 0 ? *x_scale : x_scale->expand({cols}).contiguous();
    gathered = x_codes;
    values = Dequantize(x, rows, cols, true, *x_lo, *x_scale, x_dim);
  } else {
    TORCH_CHECK_VALUE(x.dim() == 2, "x must be float32 [rows, cols] without x_lo");
    cols = x.size(1);
    auto [p, l, s, sums, codes] = agg_keys.has_value()
                                      ? StoredRanges(x, agg_bits, std::nullopt, *agg_keys, cuda, false)
                                      : Ranges(x, agg_bits, 0, true, std::nullopt, cuda, std::nullopt, false);
    planes = p, lo = l, scale = s, values = x;
    if (cuda) gathered = codes;
  }
  at::Tensor out = Spmm(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, planes, lo, scale, row_sums, diag,
                        std::nullopt, std::nullopt, false, rows, cols, wide, gathered);
  // + (1 + eps)·x on the float values (in place: the aggregation's output is this op's own), then the MLP with its
  // biases and ReLUs
  out.addcmul_(one_plus_eps, values);
  scratch.close();
  return Mlp(out, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, std::nullopt,
             std::nullopt);
}

}  // namespace pyg_quant
