#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

namespace pyg_quant {

at::Tensor quantize_pack_cpu(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& inv_scale,
                             int64_t bits, bool col_layout, const std::optional<at::Tensor>& noise);
at::Tensor unpack_codes_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout);
// lo + scale * code as float32 [rows, cols] (to_val), ranges per tensor (dim -1), column (0) or row (1).
at::Tensor dequantize_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                          const at::Tensor& lo, const at::Tensor& scale, int64_t dim);
at::Tensor packed_code_sums_cpu(const at::Tensor& planes);
// The packed row codes of planes (csrc/row_codes.h): uint8[nodes, row_code_bytes(cols, bits)], nodes = the planes'
// padded node count (words * 32 in column layout, outer in row layout).
at::Tensor pack_row_codes_cpu(const at::Tensor& planes, int64_t cols, bool col_layout);
// The inverse: the column-layout planes int32 [bits, outer_pad, words] of a rows x cols tensor of bits-bit codes
// from its packed row codes (row_codes.h); padding codes are zero.
at::Tensor planes_from_row_codes_cpu(const at::Tensor& row_codes, int64_t rows, int64_t cols, int64_t bits);

// quantize_pack_ranges per column (column layout) over `stored_keys` (column keys of ranges fixed in advance), a
// column whose own keys `col_keys` show a NaN or inf over a NaN range.  Without col_keys the stored ranges are used
// as they are: the CPU callers check their input finite first (and raise), as the layers do.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_stored_ranges_cpu(
    const at::Tensor& x, int64_t bits, const std::optional<at::Tensor>& col_keys, const at::Tensor& stored_keys,
    bool row_codes, bool code_sums);
}  // namespace pyg_quant

#include <tuple>
namespace pyg_quant {
// planes, lo, scale (one range per row for dim=1, per column for dim=0) and the planes' code sums.
// (planes, lo, scale, code sums, row codes): the row codes (pack_row_codes of the planes) only when asked for,
// else an empty uint8 tensor.  col_keys (dim 0, column layout; csrc/ordered_key.h): the columns' extrema, in place
// of x's own (the same result when they describe x).  code_sums = false: an empty int64 tensor for the sums.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_ranges_cpu(
    const at::Tensor& x, int64_t bits, int64_t dim, bool col_layout, const std::optional<at::Tensor>& noise,
    bool row_codes, const std::optional<at::Tensor>& col_keys, bool code_sums);
// quantize_pack_ranges per column (column layout) over `stored_keys` (column keys of ranges fixed in advance), a
// column whose own keys `col_keys` show a NaN or inf over a NaN range.  Without col_keys the stored ranges are used
// as they are: the CPU callers check their input finite first (and raise), as the layers do.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_stored_ranges_cpu(
    const at::Tensor& x, int64_t bits, const std::optional<at::Tensor>& col_keys, const at::Tensor& stored_keys,
    bool row_codes, bool code_sums);
}  // namespace pyg_quant
