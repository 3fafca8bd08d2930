#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

#include "../degree_args.h"

namespace pyg_quant {

DegreeInvSqrt degree_inv_sqrt_cpu(const at::Tensor& dst, const std::optional<at::Tensor>& keep,
                                  const std::optional<at::Tensor>& count, const std::optional<at::Tensor>& diag,
                                  int64_t num_nodes);

}  // namespace pyg_quant
