#pragma once
#include <ATen/core/Tensor.h>
#include <tuple>

namespace pyg_quant {

// (tile_key, row_count, entry_col, entry_val, res_row, res_col, res_sum, row_sums); see tile_plan_cpu.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
tile_plan_cpu(const at::Tensor& keys, const at::Tensor& sums, int64_t num_rows, int64_t num_cols,
              int64_t min_tile_nnz, int64_t planes);

}  // namespace pyg_quant
