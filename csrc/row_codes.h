#pragma once
// The packed row-code copy of a BitTensor (pyg_quant/layout.py, "Row codes"): node r's codes, column after column,
// in containers of container_bits(bits) bits, LSB first, in a row of row_code_bytes(cols, bits) bytes.  It is what
// the CSR part of bit_spmm gathers: one node's codes are contiguous, and at 4 bits a 64-feature row is 32 bytes.
// container_bits and row_code_bytes, the format's sizes, are in layout.h.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

#include "layout.h"

namespace pyg_quant {

// The code of column c in a packed row.
PYG_QUANT_HOST_DEVICE uint32_t row_code_at(const uint8_t* row, int64_t c, int container) {
  const int64_t bit = c * container;
  return (static_cast<uint32_t>(row[bit >> 3]) >> (bit & 7)) & ((1u << container) - 1u);
}

// The shape of pack_row_codes(planes, cols, col_layout) after checking its arguments (CPU and CUDA alike): one row
// of row_bytes per node, nodes = the planes' padded node count.
struct RowCodesShape {
  int64_t bits, outer, words, nodes, row_bytes;
};

inline RowCodesShape row_codes_shape(const at::Tensor& planes, int64_t cols, bool col_layout) {
  TORCH_CHECK_VALUE(planes.dim() == 3 && planes.scalar_type() == at::kInt, "planes must be int32[bits, outer, words]");
  const int64_t bits = planes.size(0), outer = planes.size(1), words = planes.size(2);
  TORCH_CHECK_VALUE(bits >= 1 && bits <= kMaxBits, "planes must hold 1 to 8 bit planes");
  TORCH_CHECK_VALUE(cols >= 0 && cols <= (col_layout ? outer : words * kWordBits),
                    "cols exceeds the planes' padded shape");
  return {bits, outer, words, col_layout ? words * kWordBits : outer, row_code_bytes(cols, bits)};
}

// The planes of planes_from_row_codes(row_codes, rows, cols, bits): the column-layout planes (layout.py) of a
// rows x cols tensor of `bits`-bit codes whose packed row codes are row_codes.
struct PlanesFromRowCodesShape {
  int bits, cols, outer_pad, row_words;  // planes int32 [bits, outer_pad, words]; row_codes [words · 32, 4·row_words]
  int64_t words;                         // a multiple of kPackAlignWords (the nodes are padded to 256)
};

inline PlanesFromRowCodesShape planes_from_row_codes_shape(const at::Tensor& row_codes, int64_t rows, int64_t cols,
                                                           int64_t bits) {
  TORCH_CHECK_VALUE(bits >= 1 && bits <= kMaxBits, "bits must be in 1..8, got ", bits);
  TORCH_CHECK_VALUE(rows >= 0 && cols >= 1, "rows must be >= 0 and cols >= 1, got ", rows, " and ", cols);
  const int64_t row_bytes = row_code_bytes(cols, bits);
  TORCH_CHECK_VALUE(cols <= (int64_t{1} << 24), "cols must be at most 2^24, got ", cols);
  const PlanesFromRowCodesShape shape{static_cast<int>(bits), static_cast<int>(cols),
                                      static_cast<int>(padded_outer(cols)), static_cast<int>(row_bytes / 4),
                                      packed_words(rows)};
  TORCH_CHECK_VALUE(row_codes.dim() == 2 && row_codes.scalar_type() == at::kByte && row_codes.is_contiguous() &&
                        row_codes.size(0) == shape.words * 32 && row_codes.size(1) == row_bytes,
                    "row_codes must be the contiguous uint8 packed row codes of ", rows, " x ", cols, " ", bits,
                    "-bit codes ([", shape.words * 32, ", ", row_bytes, "]), got ", row_codes.scalar_type(), " ",
                    row_codes.sizes());
  return shape;
}

// An x_codes argument of bit_spmm: the packed row codes of column-layout x_planes over `cols` features (as
// pack_row_codes makes them), on x_planes' device.  Its content is trusted: it is derived data, like code sums.
inline void check_row_codes(const std::optional<at::Tensor>& x_codes, const at::Tensor& x_planes, int64_t cols) {
  if (!x_codes.has_value()) return;
  const RowCodesShape shape = row_codes_shape(x_planes, cols, /*col_layout=*/true);
  TORCH_CHECK_VALUE(x_codes->dim() == 2 && x_codes->scalar_type() == at::kByte && x_codes->is_contiguous() &&
                        x_codes->size(0) == shape.nodes && x_codes->size(1) == shape.row_bytes &&
                        x_codes->device() == x_planes.device(),
                    "x_codes must be the contiguous uint8 packed row codes of x_planes (pack_row_codes: [",
                    shape.nodes, ", ", shape.row_bytes, "]) on its device");
}

}  // namespace pyg_quant
