#pragma once
// quant_mlp's registered faces: the kernels max-reduce the output's column keys into an optional buffer, but the
// schemas stay functional (the "_keys" ops return a fresh buffer) because torch.compile's inductor cannot lower an
// optional mutable argument.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <optional>
#include <tuple>

#ifdef WITH_CUDA
#include "cuda/quantize_cuda.h"  // zeros_cuda
#endif

namespace pyg_quant {

using MlpKernel = at::Tensor (*)(const at::Tensor&, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                 const c10::List<std::optional<at::Tensor>>&, at::IntArrayRef, at::IntArrayRef,
                                 const c10::List<bool>&, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&);
using MlpPlanesKernel = at::Tensor (*)(const at::Tensor&, int64_t, int64_t, bool, const at::Tensor&,
                                       const at::Tensor&, int64_t, at::TensorList, at::TensorList, at::TensorList,
                                       at::TensorList, const c10::List<std::optional<at::Tensor>>&, at::IntArrayRef,
                                       at::IntArrayRef, const c10::List<bool>&, const std::optional<at::Tensor>&,
                                       const std::optional<at::Tensor>&);

inline at::Tensor new_col_keys(const at::Tensor& like, at::TensorList weight_codes) {
  TORCH_CHECK_VALUE(!weight_codes.empty(), "weight_codes must hold at least one layer");
  const int64_t numel = 2 * weight_codes.back().size(0);
#ifdef WITH_CUDA
  if (like.is_cuda()) return zeros_cuda(numel, like.options().dtype(at::kLong));
#endif
  return at::zeros({numel}, like.options().dtype(at::kLong));
}

template <MlpKernel Kernel>
at::Tensor mlp(const at::Tensor& x, at::TensorList weight_codes, at::TensorList weight_lo,
               at::TensorList weight_scale, at::TensorList weight_sums,
               const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
               at::IntArrayRef weight_bits, const c10::List<bool>& relu, const std::optional<at::Tensor>& row_scale) {
  return Kernel(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale,
                std::nullopt);
}

template <MlpKernel Kernel>
std::tuple<at::Tensor, at::Tensor> mlp_keys(const at::Tensor& x, at::TensorList weight_codes,
                                            at::TensorList weight_lo, at::TensorList weight_scale,
                                            at::TensorList weight_sums,
                                            const c10::List<std::optional<at::Tensor>>& bias,
                                            at::IntArrayRef act_bits, at::IntArrayRef weight_bits,
                                            const c10::List<bool>& relu,
                                            const std::optional<at::Tensor>& row_scale) {
  at::Tensor keys = new_col_keys(x, weight_codes);
  at::Tensor out = Kernel(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits, relu,
                          row_scale, keys);
  return {out, keys};
}

template <MlpPlanesKernel Kernel>
at::Tensor mlp_planes(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout, const at::Tensor& lo,
                      const at::Tensor& scale, int64_t dim, at::TensorList weight_codes, at::TensorList weight_lo,
                      at::TensorList weight_scale, at::TensorList weight_sums,
                      const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                      at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                      const std::optional<at::Tensor>& row_scale) {
  return Kernel(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale, weight_sums,
                bias, act_bits, weight_bits, relu, row_scale, std::nullopt);
}

template <MlpPlanesKernel Kernel>
std::tuple<at::Tensor, at::Tensor> mlp_planes_keys(const at::Tensor& planes, int64_t rows, int64_t cols,
                                                   bool col_layout, const at::Tensor& lo, const at::Tensor& scale,
                                                   int64_t dim, at::TensorList weight_codes,
                                                   at::TensorList weight_lo, at::TensorList weight_scale,
                                                   at::TensorList weight_sums,
                                                   const c10::List<std::optional<at::Tensor>>& bias,
                                                   at::IntArrayRef act_bits, at::IntArrayRef weight_bits,
                                                   const c10::List<bool>& relu,
                                                   const std::optional<at::Tensor>& row_scale) {
  at::Tensor keys = new_col_keys(planes, weight_codes);
  at::Tensor out = Kernel(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale,
                          weight_sums, bias, act_bits, weight_bits, relu, row_scale, keys);
  return {out, keys};
}

}  // namespace pyg_quant
