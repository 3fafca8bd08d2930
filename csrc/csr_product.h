#pragma once
// csr_product: A·y for a constant sparse CSR matrix A, with the gradient Aᵀ·dY to y from Aᵀ prebuilt in CSR
// (autograd's own backward of a CSR product transposes and coalesces A at every call); without Aᵀ, a product that
// takes no gradient (the float layers' eval forward).  Its autograd node is C++: a training step runs the product
// once per layer and its backward once more, and a Python autograd.Function costs host time in both.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/autograd/custom_function.h>
#ifdef WITH_CUDA
#include "cuda/csr_product_cuda.h"
#endif

namespace pyg_quant {

using CsrProductSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

inline const c10::TypedOperatorHandle<CsrProductSignature>& csr_product_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyg_quant::csr_product", "").typed<CsrProductSignature>();
  return op;
}

// Every backend (registered for CompositeExplicitAutograd): one sparse-dense product, float32 on CUDA by our kernel
// (csr_product_cuda.cu: one launch, where torch's takes cuSPARSE's three and a buffer), anything else by torch's.
inline at::Tensor csr_product(const at::Tensor& y, const at::Tensor& adj, const std::optional<at::Tensor>& adj_t) {
  TORCH_CHECK_VALUE(adj.layout() == at::kSparseCsr && (!adj_t || adj_t->layout() == at::kSparseCsr),
                    "csr_product: adj and adj_t must be sparse CSR matrices");
  TORCH_CHECK_VALUE(y.dim() == 2 && y.layout() == at::kStrided, "csr_product: y must be a dense 2-D tensor");
  TORCH_CHECK_VALUE(adj.dim() == 2 && adj.size(1) == y.size(0) &&
                        (!adj_t || (adj_t->dim() == 2 && adj_t->size(0) == y.size(0) && adj_t->size(1) == adj.size(0))),
                    "csr_product: adj must be [M, N] with N = y.size(0), adj_t its transpose [N, M]");
#ifdef WITH_CUDA
  if (y.is_cuda() && adj.device() == y.device() && y.scalar_type() == at::kFloat &&
      adj.scalar_type() == at::kFloat)
    return csr_product_cuda(y, adj);
#endif
  return at::mm(adj, y);
}

class CsrProductGrad : public torch::autograd::Function<CsrProductGrad> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& adj,
                            const std::optional<at::Tensor>& adj_t) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Constants of the graph (never edited in place), kept as they are: no version check needed.
    ctx->saved_data["adj"] = adj;
    ctx->saved_data["adj_t"] = *adj_t;
    return csr_product_op().call(y, adj, adj_t);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The op itself, through the dispatcher: differentiable again (double backward).
    const at::Tensor grad = csr_product_op().call(grads[0], ctx->saved_data["adj_t"].toTensor(),
                                                  std::optional<at::Tensor>(ctx->saved_data["adj"].toTensor()));
    return {grad, at::Tensor(), at::Tensor()};
  }
};

inline at::Tensor csr_product_autograd(const at::Tensor& y, const at::Tensor& adj,
                                       const std::optional<at::Tensor>& adj_t) {
  if (!adj_t.has_value()) {
    TORCH_CHECK_VALUE(!(y.requires_grad() && at::GradMode::is_enabled()),
                      "csr_product: y requires a gradient, which needs adj_t (Aᵀ in CSR)");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return csr_product_op().call(y, adj, adj_t);
  }
  return CsrProductGrad::apply(y, adj, adj_t);
}

}  // namespace pyg_quant
