// csr_pair on the GPU: per direction one stable radix sort of (key, entry id) over only the bits a key needs (two
// 8-bit passes for up to 65,536 rows, where a sort of whole int32 keys takes four), then one kernel that writes the
// row pointers from the sorted keys and gathers each entry's column and value.  One op: the host issues the two
// sorts and three kernels from C++.
#include "csr_pair_cuda.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/cub.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

namespace pyg_quant {
namespace {

constexpr int kThreads = 256;

int64_t blocks_for(int64_t n) { return std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)); }

__device__ __forceinline__ int32_t clamp_index(int64_t index, int64_t bound) {
  return static_cast<int32_t>(index < 0 ? 0 : (index >= bound ? bound - 1 : index));
}

// Sort keys for both directions (M's rows, M's columns) and the entry ids: edge e, then diagonal entry i at edges + i.
template <typename index_t>
__global__ void csr_keys_kernel(const index_t* __restrict__ rows, const index_t* __restrict__ cols, int64_t edges,
                                int64_t nnz, int64_t num_rows, int64_t num_cols, int32_t* __restrict__ keys_m,
                                int32_t* __restrict__ keys_t, int32_t* __restrict__ ids) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nnz;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t r, c;
    if (i < edges) {
      const int64_t r64 = rows[i], c64 = cols[i];
      CUDA_KERNEL_ASSERT(r64 >= 0 && r64 < num_rows && c64 >= 0 && c64 < num_cols);
      r = clamp_index(r64, num_rows);  // in bounds even where device asserts are compiled out
      c = clamp_index(c64, num_cols);
    } else {
      r = c = static_cast<int32_t>(i - edges);
    }
    keys_m[i] = r;
    keys_t[i] = c;
    ids[i] = static_cast<int32_t>(i);
  }
}

// Position p of the sorted entries: rows (keys[p - 1], keys[p]] start at p (crow), and entry p's column and value.
template <typename scalar_t, typename index_t>
__global__ void csr_fill_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ ids,
                                const index_t* __restrict__ other, int64_t edges, int64_t nnz, int64_t num_keys,
                                int64_t num_other, bool scale_by_key, const scalar_t* __restrict__ values,
                                const bool* __restrict__ keep, const scalar_t* __restrict__ row_scale,
                                const scalar_t* __restrict__ diag, int32_t* __restrict__ crow,
                                int32_t* __restrict__ col, scalar_t* __restrict__ val) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p <= nnz;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t before = p == 0 ? -1 : keys[p - 1];
    const int64_t here = p == nnz ? num_keys : keys[p];
    for (int64_t r = before + 1; r <= here; ++r) crow[r] = static_cast<int32_t>(p);
    if (p == nnz) continue;
    const int64_t id = ids[p];
    const bool is_edge = id < edges;
    const int32_t to = is_edge ? clamp_index(other[id], num_other) : static_cast<int32_t>(id - edges);
    col[p] = to;
    const scalar_t coef = is_edge ? csr_edge_coef(values, keep, id) : diag[id - edges];
    val[p] = csr_entry_value(coef, row_scale, scale_by_key ? here : to);
  }
}

