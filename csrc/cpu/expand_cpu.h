#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

#include "expand_args.h"

namespace pyg_quant {

ExpandedTiles expand_tiles_cpu(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                               const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                               const std::optional<at::Tensor>& res_val, int64_t num_rows, int64_t num_cols,
                               int64_t planes);

ExpandedCsr expand_csr_cpu(const at::Tensor& tile_key, const at::Tensor& row_count, const at::Tensor& entry_col,
                           const std::optional<at::Tensor>& entry_val, const at::Tensor& res_row,
                           const at::Tensor& res_col, const std::optional<at::Tensor>& res_val, int64_t num_rows,
                           int64_t num_cols);

}  // namespace pyg_quant
