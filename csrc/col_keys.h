#pragma once
// The host side of column keys (the encoding: ordered_key.h): the checks of a col_keys argument, shared by
// quant_mlp's and quantize_pack_ranges' kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "ordered_key.h"

namespace pyg_quant {

// A col_keys argument (ordered_key.h) of a kernel whose output or input has `cols` columns on `device`; `columns_of`
// and `input` name them in the errors.
inline void check_col_keys(const std::optional<at::Tensor>& col_keys, int64_t cols, const c10::Device& device,
                           const char* columns_of, const char* input) {
  if (!col_keys.has_value()) return;
  const at::Tensor& k = *col_keys;
  TORCH_CHECK_VALUE(k.scalar_type() == at::kLong && k.dim() == 1 && k.size(0) == 2 * cols, "col_keys must be int64 [",
                    2 * cols, "] (two keys per column of ", columns_of, "), got ", k.scalar_type(), " ", k.sizes());
  TORCH_CHECK_VALUE(k.device() == device, "col_keys is on ", k.device(), " but ", input, " is on ", device);
  TORCH_CHECK_VALUE(k.is_contiguous(), "col_keys must be contiguous");
}

}  // namespace pyg_quant
