#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

namespace pyg_quant {

at::Tensor bit_spmm_int_cuda(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                             const at::Tensor& res_ptr, const at::Tensor& res_col,
                             const std::optional<at::Tensor>& res_val, const at::Tensor& x_planes, int64_t rows,
                             int64_t cols, bool wide);

}  // namespace pyg_quant
