#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

#include "../csr_pair_args.h"

namespace pyg_quant {

CsrPair csr_pair_cpu(const at::Tensor& rows, const at::Tensor& cols, const std::optional<at::Tensor>& values,
                     const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& row_scale,
                     const std::optional<at::Tensor>& diag, int64_t num_rows, int64_t num_cols, at::ScalarType dtype,
                     bool transpose);

}  // namespace pyg_quant
