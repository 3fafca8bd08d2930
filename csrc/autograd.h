#pragma once
// Autograd kernels of the ops that take a gradient, in C++: a quantization-aware training step calls fake_quantize
// a few times a layer, and a Python autograd.Function around it cost more host time than the op itself.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mul.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <tuple>

namespace pyg_quant {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The fake_quantize op as the dispatcher calls it (the autograd kernel below it, composite ops above it).
using FakeQuantizeSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, int64_t,
    const std::optional<at::Tensor>&, bool, bool, std::optional<at::Generator>);

inline const c10::TypedOperatorHandle<FakeQuantizeSignature>& fake_quantize_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pyg_quant::fake_quantize", "")
                             .typed<FakeQuantizeSignature>();
  return op;
}

// fake_quantize's gradient to x: the straight-through estimator, zeroed where the value was clipped when with_mask
// (the op's second result is then that mask), else passed through.  The range and the noise take no gradient.
class FakeQuantizeGrad : public torch::autograd::Function<FakeQuantizeGrad> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& lo,
                               const std::optional<at::Tensor>& hi, int64_t bits, int64_t dim,
                               const std::optional<at::Tensor>& noise, bool with_mask, bool random_noise,
                               std::optional<at::Generator> generator) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, inside] =
        fake_quantize_op().call(x, lo, hi, bits, dim, noise, with_mask, random_noise, std::move(generator));
    ctx->saved_data["with_mask"] = with_mask;
    if (with_mask) ctx->save_for_backward({inside});
    ctx->mark_non_differentiable({inside});
    ctx->set_materialize_grads(false);  // the mask's gradient stays undefined (no zero tensor a call)
    return {out, inside};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0];
    if (ctx->saved_data["with_mask"].toBool() && grad.defined()) grad = at::mul(grad, ctx->get_saved_variables()[0]);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

inline std::tuple<at::Tensor, at::Tensor> fake_quantize_autograd(
    const at::Tensor& x, const std::optional<at::Tensor>& lo, const std::optional<at::Tensor>& hi, int64_t bits,
    int64_t dim, const std::optional<at::Tensor>& noise, bool with_mask, bool random_noise,
    std::optional<at::Generator> generator) {
  auto results = FakeQuantizeGrad::apply(x, lo, hi, bits, dim, noise, with_mask, random_noise, std::move(generator));
  return {results[0], results[1]};
}

}  // namespace pyg_quant
