#pragma once
// The quantize ops on the GPU: quantize_pack, unpack_codes, dequantize and packed_code_sums in
// quantize_pack_cuda.cu, pack_row_codes and planes_from_row_codes in row_codes_cuda.cu, quantize_pack_ranges and
// zeros_cuda in quantize_ranges_cuda.cu.
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace pyg_quant {

at::Tensor quantize_pack_cuda(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& inv_scale,
                              int64_t bits, bool col_layout, const std::optional<at::Tensor>& noise);
at::Tensor unpack_codes_cuda(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout);
// lo + scale * code as float32 [rows, cols] (to_val), ranges per tensor (dim -1), column (0) or row (1).
at::Tensor dequantize_cuda(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                          const at::Tensor& lo, const at::Tensor& scale, int64_t dim);
// The packed row codes of planes (csrc/row_codes.h), as pack_row_codes_cpu: the gather form of node features for the
// CSR part of bit_spmm.
at::Tensor pack_row_codes_cuda(const at::Tensor& planes, int64_t cols, bool col_layout);
// The column-layout planes of packed row codes, as planes_from_row_codes_cpu.
at::Tensor planes_from_row_codes_cuda(const at::Tensor& row_codes, int64_t rows, int64_t cols, int64_t bits);
at::Tensor packed_code_sums_cuda(const at::Tensor& planes);
// A zeroed 1-D tensor: one cudaMemsetAsync on the current stream, in place of at::zeros' dispatch, iterator and
// fill kernel, whose host time the layers' eager forward would pay at every call.
at::Tensor zeros_cuda(int64_t numel, const at::TensorOptions& options);
// (planes, lo, scale, code sums, row codes): the row codes (pack_row_codes of the planes) only when asked for,
// else an empty uint8 tensor.  col_keys (dim 0, column layout; csrc/ordered_key.h): the columns' extrema, in place
// of a pass over x.  code_sums = false: an empty int64 tensor for the sums (the column kernel then skips them, and
// with col_keys it needs no zeroed buffer: no fill kernel).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_ranges_cuda(
    const at::Tensor& x, int64_t bits, int64_t dim, bool col_layout, const std::optional<at::Tensor>& noise,
    bool row_codes, const std::optional<at::Tensor>& col_keys, bool code_sums);

// quantize_pack_ranges per column (column layout) over `stored_keys` (column keys of ranges fixed in advance), except
// that a column whose own values hold a NaN or inf takes a NaN range: `col_keys` its columns' keys where the caller
// has them (quant_mlp's), else reduced here in one pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_stored_ranges_cuda(
    const at::Tensor& x, int64_t bits, const std::optional<at::Tensor>& col_keys, const at::Tensor& stored_keys,
    bool row_codes, bool code_sums);

}  // namespace pyg_quant
