#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

namespace pyg_quant {

at::Tensor bit_spmm_int_cpu(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                            const at::Tensor& res_ptr, const at::Tensor& res_col,
                            const std::optional<at::Tensor>& res_val, const at::Tensor& x_planes, int64_t rows,
                            int64_t cols, bool wide, const std::optional<at::Tensor>& x_codes);

at::Tensor bit_spmm_affine_cpu(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                                const at::Tensor& res_ptr, const at::Tensor& res_col,
                                const std::optional<at::Tensor>& res_val, const at::Tensor& x_planes,
                                const at::Tensor& lo, const at::Tensor& scale, const at::Tensor& row_sums,
                                const std::optional<at::Tensor>& self_weight,
                                const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& bias,
                                bool relu, int64_t rows, int64_t cols, bool wide, const std::optional<at::Tensor>& x_codes);

}  // namespace pyg_quant