template <typename scalar_t, typename index_t>
void fill_direction(const at::Tensor& keys, const at::Tensor& ids, at::Tensor& sorted_keys, at::Tensor& sorted_ids,
                    const index_t* other, int64_t edges, int64_t nnz, int64_t num_keys, int64_t num_other,
                    bool scale_by_key, const CsrPairOperands& ops, at::Tensor& crow, at::Tensor& col,
                    at::Tensor& val) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (nnz > 0) {
    // Only the bits a key can use: stable either way, fewer passes.
    const int end_bit = at::cuda::cub::get_num_bits(static_cast<uint64_t>(std::max<int64_t>(num_keys - 1, 1)));
    at::cuda::cub::radix_sort_pairs<int32_t, int32_t>(keys.const_data_ptr<int32_t>(),
                                                      sorted_keys.mutable_data_ptr<int32_t>(),
                                                      ids.const_data_ptr<int32_t>(),
                                                      sorted_ids.mutable_data_ptr<int32_t>(), nnz, false, 0, end_bit);
  }
  csr_fill_kernel<scalar_t, index_t><<<blocks_for(nnz + 1), kThreads, 0, stream>>>(
      sorted_keys.const_data_ptr<int32_t>(), sorted_ids.const_data_ptr<int32_t>(), other, edges, nnz, num_keys,
      num_other, scale_by_key, data_or_null<scalar_t>(ops.values), data_or_null<bool>(ops.keep),
      data_or_null<scalar_t>(ops.row_scale), data_or_null<scalar_t>(ops.diag), crow.mutable_data_ptr<int32_t>(),
      col.mutable_data_ptr<int32_t>(), val.mutable_data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

CsrPair csr_pair_cuda(const at::Tensor& rows_in, const at::Tensor& cols_in, const std::optional<at::Tensor>& values,
                      const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& row_scale,
                      const std::optional<at::Tensor>& diag, int64_t num_rows, int64_t num_cols,
                      at::ScalarType dtype, bool transpose) {
  check_csr_pair_args(rows_in, cols_in, values, keep, row_scale, diag, num_rows, num_cols, dtype);
  const c10::cuda::CUDAGuard guard(rows_in.device());
  const at::Tensor rows = rows_in.contiguous(), cols = cols_in.contiguous();
  const CsrPairOperands ops = csr_pair_operands(values, keep, row_scale, diag, dtype);
  const int64_t edges = rows.numel(), nnz = edges + (diag ? num_rows : 0);
  const auto index_options = rows.options().dtype(at::kInt);
  // The four index tensors of the result are views of one allocation, the five sort buffers of another; without the
  // transpose its three tensors are empty.
  const int64_t t_rows = transpose ? num_cols + 1 : 0, t_nnz = transpose ? nnz : 0;
  at::Tensor indices = at::empty({num_rows + 1 + nnz + t_rows + t_nnz}, index_options);
  at::Tensor crow_m = indices.narrow(0, 0, num_rows + 1), col_m = indices.narrow(0, num_rows + 1, nnz);
  at::Tensor crow_t = indices.narrow(0, num_rows + 1 + nnz, t_rows),
             col_t = indices.narrow(0, num_rows + 1 + nnz + t_rows, t_nnz);
  at::Tensor vals = at::empty({nnz + t_nnz}, rows.options().dtype(dtype));
  at::Tensor val_m = vals.narrow(0, 0, nnz), val_t = vals.narrow(0, nnz, t_nnz);
  at::Tensor work = at::empty({5 * nnz}, index_options);
  at::Tensor keys_m = work.narrow(0, 0, nnz), keys_t = work.narrow(0, nnz, nnz), ids = work.narrow(0, 2 * nnz, nnz);
  at::Tensor sorted_keys = work.narrow(0, 3 * nnz, nnz), sorted_ids = work.narrow(0, 4 * nnz, nnz);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "csr_pair_cuda", [&] {
    const index_t* r = rows.const_data_ptr<index_t>();
    const index_t* c = cols.const_data_ptr<index_t>();
    if (nnz > 0) {
      csr_keys_kernel<index_t><<<blocks_for(nnz), kThreads, 0, stream>>>(
          r, c, edges, nnz, num_rows, num_cols, keys_m.mutable_data_ptr<int32_t>(), keys_t.mutable_data_ptr<int32_t>(),
          ids.mutable_data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    AT_DISPATCH_FLOATING_TYPES(dtype, "csr_pair_cuda", [&] {
      // The sorted buffers serve M, then Mᵀ (the stream orders the second sort after the first fill).
      fill_direction<scalar_t, index_t>(keys_m, ids, sorted_keys, sorted_ids, c, edges, nnz, num_rows, num_cols, true,
                                        ops, crow_m, col_m, val_m);
      if (!transpose) return;
      fill_direction<scalar_t, index_t>(keys_t, ids, sorted_keys, sorted_ids, r, edges, nnz, num_cols, num_rows, false,
                                        ops, crow_t, col_t, val_t);
    });
  });
  return {crow_m, col_m, val_m, crow_t, col_t, val_t};
}

}  // namespace pyg_quant
