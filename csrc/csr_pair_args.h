#pragma once
// csr_pair's argument checks and the one formula of an entry's value, shared by the CPU and CUDA kernels.
//
// csr_pair builds M = diag(row_scale) · (A + diag(diag)) and Mᵀ in CSR, where A[rows[e], cols[e]] += coef[e],
// coef[e] = keep[e] ? values[e] : 0 (values and keep default to ones): each row's entries in edge order, a row's
// diagonal entry (when diag is given) after its edges.  Both directions come from one call: a layer's float
// aggregation runs M in its forward and Mᵀ in its backward.
#include <ATen/core/Tensor.h>
#include <ATen/ops/to.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "macros.h"

namespace pyg_quant {

// (crow, col, val) of M, then of Mᵀ: int32 indices, values of the requested dtype.
using CsrPair = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The value of one entry of M: the edge's coefficient (or the diagonal term) times its M-row's scale.
template <typename scalar_t>
PYG_QUANT_HOST_DEVICE scalar_t csr_entry_value(scalar_t coef, const scalar_t* row_scale, int64_t m_row) {
  return row_scale != nullptr ? row_scale[m_row] * coef : coef;
}

// An edge's coefficient: 0 where keep drops it, else its value (1 without values).
template <typename scalar_t>
PYG_QUANT_HOST_DEVICE scalar_t csr_edge_coef(const scalar_t* values, const bool* keep, int64_t edge) {
  if (keep != nullptr && !keep[edge]) return scalar_t(0);
  return values != nullptr ? values[edge] : scalar_t(1);
}

// Shapes, dtypes and devices; the sizes must fit int32 indices (callers take torch's sort beyond).
inline void check_csr_pair_args(const at::Tensor& rows, const at::Tensor& cols, const std::optional<at::Tensor>& values,
                                const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& row_scale,
                                const std::optional<at::Tensor>& diag, int64_t num_rows, int64_t num_cols,
                                at::ScalarType dtype) {
  TORCH_CHECK_VALUE(rows.dim() == 1 && cols.dim() == 1 && rows.numel() == cols.numel(),
                    "csr_pair: rows and cols must be 1-D tensors of one length");
  TORCH_CHECK_TYPE((rows.scalar_type() == at::kLong || rows.scalar_type() == at::kInt) &&
                       cols.scalar_type() == rows.scalar_type(),
                   "csr_pair: rows and cols must both be int64 or both int32");
  TORCH_CHECK_VALUE(num_rows >= 0 && num_cols >= 0, "csr_pair: num_rows and num_cols must not be negative");
  TORCH_CHECK_VALUE(rows.numel() == 0 || (num_rows > 0 && num_cols > 0),
                    "csr_pair: edges need num_rows and num_cols to be positive");
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble, "csr_pair: dtype must be float32 or float64");
  const auto device = rows.device();
  TORCH_CHECK_VALUE(cols.device() == device, "csr_pair: rows and cols must be on one device");
  const int64_t edges = rows.numel();
  if (values) {
    TORCH_CHECK_VALUE(values->dim() == 1 && values->numel() == edges && values->device() == device,
                      "csr_pair: values must be one per edge, on the edges' device");
    TORCH_CHECK_TYPE(values->scalar_type() != at::kBool && !values->is_complex(),
                     "csr_pair: values must be real numbers");
  }
  if (keep) {
    TORCH_CHECK_VALUE(keep->dim() == 1 && keep->numel() == edges && keep->device() == device,
                      "csr_pair: keep must be one per edge, on the edges' device");
    TORCH_CHECK_TYPE(keep->scalar_type() == at::kBool, "csr_pair: keep must be a bool tensor");
  }
  for (const auto* vec : {&row_scale, &diag}) {
    if (!*vec) continue;
    TORCH_CHECK_VALUE((*vec)->dim() == 1 && (*vec)->numel() == num_rows && (*vec)->device() == device,
                      "csr_pair: row_scale and diag must hold one value per row, on the edges' device");
    TORCH_CHECK_TYPE((*vec)->is_floating_point(), "csr_pair: row_scale and diag must be floating point");
  }
  TORCH_CHECK_VALUE(!diag || num_rows == num_cols, "csr_pair: diag needs a square matrix");
  const int64_t nnz = edges + (diag ? num_rows : 0);
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(nnz < kMax && num_rows < kMax && num_cols < kMax,
                    "csr_pair: the matrix must fit int32 indices (fewer than 2^31 - 1 entries, rows and columns)");
}

// The optional operands as contiguous tensors of the matrix's dtype (undefined where absent), and keep contiguous.
struct CsrPairOperands {
  at::Tensor values, keep, row_scale, diag;
};

inline CsrPairOperands csr_pair_operands(const std::optional<at::Tensor>& values,
                                         const std::optional<at::Tensor>& keep,
                                         const std::optional<at::Tensor>& row_scale,
                                         const std::optional<at::Tensor>& diag, at::ScalarType dtype) {
  const auto as_dtype = [dtype](const std::optional<at::Tensor>& t) {
    return t ? t->to(dtype).contiguous() : at::Tensor();
  };
  return {as_dtype(values), keep ? keep->contiguous() : at::Tensor(), as_dtype(row_scale), as_dtype(diag)};
}

template <typename T>
inline const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

}  // namespace pyg_quant
