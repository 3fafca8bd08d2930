// csr_pair on the GPU: one stable radix sort of (key, entry id) for both directions at once (Mᵀ's keys carry a bit
// above M's) over only the bits a key needs (two 8-bit passes for up to 32,768 rows, where a sort of whole int32 keys
// takes four, twice), then one kernel that writes both matrices' row pointers from the sorted keys and gathers each
// entry's column and value.  One op: the host issues one sort and two kernels from C++.
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

// Sort keys (M's rows, then Mᵀ's rows with `t_bit` set) and entry ids: edge e, then diagonal entry i at edges + i.
template <typename index_t>
__global__ void csr_keys_kernel(const index_t* __restrict__ rows, const index_t* __restrict__ cols, int64_t edges,
                                int64_t nnz, int64_t num_rows, int64_t num_cols, bool transpose, int32_t t_bit,
                                int32_t* __restrict__ keys, int32_t* __restrict__ ids) {
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
    keys[i] = r;
    ids[i] = static_cast<int32_t>(i);
    if (transpose) {
      keys[nnz + i] = c | t_bit;
      ids[nnz + i] = static_cast<int32_t>(i);
    }
  }
}

// Position p of a direction's sorted entries: its rows (keys[p - 1], keys[p]] start at p (crow), and entry p's
// column and value.  Thread j takes position j % (nnz + 1) of direction j / (nnz + 1) (0: M, 1: Mᵀ).
template <typename scalar_t, typename index_t>
__global__ void csr_fill_kernel(const int32_t* __restrict__ sorted_keys, const int32_t* __restrict__ sorted_ids,
                                const index_t* __restrict__ rows, const index_t* __restrict__ cols, int64_t edges,
                                int64_t nnz, int64_t num_rows, int64_t num_cols, int directions, int32_t key_mask,
                                const scalar_t* __restrict__ values, const bool* __restrict__ keep,
                                const scalar_t* __restrict__ row_scale, const scalar_t* __restrict__ diag,
                                int32_t* __restrict__ crow_m, int32_t* __restrict__ col_m, scalar_t* __restrict__ val_m,
                                int32_t* __restrict__ crow_t, int32_t* __restrict__ col_t,
                                scalar_t* __restrict__ val_t) {
  const int64_t total = static_cast<int64_t>(directions) * (nnz + 1);
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool t = j > nnz;
    const int64_t p = t ? j - nnz - 1 : j;
    const int32_t* keys = sorted_keys + (t ? nnz : 0);
    const int64_t num_keys = t ? num_cols : num_rows;
    int32_t* crow = t ? crow_t : crow_m;
    const int64_t before = p == 0 ? -1 : (keys[p - 1] & key_mask);
    const int64_t here = p == nnz ? num_keys : (keys[p] & key_mask);
    for (int64_t r = before + 1; r <= here; ++r) crow[r] = static_cast<int32_t>(p);
    if (p == nnz) continue;
    const int64_t id = sorted_ids[(t ? nnz : 0) + p];
    const bool is_edge = id < edges;
    const int32_t to = is_edge ? clamp_index(t ? rows[id] : cols[id], t ? num_rows : num_cols)
                               : static_cast<int32_t>(id - edges);
    const scalar_t coef = is_edge ? csr_edge_coef(values, keep, id) : diag[id - edges];
    (t ? col_t : col_m)[p] = to;
    (t ? val_t : val_m)[p] = csr_entry_value(coef, row_scale, t ? to : here);  // scaled by M's row
  }
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
  const int directions = transpose ? 2 : 1;
  // Only the bits a key can use, plus the direction's: stable either way, fewer passes.
  const int64_t widest = std::max<int64_t>({num_rows - 1, transpose ? num_cols - 1 : 0, 1});
  const int key_bits = at::cuda::cub::get_num_bits(static_cast<uint64_t>(widest));
  TORCH_CHECK_VALUE(key_bits < 31, "csr_pair: the matrix must have fewer than 2^30 rows and columns");
  const int32_t t_bit = int32_t{1} << key_bits;
  const auto index_options = rows.options().dtype(at::kInt);
  // The four index tensors of the result are views of one allocation, the sort's four buffers of another; without
  // the transpose its three tensors are empty.
  const int64_t t_rows = transpose ? num_cols + 1 : 0, t_nnz = transpose ? nnz : 0;
  at::Tensor indices = at::empty({num_rows + 1 + nnz + t_rows + t_nnz}, index_options);
  at::Tensor crow_m = indices.narrow(0, 0, num_rows + 1), col_m = indices.narrow(0, num_rows + 1, nnz);
  at::Tensor crow_t = indices.narrow(0, num_rows + 1 + nnz, t_rows),
             col_t = indices.narrow(0, num_rows + 1 + nnz + t_rows, t_nnz);
  at::Tensor vals = at::empty({nnz + t_nnz}, rows.options().dtype(dtype));
  at::Tensor val_m = vals.narrow(0, 0, nnz), val_t = vals.narrow(0, nnz, t_nnz);
  const int64_t sorted = directions * nnz;
  at::Tensor work = at::empty({4 * sorted}, index_options);
  int32_t* keys = work.mutable_data_ptr<int32_t>();
  int32_t* ids = keys + sorted;
  int32_t* sorted_keys = ids + sorted;
  int32_t* sorted_ids = sorted_keys + sorted;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(rows.scalar_type(), "csr_pair_cuda", [&] {
    const index_t* r = rows.const_data_ptr<index_t>();
    const index_t* c = cols.const_data_ptr<index_t>();
    if (nnz > 0) {
      csr_keys_kernel<index_t><<<blocks_for(nnz), kThreads, 0, stream>>>(r, c, edges, nnz, num_rows, num_cols,
                                                                         transpose, t_bit, keys, ids);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      at::cuda::cub::radix_sort_pairs<int32_t, int32_t>(keys, sorted_keys, ids, sorted_ids, sorted, false, 0,
                                                        key_bits + (transpose ? 1 : 0));
    }
    AT_DISPATCH_FLOATING_TYPES(dtype, "csr_pair_cuda", [&] {
      csr_fill_kernel<scalar_t, index_t><<<blocks_for(directions * (nnz + 1)), kThreads, 0, stream>>>(
          sorted_keys, sorted_ids, r, c, edges, nnz, num_rows, num_cols, directions, t_bit - 1,
          data_or_null<scalar_t>(ops.values), data_or_null<bool>(ops.keep), data_or_null<scalar_t>(ops.row_scale),
          data_or_null<scalar_t>(ops.diag), crow_m.mutable_data_ptr<int32_t>(), col_m.mutable_data_ptr<int32_t>(),
          val_m.mutable_data_ptr<scalar_t>(), transpose ? crow_t.mutable_data_ptr<int32_t>() : nullptr,
          transpose ? col_t.mutable_data_ptr<int32_t>() : nullptr,
          transpose ? val_t.mutable_data_ptr<scalar_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {crow_m, col_m, val_m, crow_t, col_t, val_t};
}

}  // namespace pyg_quant
