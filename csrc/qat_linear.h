#pragma once
// qat_linear: a QAT linear layer's training forward, fq(x) · fq(W)ᵀ + b with both operands fake-quantized per row
// over their own ranges (the default QConfig's input and weight quantizers), as one op with one autograd node: a
// training step runs it for every linear layer, and the composition's four nodes (two straight-through
// fake quantizations, the transpose, the addmm) cost more host time than its kernels.  The gradients are the
// composition's, computed as autograd computes them there (the same products, so the same bits).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ExpandUtils.h>  // at::sum_to
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <tuple>

#include "autograd.h"  // fake_quantize_op

namespace pyg_quant {

using QatLinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                      bool, std::optional<at::Generator>, int64_t, bool, std::optional<at::Generator>);

inline const c10::TypedOperatorHandle<QatLinearSignature>& qat_linear_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyg_quant::qat_linear", "").typed<QatLinearSignature>();
  return op;
}

inline at::Tensor fake_quantize_own_rows(const at::Tensor& x, int64_t bits, bool random_noise,
                                         std::optional<at::Generator> generator) {
  // Each row over its own range (dim 1, no lo / hi), no clipping mask: a dynamic range clips nothing.  (No aten::to
  // call for a float32 x: below autograd an op must not hand back its input, which a no-op `to` does.)
  const at::Tensor x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  return std::get<0>(fake_quantize_op().call(x32, std::nullopt, std::nullopt, bits, 1, std::nullopt, false,
                                             random_noise, std::move(generator)));
}

// (fq(x), fq(W)): the input first, then the weight, the order in which QATLinear's quantizers draw from a shared
// generator.
inline std::tuple<at::Tensor, at::Tensor> qat_linear_operands(const at::Tensor& x, const at::Tensor& weight,
                                                              int64_t x_bits, bool x_random,
                                                              std::optional<at::Generator> x_generator,
                                                              int64_t weight_bits, bool weight_random,
                                                              std::optional<at::Generator> weight_generator) {
  at::Tensor xq = fake_quantize_own_rows(x, x_bits, x_random, std::move(x_generator));
  at::Tensor wq = fake_quantize_own_rows(weight, weight_bits, weight_random, std::move(weight_generator));
  return {xq, wq};
}

// Every backend (registered for CompositeExplicitAutograd): the forward alone.
inline at::Tensor qat_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             int64_t x_bits, bool x_random, std::optional<at::Generator> x_generator,
                             int64_t weight_bits, bool weight_random, std::optional<at::Generator> weight_generator) {
  const auto [xq, wq] = qat_linear_operands(x, weight, x_bits, x_random, std::move(x_generator), weight_bits,
                                            weight_random, std::move(weight_generator));
  return at::linear(xq, wq, bias);
}

// fq(v) with the straight-through gradient to v (the identity): what a double backward through qat_linear
// differentiates, as the composition's fake_quantize nodes would give it.
class StraightThrough : public torch::autograd::Function<StraightThrough> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& v, const at::Tensor& quantized) {
    return quantized.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// The straight-through gradients: dL/dx = g · fq(W), dL/dW = gᵀ · fq(x), dL/db = Σ_rows g, in the operand order and
// layout that autograd's addmm backward uses for linear's (a column-major mat2 = fq(W)ᵀ takes (gᵀ · fq(x))ᵀ).  Under
// create_graph the operands are fq(x) and fq(W) with their straight-through gradients, so that a double backward
// reaches x and W as it does through the composition.
class QatLinearGrad : public torch::autograd::Function<QatLinearGrad> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, int64_t x_bits, bool x_random,
                            std::optional<at::Generator> x_generator, int64_t weight_bits, bool weight_random,
                            std::optional<at::Generator> weight_generator) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [xq, wq] = qat_linear_operands(x, weight, x_bits, x_random, std::move(x_generator), weight_bits,
                                        weight_random, std::move(weight_generator));
    at::Tensor out = at::linear(xq, wq, bias);
    ctx->save_for_backward({xq, wq});
    // The inputs, for their dtypes and a double backward's straight-through path (their values are not read: no
    // version check).
    ctx->saved_data["x"] = x;
    ctx->saved_data["weight"] = weight;
    if (bias.has_value() && bias->defined()) ctx->saved_data["bias_sizes"] = bias->sizes().vec();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& grad = grads[0];
    const auto saved = ctx->get_saved_variables();
    const at::Tensor x = ctx->saved_data["x"].toTensor(), weight = ctx->saved_data["weight"].toTensor();
    at::Tensor xq = saved[0], wq = saved[1];
    if (at::GradMode::is_enabled()) {  // create_graph: differentiable in x and W too
      xq = StraightThrough::apply(x.to(at::kFloat), xq);
      wq = StraightThrough::apply(weight.to(at::kFloat), wq);
    }
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(0)) grad_x = at::mm(grad, wq).to(x.scalar_type());
    if (ctx->needs_input_grad(1)) grad_w = at::mm(grad.t(), xq).to(weight.scalar_type());
    if (ctx->saved_data.count("bias_sizes") != 0 && ctx->needs_input_grad(2))
      grad_b = at::sum_to(grad, ctx->saved_data["bias_sizes"].toIntVector());
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

inline at::Tensor qat_linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, int64_t x_bits, bool x_random,
                                      std::optional<at::Generator> x_generator, int64_t weight_bits,
                                      bool weight_random, std::optional<at::Generator> weight_generator) {
  return QatLinearGrad::apply(x, weight, bias, x_bits, x_random, std::move(x_generator), weight_bits, weight_random,
                              std::move(weight_generator));
}

}  // namespace pyg_quant
