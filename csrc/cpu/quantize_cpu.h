#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu_features.h"
#include "quantize_steps.h"

namespace pyg_quant {

// The range of n consecutive values (a row): amin / amax (a NaN anywhere makes both NaN, as they do), then range_of.
inline Range row_range(const float* h, int64_t n, float max_code) {
  float mn = h[0], mx = h[0];
  bool nan = false;
  for (int64_t c = 0; c < n; ++c) {
    const float v = h[c];
    nan |= v != v;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  if (nan) mn = mx = NAN;
  return range_of(mn, mx, max_code);
}

// The largest of n bytes: the check that codes given as bytes fit their width (a loop the compiler vectorizes).
inline uint8_t largest_code(const uint8_t* codes, int64_t n) {
  uint8_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, codes[i]);
  return largest;
}

// The sum of n bytes (psadbw, 16 bytes a step, where the CPU is x86: the compiler's loop widens each byte to int64).
inline int64_t byte_sum(const uint8_t* bytes, int64_t n) {
  int64_t sum = 0, i = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  __m128i acc = zero;
  for (; i + 16 <= n; i += 16) {
    acc = _mm_add_epi64(acc, _mm_sad_epu8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i)), zero));
  }
  sum = _mm_cvtsi128_si64(acc) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(acc, acc));
#endif
  for (; i < n; ++i) sum += bytes[i];
  return sum;
}

// The bit planes of uint8 codes already made (a loader's stored feature codes): quantize_pack's layout, no float steps.
at::Tensor pack_codes_cpu(const at::Tensor& codes, int64_t bits, bool col_layout);

at::Tensor quantize_pack_cpu(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& inv_scale,
                             int64_t bits, bool col_layout, const std::optional<at::Tensor>& noise);
at::Tensor unpack_codes_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout);
// lo + scale * code as float32 [rows, cols] (to_val), ranges per tensor (dim -1), column (0) or row (1).
at::Tensor dequantize_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                          const at::Tensor& lo, const at::Tensor& scale, int64_t dim);
at::Tensor packed_code_sums_cpu(const at::Tensor& planes);
#if defined(PYG_QUANT_X86_DISPATCH)
// Whether dequantize_col_word_avx512 reads these planes: column layout, ranges per column or per tensor, AVX-512.
bool dequantize_col_word_applies(const at::Tensor& planes, bool col_layout, int64_t dim);
// Rows [32·w, 32·w + live) of dequantize of contiguous column-layout planes (`bits` planes `plane_stride` words
// apart, `words` words a column) with ranges per column (per_column) or one range, row i to out + i·out_stride:
// the same float32 values as the portable loop, 16 columns at a time straight from the planes' words.
void dequantize_col_word_avx512(const uint32_t* planes, int64_t bits, int64_t plane_stride, int64_t words,
                                int64_t cols, int64_t w, int64_t live, const float* lo, const float* scale,
                                bool per_column, float* out, int64_t out_stride);
#endif
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
