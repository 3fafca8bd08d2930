#pragma once
#include <ATen/core/Tensor.h>

namespace pyg_quant {

// A·y for a sparse CSR A [M, N] of float32 values and a dense float32 y [N, F], as a dense [M, F].
at::Tensor csr_product_cuda(const at::Tensor& y, const at::Tensor& adj);

}  // namespace pyg_quant
