#pragma once
// expand_wire: a CompactAdjacency as a QuantBatch ships it (pyg_quant/loader/batch.py: each part at a byte offset of
// one uint8 buffer, integers in the narrowest type that holds them) decoded into a BitAdjacency's tensors in one op:
// the parts' views of the buffer (read as they travel; only the counts and, for a BitAdjacency that keeps them, the
// residual's columns and values widened), expand_tiles or expand_csr, the float diagonal term and, without tiles,
// the empty tile operands.  One dispatch where the decode in Python took two dozen ops: a loader's loop is bound by its
// host's time.  Written once over the backends' expansions, registered for the CPU and CUDA in library.cpp;
// pyg_quant/ops/reference.py composes the same steps from the reference ops.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "expand_args.h"
#include "layout.h"

namespace pyg_quant {

// The parts in CompactAdjacency.TENSORS' order, four integers each in `parts`: byte offset (-1: not shipped), wire
// dtype code (kWireDtypes' index, mirrored by pyg_quant/ops/reference.py's WIRE_DTYPES), size of dimension 0, size of
// dimension 1 (0: a 1-D part).
enum WirePart { kTileKey, kRowCount, kEntryCol, kEntryVal, kResRow, kResCol, kResVal, kDiag, kWireParts };
constexpr int kWireFields = 4;
constexpr at::ScalarType kWireDtypes[] = {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong};

// The part `index` of `buffer` as it travels (a view); nullopt when not shipped.
inline std::optional<at::Tensor> wire_view(const at::Tensor& buffer, at::IntArrayRef parts, int index) {
  const int64_t* field = parts.data() + index * kWireFields;
  const int64_t offset = field[0], code = field[1], size0 = field[2], size1 = field[3];
  if (offset < 0) return std::nullopt;
  constexpr int64_t kCodes = sizeof(kWireDtypes) / sizeof(kWireDtypes[0]);
  TORCH_CHECK_VALUE(code >= 0 && code < kCodes, "expand_wire: part ", index, " has no wire dtype ", code);
  TORCH_CHECK_VALUE(size0 >= 0 && size1 >= 0, "expand_wire: part ", index, " has a negative size");
  const at::ScalarType dtype = kWireDtypes[code];
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t numel = size0 * (size1 > 0 ? size1 : 1);
  TORCH_CHECK_VALUE(offset % itemsize == 0 && offset + numel * itemsize <= buffer.numel(), "expand_wire: part ",
                    index, " (", numel, " × ", itemsize, " bytes at ", offset, ") is not an aligned window of the ",
                    buffer.numel(), "-byte buffer");
  at::Tensor view = buffer.narrow(0, offset, numel * itemsize).view(dtype);
  return size1 > 0 ? view.view({size0, size1}) : view;
}

// The part `index` as `target`: the view where it travels as `target`, else a widened copy; a copy in any case
// where `owned` (a tensor the op hands back must not alias its input).
inline std::optional<at::Tensor> wire_part(const at::Tensor& buffer, at::IntArrayRef parts, int index,
                                           at::ScalarType target, bool owned = false) {
  std::optional<at::Tensor> view = wire_view(buffer, parts, index);
  if (!view || view->scalar_type() != target) return view ? std::optional<at::Tensor>(view->to(target)) : view;
  return owned ? std::optional<at::Tensor>(view->clone()) : view;
}

using ExpandTilesKernel = ExpandedTiles (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const std::optional<at::Tensor>&, const at::Tensor&,
                                            const std::optional<at::Tensor>&, int64_t, int64_t, int64_t);
using ExpandCsrKernel = ExpandedCsr (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, int64_t, int64_t);

// [window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, diag, row_sums]: a BitAdjacency's tensors, res_val
// int32[0] where every value is 1 and diag float32[0] where none was shipped (None in the BitAdjacency).
template <ExpandTilesKernel Tiles, ExpandCsrKernel Csr>
std::vector<at::Tensor> expand_wire(const at::Tensor& buffer, at::IntArrayRef parts, int64_t num_rows,
                                    int64_t num_cols, int64_t planes, bool tiles) {
  TORCH_CHECK_VALUE(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
                    "expand_wire: buffer must be a contiguous uint8 [nbytes] tensor");
  TORCH_CHECK_VALUE(static_cast<int64_t>(parts.size()) == kWireParts * kWireFields, "expand_wire: parts must hold ",
                    kWireFields, " integers for each of the ", static_cast<int>(kWireParts), " parts");
  for (int required : {kTileKey, kRowCount, kEntryCol, kResRow, kResCol}) {
    TORCH_CHECK_VALUE(parts[required * kWireFields] >= 0, "expand_wire: part ", required, " is required");
  }
  // The indices go to the expansion as they travel (int8, int16 or int32: its CUDA kernels read each width, its CPU
  // code widens them); row_count travels as uint8 or int16 (a full tile row holds 256 entries), at most narrowed to
  // int8.
  const at::ScalarType count_type = parts[kRowCount * kWireFields + 1] == 0 ? at::kByte : at::kShort;
  const at::Tensor tile_key = *wire_view(buffer, parts, kTileKey);
  const at::Tensor row_count = *wire_part(buffer, parts, kRowCount, count_type);
  const at::Tensor entry_col = *wire_part(buffer, parts, kEntryCol, at::kByte);
  const std::optional<at::Tensor> entry_val = wire_part(buffer, parts, kEntryVal, at::kByte);
  const at::Tensor res_row = *wire_view(buffer, parts, kResRow);
  const std::optional<at::Tensor> diag_codes = wire_part(buffer, parts, kDiag, at::kByte);
  const auto float32 = buffer.options().dtype(at::kFloat), int32 = buffer.options().dtype(at::kInt);
  const at::Tensor diag = diag_codes ? diag_codes->to(at::kFloat) : at::empty({0}, float32);
  if (!tiles) {
    const at::Tensor res_col = *wire_view(buffer, parts, kResCol);
    const std::optional<at::Tensor> res_val = wire_view(buffer, parts, kResVal);
    auto [res_ptr, out_col, out_val, row_sums] =
        Csr(tile_key, row_count, entry_col, entry_val, res_row, res_col, res_val, num_rows, num_cols);
    const int64_t num_windows = (num_rows + kTileRows - 1) / kTileRows;
    return {at::zeros({num_windows + 1}, buffer.options().dtype(at::kLong)), at::empty({0}, int32),
            at::empty({planes, 0, kTileRows, kTileWords}, int32), res_ptr, out_col, out_val, diag, row_sums};
  }
  // (res_col and res_val are the BitAdjacency's own: int32, not views of the buffer)
  const at::Tensor res_col = *wire_part(buffer, parts, kResCol, at::kInt, /*owned=*/true);
  const std::optional<at::Tensor> res_val = wire_part(buffer, parts, kResVal, at::kInt, /*owned=*/true);
  auto [window_ptr, tile_col, tile_bits, res_ptr, row_sums] =
      Tiles(tile_key, row_count, entry_col, entry_val, res_row, res_val, num_rows, num_cols, planes);
  return {window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val ? *res_val : at::empty({0}, int32), diag,
          row_sums};
}

}  // namespace pyg_quant
