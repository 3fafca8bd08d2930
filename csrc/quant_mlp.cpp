// Backend kernels of quant_mlp (a chain of QuantLinear bit layers in one op).
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/quant_mlp_cpu.h"
#ifdef WITH_CUDA
#include "cuda/quant_mlp_cuda.h"
#endif

namespace pyg_quant {
namespace {

// The kernels max-reduce the output's column keys into an optional buffer; the schemas stay functional (the
// "_keys" ops return a fresh buffer) because torch.compile's inductor cannot lower an optional mutable argument.
using MlpKernel = at::Tensor (*)(const at::Tensor&, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                 const c10::List<std::optional<at::Tensor>>&, at::IntArrayRef, at::IntArrayRef,
                                 const c10::List<bool>&, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&);
using MlpPlanesKernel = at::Tensor (*)(const at::Tensor&, int64_t, int64_t, bool, const at::Tensor&,
                                       const at::Tensor&, int64_t, at::TensorList, at::TensorList, at::TensorList,
                                       at::TensorList, const c10::List<std::optional<at::Tensor>>&, at::IntArrayRef,
                                       at::IntArrayRef, const c10::List<bool>&, const std::optional<at::Tensor>&,
                                       const std::optional<at::Tensor>&);

at::Tensor new_col_keys(const at::Tensor& like, at::TensorList weight_codes) {
  TORCH_CHECK_VALUE(!weight_codes.empty(), "weight_codes must hold at least one layer");
  return at::zeros({2 * weight_codes.back().size(0)}, like.options().dtype(at::kLong));
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

}  // namespace
}  // namespace pyg_quant

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  m.impl("quant_mlp", &pyg_quant::mlp<&pyg_quant::quant_mlp_cpu>);
  m.impl("quant_mlp_keys", &pyg_quant::mlp_keys<&pyg_quant::quant_mlp_cpu>);
  m.impl("quant_mlp_planes", &pyg_quant::mlp_planes<&pyg_quant::quant_mlp_planes_cpu>);
  m.impl("quant_mlp_planes_keys", &pyg_quant::mlp_planes_keys<&pyg_quant::quant_mlp_planes_cpu>);
  m.impl("quant_mlp_row_codes", &pyg_quant::quant_mlp_row_codes_cpu);
  m.impl("quant_mlp_planes_row_codes", &pyg_quant::quant_mlp_planes_row_codes_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("quant_mlp", &pyg_quant::mlp<&pyg_quant::quant_mlp_cuda>);
  m.impl("quant_mlp_keys", &pyg_quant::mlp_keys<&pyg_quant::quant_mlp_cuda>);
  m.impl("quant_mlp_planes", &pyg_quant::mlp_planes<&pyg_quant::quant_mlp_planes_cuda>);
  m.impl("quant_mlp_planes_keys", &pyg_quant::mlp_planes_keys<&pyg_quant::quant_mlp_planes_cuda>);
  m.impl("quant_mlp_row_codes", &pyg_quant::quant_mlp_row_codes_cuda);
  m.impl("quant_mlp_planes_row_codes", &pyg_quant::quant_mlp_planes_row_codes_cuda);
}
#endif
