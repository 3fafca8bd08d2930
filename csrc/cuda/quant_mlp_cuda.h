#pragma once
#include <optional>

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

namespace pyg_quant {

// quant_mlp in one launch (see quant_mlp_cuda.cu): widths up to kQuantMlpMaxWidth per layer, up to
// kQuantMlpMaxLayers layers, every layer's weight codes in one block's shared memory.
constexpr int64_t kQuantMlpMaxWidth = 256;
constexpr int64_t kQuantMlpMaxLayers = 8;

at::Tensor quant_mlp_cuda(const at::Tensor& x, at::TensorList weight_codes, at::TensorList weight_lo,
                          at::TensorList weight_scale, at::TensorList weight_sums,
                          const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                          at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                          const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys);

// quant_mlp of dequantize(planes, ...) in the same launch: the first layer decodes the codes itself.
at::Tensor quant_mlp_planes_cuda(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                 const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                 at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                                 at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                                 at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                 const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys);

// quant_mlp_row_codes_cpu's row codes in the same launch: the kernel quantizes the rows it computes with the fixed
// ranges and stores their packed row codes instead of the floats.
at::Tensor quant_mlp_row_codes_cuda(const at::Tensor& x, at::TensorList weight_codes, at::TensorList weight_lo,
                                   at::TensorList weight_scale, at::TensorList weight_sums,
                                   const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                   at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                   const std::optional<at::Tensor>& row_scale, const at::Tensor& out_lo,
                                   const at::Tensor& out_inv_scale, int64_t out_bits);

// quant_mlp_row_codes of dequantize(planes, rows, cols, col_layout, lo, scale, dim).
at::Tensor quant_mlp_planes_row_codes_cuda(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                          const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                          at::TensorList weight_codes, at::TensorList weight_lo,
                                          at::TensorList weight_scale, at::TensorList weight_sums,
                                          const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                          at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                          const std::optional<at::Tensor>& row_scale, const at::Tensor& out_lo,
                                          const at::Tensor& out_inv_scale, int64_t out_bits);

}  // namespace pyg_quant
