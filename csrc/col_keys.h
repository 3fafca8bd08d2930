#pragma once
// The host side of column keys (the encoding: ordered_key.h): the checks of a col_keys argument, shared by
// quant_mlp's and quantize_pack_ranges' kernels, and their decoding into ranges.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <optional>
#include <utility>

#include "ordered_key.h"

namespace pyg_quant {

// A col_keys argument (ordered_key.h) of a kernel whose output or input has `cols` columns on `device`; `columns_of`
// and `input` name them in the errors.
inline void check_col_keys(const std::optional<at::Tensor>& col_keys, int64_t cols, const c10::Device& device,
                           const char* columns_of, const char* input) {
  if (!col_keys.has_value()) return;
  const at::Tensor& k = *col_keys;
  TORCH_CHECK_VALUE(k.scalar_type() == at::kLong && k.dim() == 1 && k.size(0) == 2 * cols, "col_keys must be int64 [",
                    2 * cols, "] (two keys per column of ", columns_of, "), got ", k.scalar_type(), " ", k.sizes());
  TORCH_CHECK_VALUE(k.device() == device, "col_keys is on ", k.device(), " but ", input, " is on ", device);
  TORCH_CHECK_VALUE(k.is_contiguous(), "col_keys must be contiguous");
}

// The per-column extrema that CPU column keys (checked: contiguous) describe, as amin(0) / amax(0) would give them
// ([1, cols] float32; a NaN in a column makes both of its ends NaN).  The CUDA quantizer decodes its keys in its own
// kernel.
inline std::pair<at::Tensor, at::Tensor> extrema_from_col_keys(const at::Tensor& col_keys) {
  TORCH_INTERNAL_ASSERT(col_keys.device().is_cpu() && col_keys.is_contiguous());
  const int64_t cols = col_keys.size(0) / 2;
  at::Tensor lo = at::empty({1, cols}, col_keys.options().dtype(at::kFloat)), hi = at::empty_like(lo);
  const int64_t* k = col_keys.data_ptr<int64_t>();
  float *lp = lo.data_ptr<float>(), *hp = hi.data_ptr<float>();
  for (int64_t c = 0; c < cols; ++c) {
    column_extrema(static_cast<uint64_t>(k[c]), static_cast<uint64_t>(k[cols + c]), lp[c], hp[c]);
  }
  return {lo, hi};
}

}  // namespace pyg_quant
