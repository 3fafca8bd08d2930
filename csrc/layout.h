#pragma once
// The bit layout of pyg_quant/layout.py for the kernels: its constants and padding rules, written once here under
// the same names (kCamelCase), constexpr and callable from host and device code.  layout.py is the definition, with
// the pictures; tests/test_layout.py checks the compiled ops' shapes against it.
#include <cstdint>
#include <limits>

#include "macros.h"

namespace pyg_quant {

// Bits of a plane word: bit k of word w holds element 32·w + k of the packed dimension.
constexpr int kWordBits = 32;
// PACK_ALIGN_BITS: the packed dimension is padded with zero codes to a multiple of 256 bits (the k256 step of the b1
// mma / wgmma instructions).
constexpr int kPackAlignBits = 256;
// PACK_ALIGN_WORDS: the same padding in words.
constexpr int kPackAlignWords = kPackAlignBits / kWordBits;
// OUTER_ALIGN: the outer dimension is padded to a multiple of 64 (the m64 of wgmma, a multiple of the m16 / n8 of
// mma.sync).
constexpr int kOuterAlign = 64;
// TILE_ROWS: rows of an adjacency tile (a row window).
constexpr int kTileRows = 16;
// TILE_COLS: columns of an adjacency tile (one m16 × k256 b1 fragment).
constexpr int kTileCols = 256;
// TILE_WORDS: words of a tile row, which line up with as many words of a column-layout feature tensor.
constexpr int kTileWords = kTileCols / kWordBits;
// MAX_BITS: the most bit planes a tensor holds.
constexpr int kMaxBits = 8;
// MIN_RANGE_WIDTH: the narrowest range [lo, hi] a quantizer keeps (narrower ones collapse to hi = lo), 2^kMaxBits - 1
// normal float32 steps, so that the inverse scale stays finite.
constexpr double kMinRangeWidth = ((1 << kMaxBits) - 1) * static_cast<double>(std::numeric_limits<float>::min());
// Row codes: a node's row is padded to 16 bytes, so that a gathering thread reads its slice with aligned vector loads.
constexpr int kRowCodeAlignBytes = 16;

template <typename T>
constexpr PYG_QUANT_HOST_DEVICE T round_up(T n, T multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// packed_words: number of 32-bit words that hold `length` packed elements, padded.
constexpr PYG_QUANT_HOST_DEVICE int64_t packed_words(int64_t length) {
  return round_up<int64_t>(length > 1 ? length : 1, kPackAlignBits) / kWordBits;
}

// padded_outer: the outer dimension's padded length.
constexpr PYG_QUANT_HOST_DEVICE int64_t padded_outer(int64_t length) {
  return round_up<int64_t>(length > 1 ? length : 1, kOuterAlign);
}

// container_bits: bits of a row-code container: the power of two (1, 2, 4 or 8) that holds a `bits`-bit code
// (a power of two, so that a container never straddles a byte).
constexpr PYG_QUANT_HOST_DEVICE int container_bits(int64_t bits) {
  return bits <= 1 ? 1 : bits <= 2 ? 2 : bits <= 4 ? 4 : 8;
}

// row_code_bytes: bytes of one node's packed row codes: `cols` containers, padded to 16 bytes.
constexpr PYG_QUANT_HOST_DEVICE int64_t row_code_bytes(int64_t cols, int64_t bits) {
  return round_up<int64_t>((cols > 1 ? cols : 1) * container_bits(bits), 8 * kRowCodeAlignBytes) / 8;
}

}  // namespace pyg_quant
