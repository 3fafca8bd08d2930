#pragma once
// qat_linear: a QAT linear layer's training forward, fq(x) · fq(W)ᵀ + b with both operands fake-quantized per row
// over their own ranges (the default QConfig's input and weight quantizers), as one op: a training step runs it for
// every linear layer, and its Python composition cost more host time than its kernels.  Composite (registered for
// CompositeImplicitAutograd): autograd and torch.compile see fake_quantize's own straight-through gradient and
// linear's, so the values and gradients are those of the composition, bit for bit.
#include <ATen/ops/linear.h>

#include <optional>
#include <tuple>

#include "autograd.h"  // fake_quantize_op

namespace pyg_quant {

inline at::Tensor fake_quantize_own_rows(const at::Tensor& x, int64_t bits, bool random_noise,
                                         std::optional<at::Generator> generator) {
  // Each row over its own range (dim 1, no lo / hi), no clipping mask: a dynamic range clips nothing.
  return std::get<0>(fake_quantize_op().call(x.to(at::kFloat), std::nullopt, std::nullopt, bits, 1, std::nullopt,
                                             false, random_noise, std::move(generator)));
}

// The input first, then the weight: the order in which QATLinear's quantizers draw from a shared generator.
inline at::Tensor qat_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             int64_t x_bits, bool x_random, std::optional<at::Generator> x_generator,
                             int64_t weight_bits, bool weight_random, std::optional<at::Generator> weight_generator) {
  const at::Tensor xq = fake_quantize_own_rows(x, x_bits, x_random, std::move(x_generator));
  const at::Tensor wq = fake_quantize_own_rows(weight, weight_bits, weight_random, std::move(weight_generator));
  return at::linear(xq, wq, bias);
}

}  // namespace pyg_quant
