// csr_pair on the CPU: a counting sort per direction (row counts, their prefix sums, then the entries placed in edge
// order), linear in the entries where a comparison sort is not.
#include "csr_pair_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include <vector>

namespace pyg_quant {
namespace {

// One direction: keys (M's rows, or its columns for Mᵀ) give the CSR rows, `other` the CSR columns; `scale_by_key`
// says whether the key is M's row (whose scale an entry takes).
template <typename scalar_t, typename index_t>
void fill_direction(const index_t* keys, const index_t* other, int64_t edges, int64_t num_keys, bool with_diag,
                    const scalar_t* values, const bool* keep, const scalar_t* row_scale, const scalar_t* diag,
                    bool scale_by_key, int32_t* crow, int32_t* col, scalar_t* val) {
  std::fill(crow, crow + num_keys + 1, 0);
  for (int64_t e = 0; e < edges; ++e) ++crow[keys[e] + 1];
  if (with_diag)
    for (int64_t i = 0; i < num_keys; ++i) ++crow[i + 1];
  for (int64_t i = 0; i < num_keys; ++i) crow[i + 1] += crow[i];
  std::vector<int32_t> next(crow, crow + num_keys);
  for (int64_t e = 0; e < edges; ++e) {
    const int64_t key = keys[e], to = other[e];
    const int32_t p = next[key]++;
    col[p] = static_cast<int32_t>(to);
    val[p] = csr_entry_value(csr_edge_coef(values, keep, e), row_scale, scale_by_key ? key : to);
  }
  if (with_diag) {
    for (int64_t i = 0; i < num_keys; ++i) {
      const int32_t p = next[i]++;
      col[p] = static_cast<int32_t>(i);
      val[p] = csr_entry_value(diag[i], row_scale, i);
    }
  }
}

template <typename index_t>
void check_range(const index_t* index, int64_t edges, int64_t bound, const char* name) {
  for (int64_t e = 0; e < edges; ++e) {
    TORCH_CHECK_VALUE(index[e] >= 0 && index[e] < bound, "csr_pair: ", name, " holds an index out of [0, ", bound,
                      ")");
  }
}

}  // namespace

CsrPair csr_pair_cpu(const at::Tensor& rows_in, const at::Tensor& cols_in, const std::optional<at::Tensor>& values,
                     const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& row_scale,
                     const std::optional<at::Tensor>& diag, int64_t num_rows, int64_t num_cols,
                     at::ScalarType dtype, bool transpose) {
  check_csr_pair_args(rows_in, cols_in, values, keep, row_scale, diag, num_rows, num_cols, dtype);
  const at::Tensor rows = rows_in.contiguous(), cols = cols_in.contiguous();
  const CsrPairOperands ops = csr_pair_operands(values, keep, row_scale, diag, dtype);
  const int64_t edges = rows.numel(), nnz = edges + (diag ? num_rows : 0);
  const auto index_options = rows.options().dtype(at::kInt);
  at::Tensor crow_m = at::empty({num_rows + 1}, index_options), col_m = at::empty({nnz}, index_options);
  // Without the transpose its three tensors are empty.
  const int64_t t_rows = transpose ? num_cols + 1 : 0, t_nnz = transpose ? nnz : 0;
  at::Tensor crow_t = at::empty({t_rows}, index_options), col_t = at::empty({t_nnz}, index_options);
  at::Tensor val_m = at::empty({nnz}, rows.options().dtype(dtype)), val_t = at::empty({t_nnz}, val_m.options());
  AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "csr_pair_cpu", [&] {
    const index_t* r = rows.const_data_ptr<index_t>();
    const index_t* c = cols.const_data_ptr<index_t>();
    check_range(r, edges, num_rows, "rows");
    check_range(c, edges, num_cols, "cols");
    AT_DISPATCH_FLOATING_TYPES(dtype, "csr_pair_cpu", [&] {
      const scalar_t* v = data_or_null<scalar_t>(ops.values);
      const bool* k = data_or_null<bool>(ops.keep);
      const scalar_t* s = data_or_null<scalar_t>(ops.row_scale);
      const scalar_t* d = data_or_null<scalar_t>(ops.diag);
      fill_direction<scalar_t, index_t>(r, c, edges, num_rows, d != nullptr, v, k, s, d, true,
                                        crow_m.mutable_data_ptr<int32_t>(), col_m.mutable_data_ptr<int32_t>(),
                                        val_m.mutable_data_ptr<scalar_t>());
      if (!transpose) return;
      fill_direction<scalar_t, index_t>(c, r, edges, num_cols, d != nullptr, v, k, s, d, false,
                                        crow_t.mutable_data_ptr<int32_t>(), col_t.mutable_data_ptr<int32_t>(),
                                        val_t.mutable_data_ptr<scalar_t>());
    });
  });
  return {crow_m, col_m, val_m, crow_t, col_t, val_t};
}

}  // namespace pyg_quant
