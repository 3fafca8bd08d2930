#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace pyg_quant {

std::tuple<at::Tensor, at::Tensor> fake_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& lo,
                                                      const std::optional<at::Tensor>& hi, int64_t bits, int64_t dim,
                                                      const std::optional<at::Tensor>& noise, bool with_mask,
                                                      bool random_noise, std::optional<at::Generator> generator);
std::tuple<at::Tensor, at::Tensor> mse_range_cuda(const at::Tensor& x, int64_t dim, int64_t bits,
                                                  at::ArrayRef<double> grid);
std::tuple<at::Tensor, at::Tensor, at::Tensor> ema_range_cuda(const at::Tensor& x, const at::Tensor& stored_lo,
                                                              const at::Tensor& stored_hi, double momentum,
                                                              int64_t dim, at::ArrayRef<double> grid,
                                                              int64_t grid_bits);

}  // namespace pyg_quant
