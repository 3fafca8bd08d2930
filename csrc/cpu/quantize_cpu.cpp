// Quantize + pack, unpack and code sums on the CPU, in the layout of
// pyg_quant/layout.py.  Codes follow the float32 recipe written there step by
// step (no FMA contraction: setup.py passes -ffp-contract=off) so that every
// backend produces the same codes.
#include "quantize_cpu.h"

#include "layout.h"
#include "ordered_key.h"
#include "quantize_args.h"
#include "quantize_ranges.h"
#include "quantize_steps.h"
#include "row_codes.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu_features.h"
#include "popcount.h"
#include "unpack_avx2.h"

namespace pyg_quant {
namespace {

// The code of one element is quantize_steps.h's code_of: t = (x - lo) * inv + u clamped to [0, max_code]
// (a NaN t to 0) and truncated.  The SSE2 path below computes exactly these float32 operations (subps,
// mulps, addps; maxps returns its second operand 0 for a NaN), so both agree.

// n consecutive codes of one row: x[0..n), noise[0..n) (nullptr: u = 0.5), lo/inv either
// per element (LoB/InvB false: lo[0..n)) or one value broadcast (true: lo[0]).
template <bool LoB, bool InvB>
void encode_run(const float* x, const float* lo, const float* inv, const float* noise, int64_t n, float max_code,
                uint8_t* q) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps(), maxv = _mm_set1_ps(max_code), half = _mm_set1_ps(0.5f);
  const __m128 lo_b = _mm_set1_ps(lo[0]), inv_b = _mm_set1_ps(inv[0]);
  auto four = [&](int64_t j) {
    const __m128 l = LoB ? lo_b : _mm_loadu_ps(lo + j);
    const __m128 s = InvB ? inv_b : _mm_loadu_ps(inv + j);
    const __m128 u = noise ? _mm_loadu_ps(noise + j) : half;
    __m128 t = _mm_mul_ps(_mm_sub_ps(_mm_loadu_ps(x + j), l), s);
    t = _mm_add_ps(t, u);
    t = _mm_min_ps(_mm_max_ps(t, zero), maxv);
    return _mm_cvttps_epi32(t);
  };
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_packs_epi32(four(i), four(i + 4));
    const __m128i b = _mm_packs_epi32(four(i + 8), four(i + 12));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_packus_epi16(a, b));
  }
#endif
  for (; i < n; ++i)
    q[i] = static_cast<uint8_t>(
        code_of(x[i], LoB ? lo[0] : lo[i], InvB ? inv[0] : inv[i], noise ? noise[i] : 0.5f, max_code));
}

using EncodeFn = void (*)(const float*, const float*, const float*, const float*, int64_t, float, uint8_t*);

EncodeFn encode_fn(bool lo_broadcast, bool inv_broadcast) {
  if (lo_broadcast) return inv_broadcast ? &encode_run<true, true> : &encode_run<true, false>;
  return inv_broadcast ? &encode_run<false, true> : &encode_run<false, false>;
}

#if defined(__SSE2__)
// Plane words of 32 codes (a: codes 0..15, b: codes 16..31): word p holds bit p of code k at bit k.
inline void planes_of_32(__m128i a, __m128i b, int64_t bits, uint32_t* out, int64_t plane_stride) {
  for (int64_t p = 0; p < bits; ++p) {
    // Shifting each 16-bit lane left by 7 - p moves bit p of both its bytes to their bit 7.
    const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(7 - p));
    const uint32_t lo16 = static_cast<uint32_t>(_mm_movemask_epi8(_mm_sll_epi16(a, shift)));
    const uint32_t hi16 = static_cast<uint32_t>(_mm_movemask_epi8(_mm_sll_epi16(b, shift)));
    out[p * plane_stride] = lo16 | (hi16 << 16);
  }
}

inline void planes_of_32(const uint8_t* q, int64_t bits, uint32_t* out, int64_t plane_stride) {
  planes_of_32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)),
               _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)), bits, out, plane_stride);
}

// Transpose of a 16x16 byte matrix held as 16 rows: four rounds of pairing rows j and j + 8 byte by
// byte; each round rotates the 8-bit (row, byte) index left by one, so four swap row and byte.
inline void transpose_16x16(__m128i r[16]) {
  for (int round = 0; round < 4; ++round) {
    __m128i t[16];
    for (int j = 0; j < 8; ++j) {
      t[2 * j] = _mm_unpacklo_epi8(r[j], r[j + 8]);
      t[2 * j + 1] = _mm_unpackhi_epi8(r[j], r[j + 8]);
    }
    for (int j = 0; j < 16; ++j) r[j] = t[j];
  }
}
#else
inline void planes_of_32(const uint8_t* q, int64_t bits, uint32_t* out, int64_t plane_stride) {
  for (int64_t p = 0; p < bits; ++p) {
    uint32_t word = 0;
    for (int k = 0; k < 32; ++k) word |= ((static_cast<uint32_t>(q[k]) >> p) & 1u) << k;
    out[p * plane_stride] = word;
  }
}
#endif

int64_t broadcast_stride(const at::Tensor& t, int64_t dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

// Columns per tile of the column layout: a tile is 32 rows (one word) by kColTile columns.
constexpr int64_t kColTile = 256;

// Bit planes of a [rows, cols] matrix whose codes `codes_of(r, c0, n, q)` writes (row r, columns c0 .. c0 + n - 1,
// into q[0..n)): row layout one row at a time, 32 codes to a word per plane; column layout in tiles of 32 rows by
// kColTile columns, transposed to 32 codes per column.
template <typename CodesOf>
at::Tensor pack_planes(int64_t rows, int64_t cols, int64_t bits, bool col_layout, const at::TensorOptions& options,
                       const CodesOf& codes_of) {
  const int64_t outer = col_layout ? cols : rows;
  const int64_t packed = col_layout ? rows : cols;
  const int64_t words = packed_words(packed);
  auto planes = at::zeros({bits, padded_outer(outer), words}, options.dtype(at::kInt));
  uint32_t* out = reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>());
  const int64_t plane_stride = planes.stride(0);
  if (rows == 0 || cols == 0) return planes;

  if (!col_layout) {
    // A row's codes (zero-padded to whole words), then 32 codes at a time into one word per plane.
    const int64_t row_words = (cols + 31) / 32;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> q(row_words * 32, 0);
      for (int64_t r = begin; r < end; ++r) {
        codes_of(r, 0, cols, q.data());
        for (int64_t w = 0; w < row_words; ++w) planes_of_32(q.data() + w * 32, bits, out + r * words + w, plane_stride);
      }
    });
  } else {
    // Tiles of 32 rows (one word) by kColTile columns: codes row by row (reading x row-major),
    // transposed to 32 codes per column, then one word per plane and column.
    const int64_t row_words = (rows + 31) / 32, col_tiles = (cols + kColTile - 1) / kColTile;
    at::parallel_for(0, row_words * col_tiles, 1, [&](int64_t begin, int64_t end) {
      alignas(16) uint8_t tile[32][kColTile];
      std::memset(tile, 0, sizeof(tile));  // codes past the last row / column stay 0
      for (int64_t task = begin; task < end; ++task) {
        // Column tile major: consecutive tasks fill consecutive words of the same output lines.
        const int64_t w = task % row_words, c0 = (task / row_words) * kColTile;
        const int64_t n = std::min<int64_t>(32, rows - w * 32), nc = std::min<int64_t>(kColTile, cols - c0);
        for (int64_t k = 0; k < n; ++k) codes_of(w * 32 + k, c0, nc, tile[k]);
        if (n < 32) std::memset(tile[n], 0, (32 - n) * sizeof(tile[0]));
#if defined(__SSE2__)
        for (int64_t g = 0; g < nc; g += 16) {
          __m128i top[16], bottom[16];
          for (int k = 0; k < 16; ++k) {
            top[k] = _mm_load_si128(reinterpret_cast<const __m128i*>(tile[k] + g));
            bottom[k] = _mm_load_si128(reinterpret_cast<const __m128i*>(tile[k + 16] + g));
          }
          transpose_16x16(top);
          transpose_16x16(bottom);
          const int64_t m = std::min<int64_t>(16, nc - g);
          for (int64_t c = 0; c < m; ++c)
            planes_of_32(top[c], bottom[c], bits, out + (c0 + g + c) * words + w, plane_stride);
        }
#else
        alignas(16) uint8_t column[32];
        for (int64_t c = 0; c < nc; ++c) {
          for (int64_t k = 0; k < 32; ++k) column[k] = tile[k][c];
          planes_of_32(column, bits, out + (c0 + c) * words + w, plane_stride);
        }
#endif
      }
    });
  }
  return planes;
}

}  // namespace

at::Tensor quantize_pack_cpu(const at::Tensor& x_in, const at::Tensor& lo_in, const at::Tensor& inv_in,
                             int64_t bits, bool col_layout, const std::optional<at::Tensor>& noise_in) {
  check_quantize_pack_args(x_in, lo_in, inv_in, bits, noise_in);
  const auto x = x_in.contiguous();
  const auto lo = lo_in.to(at::kFloat).contiguous();
  const auto inv = inv_in.to(at::kFloat).contiguous();
  const int64_t cols = x.size(1);
  const at::Tensor noise = noise_in.has_value() ? noise_in->contiguous() : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* np = noise.defined() ? noise.data_ptr<float>() : nullptr;
  const float* lop = lo.data_ptr<float>();
  const float* invp = inv.data_ptr<float>();
  // Contiguous lo/inv broadcast to [rows, cols]: along a row the stride is 1, or 0 (one value).
  const int64_t lo_rs = broadcast_stride(lo, 0), lo_cs = broadcast_stride(lo, 1);
  const int64_t inv_rs = broadcast_stride(inv, 0), inv_cs = broadcast_stride(inv, 1);
  const EncodeFn encode = encode_fn(lo_cs == 0, inv_cs == 0);
  const float max_code = static_cast<float>((1 << bits) - 1);
  return pack_planes(x.size(0), cols, bits, col_layout, x.options(), [&](int64_t r, int64_t c0, int64_t n, uint8_t* q) {
    encode(xp + r * cols + c0, lop + r * lo_rs + c0 * lo_cs, invp + r * inv_rs + c0 * inv_cs,
           np ? np + r * cols + c0 : nullptr, n, max_code, q);
  });
}

at::Tensor pack_codes_cpu(const at::Tensor& codes_in, int64_t bits, bool col_layout) {
  check_pack_codes_args(codes_in, bits);
  const auto codes = codes_in.contiguous();
  const int64_t rows = codes.size(0), cols = codes.size(1);
  const uint8_t* cp = codes.const_data_ptr<uint8_t>();
  const uint8_t max_code = static_cast<uint8_t>((1 << bits) - 1);
  const uint8_t largest = largest_code(cp, codes.numel());
  TORCH_CHECK_VALUE(largest <= max_code, "pack_codes: codes must lie in 0..", static_cast<int>(max_code), " for ",
                    bits, " bits, got ", static_cast<int>(largest));
  return pack_planes(rows, cols, bits, col_layout, codes.options(), [&](int64_t r, int64_t c0, int64_t n, uint8_t* q) {
    std::memcpy(q, cp + r * cols + c0, n);
  });
}

namespace {

// Every code of the rows x cols matrix in `planes`, as store(r, c, q), rows in parallel.
template <typename Store>
void for_each_code(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout, const Store& store) {
  const int64_t bits = planes.size(0), words = planes.size(2), plane_stride = planes.stride(0);
  const uint32_t* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t o = col_layout ? c : r, e = col_layout ? r : c;
        const uint32_t* word = in + o * words + (e >> 5);
        uint32_t q = 0;
        for (int64_t p = 0; p < bits; ++p) q |= ((word[p * plane_stride] >> (e & 31)) & 1u) << p;
        store(r, c, q);
      }
    }
  });
}

// kSpreadBits[b]: byte i holds bit i of b.  Eight codes from their planes' bytes: Σ_p kSpreadBits[byte_p] << p.
struct SpreadBits {
  uint64_t table[256];
  constexpr SpreadBits() : table() {
    for (int b = 0; b < 256; ++b) {
      uint64_t v = 0;
      for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
      table[b] = v;
    }
  }
};
constexpr SpreadBits kSpreadBits{};

// Codes of the 8 elements at bits 8·k .. 8·k + 7 of one word in each of `bits` planes (`plane_stride` words apart),
// one a byte.
inline uint64_t eight_codes(const uint32_t* word, int64_t bits, int64_t plane_stride, int k) {
  uint64_t v = 0;
  for (int64_t p = 0; p < bits; ++p) v |= kSpreadBits.table[(word[p * plane_stride] >> (8 * k)) & 0xffu] << p;
  return v;
}

#if defined(PYG_QUANT_X86_DISPATCH)
// Rows [32·w, 32·w + live) of column-layout planes, 16 columns at a time: each plane's words of those columns in one
// vector (a lane a column), each rotated left by its plane index so that after i right rotations by one, bit i (row
// i) sits at that index; a row's 16 codes in two instructions a plane.  kValues: their values (float out, as
// dequantize), else the codes (uint8 out, as unpack_codes).
template <int kBits, bool kValues>
PYG_QUANT_TARGET_AVX512 void col_word_bits(const uint32_t* in, int64_t plane_stride, int64_t words, int64_t cols,
                                           int64_t w, int64_t live, const float* lo, const float* scale,
                                           bool per_column, void* out, int64_t out_stride) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(words)));
  const __m512i one = _mm512_set1_epi32(1);
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const __mmask16 m = static_cast<__mmask16>(cols - c0 >= 16 ? 0xffffu : (1u << (cols - c0)) - 1u);
    __m512i plane[kBits];
    for (int p = 0; p < kBits; ++p) {
      const uint32_t* base = in + p * plane_stride + c0 * words + w;
      plane[p] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, index, base, 4);
    }
    for (int p = 1; p < kBits; ++p) plane[p] = _mm512_rolv_epi32(plane[p], _mm512_set1_epi32(p));
    __m512 lo_v = _mm512_setzero_ps(), scale_v = _mm512_setzero_ps();
    if (kValues) {
      lo_v = per_column ? _mm512_maskz_loadu_ps(m, lo + c0) : _mm512_set1_ps(lo[0]);
      scale_v = per_column ? _mm512_maskz_loadu_ps(m, scale + c0) : _mm512_set1_ps(scale[0]);
    }
    for (int64_t i = 0; i < live; ++i) {
      __m512i code = _mm512_and_si512(plane[0], one);
      plane[0] = _mm512_srli_epi32(plane[0], 1);
      for (int p = 1; p < kBits; ++p) {
        code = _mm512_ternarylogic_epi32(code, plane[p], _mm512_set1_epi32(1 << p), 0xF8);  // code | (plane & bit)
        plane[p] = _mm512_ror_epi32(plane[p], 1);
      }
      if (kValues) {
        // value_of: scale · q, then lo + it, each rounded (no FMA)
        const __m512 value = _mm512_add_ps(lo_v, _mm512_mul_ps(scale_v, _mm512_cvtepi32_ps(code)));
        _mm512_mask_storeu_ps(static_cast<float*>(out) + i * out_stride + c0, m, value);
      } else {
        _mm_mask_storeu_epi8(static_cast<uint8_t*>(out) + i * out_stride + c0, m, _mm512_cvtepi32_epi8(code));
      }
    }
  }
}

using ColWordFn = void (*)(const uint32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*,
                           bool, void*, int64_t);
constexpr ColWordFn kColWordValues[] = {col_word_bits<1, true>, col_word_bits<2, true>, col_word_bits<3, true>,
                                        col_word_bits<4, true>, col_word_bits<5, true>, col_word_bits<6, true>,
                                        col_word_bits<7, true>, col_word_bits<8, true>};
constexpr ColWordFn kColWordCodes[] = {col_word_bits<1, false>, col_word_bits<2, false>, col_word_bits<3, false>,
                                       col_word_bits<4, false>, col_word_bits<5, false>, col_word_bits<6, false>,
                                       col_word_bits<7, false>, col_word_bits<8, false>};

// Whether col_word_bits runs here on planes of `words` words a column: AVX-512, and the gather's lane offsets (16
// columns' words) fit in int32.
bool col_word_bits_apply(int64_t words) { return cpu_has_avx512_vnni() && words <= (int64_t{1} << 26); }

// unpack_codes of rows [32·w, 32·w + live) of column-layout planes with AVX2, 8 columns at a time: each column's 32
// codes in one register (codes_of_32), then the 8 x 32 bytes transposed to 32 rows of 8 bytes (unpack stages of 8,
// 16 and 32 bits).
PYG_QUANT_TARGET_AVX2 void col_word_codes_avx2(const uint32_t* in, int64_t bits, int64_t plane_stride, int64_t words,
                                               int64_t cols, int64_t w, int64_t live, uint8_t* out,
                                               int64_t out_stride) {
  for (int64_t c0 = 0; c0 < cols; c0 += 8) {
    const int64_t n = std::min<int64_t>(8, cols - c0);
    __m256i v[8];
    for (int j = 0; j < 8; ++j) {
      v[j] = j < n ? codes_of_32(in + (c0 + j) * words + w, plane_stride, static_cast<int>(bits))
                   : _mm256_setzero_si256();
    }
    // Per 128-bit lane (rows 0-15 in the low lanes, 16-31 in the high ones): byte pairs, then quads, then 8 bytes a row.
    __m256i pairs[8], quads[8], rows8[8];
    for (int k = 0; k < 4; ++k) {
      pairs[k] = _mm256_unpacklo_epi8(v[2 * k], v[2 * k + 1]);      // rows 0-7 (16-23), columns 2k, 2k + 1
      pairs[4 + k] = _mm256_unpackhi_epi8(v[2 * k], v[2 * k + 1]);  // rows 8-15 (24-31)
    }
    for (int h = 0; h < 2; ++h) {  // h: rows 0-7 or 8-15 of the lane
      const __m256i* p = pairs + 4 * h;
      quads[4 * h + 0] = _mm256_unpacklo_epi16(p[0], p[1]);  // rows +0..3, columns 0-3
      quads[4 * h + 1] = _mm256_unpackhi_epi16(p[0], p[1]);  // rows +4..7, columns 0-3
      quads[4 * h + 2] = _mm256_unpacklo_epi16(p[2], p[3]);  // rows +0..3, columns 4-7
      quads[4 * h + 3] = _mm256_unpackhi_epi16(p[2], p[3]);  // rows +4..7, columns 4-7
    }
    for (int g = 0; g < 4; ++g) {  // g: rows 4g..4g+3 of the lane
      const __m256i left = quads[(g / 2) * 4 + g % 2], right = quads[(g / 2) * 4 + 2 + g % 2];
      rows8[2 * g] = _mm256_unpacklo_epi32(left, right);      // rows 4g, 4g + 1 (and + 16)
      rows8[2 * g + 1] = _mm256_unpackhi_epi32(left, right);  // rows 4g + 2, 4g + 3 (and + 16)
    }
    alignas(32) uint64_t row_bytes[32];
    for (int k = 0; k < 8; ++k) {  // rows8[k]: rows 2k, 2k + 1 in the low lane, 2k + 16, 2k + 17 in the high one
      alignas(32) uint64_t parts[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), rows8[k]);
      row_bytes[2 * k] = parts[0];
      row_bytes[2 * k + 1] = parts[1];
      row_bytes[2 * k + 16] = parts[2];
      row_bytes[2 * k + 17] = parts[3];
    }
    uint8_t* dst = out + 32 * w * out_stride + c0;
    if (n == 8) {
      for (int64_t i = 0; i < live; ++i) std::memcpy(dst + i * out_stride, &row_bytes[i], 8);
    } else {
      for (int64_t i = 0; i < live; ++i) {
        for (int64_t j = 0; j < n; ++j) dst[i * out_stride + j] = static_cast<uint8_t>(row_bytes[i] >> (8 * j));
      }
    }
  }
}
#endif

}  // namespace

#if defined(PYG_QUANT_X86_DISPATCH)
void dequantize_col_word_avx512(const uint32_t* planes, int64_t bits, int64_t plane_stride, int64_t words,
                                int64_t cols, int64_t w, int64_t live, const float* lo, const float* scale,
                                bool per_column, float* out, int64_t out_stride) {
  kColWordValues[bits - 1](planes, plane_stride, words, cols, w, live, lo, scale, per_column, out, out_stride);
}

bool dequantize_col_word_applies(const at::Tensor& planes, bool col_layout, int64_t dim) {
  return col_layout && dim != 1 && col_word_bits_apply(planes.size(2));
}
#endif

// Eight codes at a time (kSpreadBits), a word of 32 elements of one plane row at a time: column layout (a word holds
// 32 rows of one column) in blocks of 32 rows, row layout (32 columns of one row) row by row.
at::Tensor unpack_codes_cpu(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout) {
  check_unpack_shape(planes_in, rows, cols, col_layout);
  const auto planes = planes_in.contiguous();
  auto codes = at::empty({rows, cols}, planes.options().dtype(at::kByte));
  uint8_t* out = codes.data_ptr<uint8_t>();
  const int64_t bits = planes.size(0), words = planes.size(2), plane_stride = planes.stride(0);
  const uint32_t* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  if (col_layout) {
#if defined(PYG_QUANT_X86_DISPATCH)
    if (col_word_bits_apply(words)) {
      at::parallel_for(0, (rows + 31) / 32, 4, [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
          kColWordCodes[bits - 1](in, plane_stride, words, cols, w, std::min<int64_t>(32, rows - 32 * w), nullptr,
                                  nullptr, false, out + 32 * w * cols, cols);
        }
      });
      return codes;
    }
    if (cpu_has_avx2()) {
      at::parallel_for(0, (rows + 31) / 32, 4, [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
          col_word_codes_avx2(in, bits, plane_stride, words, cols, w, std::min<int64_t>(32, rows - 32 * w), out, cols);
        }
      });
      return codes;
    }
#endif
    at::parallel_for(0, (rows + 31) / 32, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        for (int64_t c = 0; c < cols; ++c) {
          const uint32_t* word = in + c * words + w;
          for (int k = 0; k < 4; ++k) {
            const int64_t r0 = 32 * w + 8 * k;
            if (r0 >= rows) break;
            const uint64_t v = eight_codes(word, bits, plane_stride, k);
            const int64_t live = std::min<int64_t>(8, rows - r0);
            for (int64_t i = 0; i < live; ++i) out[(r0 + i) * cols + c] = static_cast<uint8_t>(v >> (8 * i));
          }
        }
      }
    });
  } else {
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t c0 = 0; c0 < cols; c0 += 8) {
          const uint64_t v =
              eight_codes(in + r * words + (c0 >> 5), bits, plane_stride, static_cast<int>((c0 >> 3) & 3));
          const int64_t live = std::min<int64_t>(8, cols - c0);
          if (live == 8) {
            std::memcpy(out + r * cols + c0, &v, 8);  // bytes in address order: little-endian, as kSpreadBits
          } else {
            for (int64_t i = 0; i < live; ++i) out[r * cols + c0 + i] = static_cast<uint8_t>(v >> (8 * i));
          }
        }
      }
    });
  }
  return codes;
}

at::Tensor dequantize_cpu(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout,
                          const at::Tensor& lo_in, const at::Tensor& scale_in, int64_t dim) {
  check_unpack_shape(planes_in, rows, cols, col_layout);
  check_dequantize_ranges(planes_in, lo_in, scale_in, rows, cols, dim);
  // The codes first (unpack_codes: eight at a time), then to_val's float32 steps over contiguous rows, a loop the
  // compiler vectorizes: reading the planes bit by bit per element cost far more than the arithmetic.
  const auto lo_t = lo_in.contiguous(), scale_t = scale_in.contiguous();
  auto values = at::empty({rows, cols}, planes_in.options().dtype(at::kFloat));
  float* out = values.data_ptr<float>();
#if defined(PYG_QUANT_X86_DISPATCH)
  if (dequantize_col_word_applies(planes_in, col_layout, dim)) {
    // column layout, ranges per column or per tensor: a word of 32 rows at a time straight from the planes
    const auto planes = planes_in.contiguous();
    const uint32_t* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
    at::parallel_for(0, (rows + 31) / 32, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        dequantize_col_word_avx512(in, planes.size(0), planes.stride(0), planes.size(2), cols, w,
                                   std::min<int64_t>(32, rows - 32 * w), lo_t.data_ptr<float>(),
                                   scale_t.data_ptr<float>(), dim == 0, out + 32 * w * cols, cols);
      }
    });
    return values;
  }
#endif
  const at::Tensor codes = unpack_codes_cpu(planes_in, rows, cols, col_layout);
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const float* lo = lo_t.data_ptr<float>();
  const float* scale = scale_t.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* __restrict__ qr = q + r * cols;
      float* __restrict__ o = out + r * cols;
      if (dim == 0) {
        for (int64_t c = 0; c < cols; ++c) o[c] = value_of(qr[c], lo[c], scale[c]);
      } else {
        const float l = lo[dim < 0 ? 0 : r], s = scale[dim < 0 ? 0 : r];
        for (int64_t c = 0; c < cols; ++c) o[c] = value_of(qr[c], l, s);
      }
    }
  });
  return values;
}

at::Tensor pack_row_codes_cpu(const at::Tensor& planes_in, int64_t cols, bool col_layout) {
  const RowCodesShape shape = row_codes_shape(planes_in, cols, col_layout);
  const auto planes = planes_in.contiguous();
  const int64_t bits = shape.bits, words = shape.words, nodes = shape.nodes, row_bytes = shape.row_bytes;
  const int container = container_bits(bits);
  auto codes = at::zeros({nodes, row_bytes}, planes.options().dtype(at::kByte));
  const uint32_t* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  uint8_t* out = codes.data_ptr<uint8_t>();
  const int64_t plane_stride = planes.stride(0);
  at::parallel_for(0, nodes, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t* word = col_layout ? in + c * words + (r >> 5) : in + r * words + (c >> 5);
        const int shift = static_cast<int>(col_layout ? r & 31 : c & 31);
        uint32_t q = 0;
        for (int64_t p = 0; p < bits; ++p) q |= ((word[p * plane_stride] >> shift) & 1u) << p;
        const int64_t bit = c * container;
        out[r * row_bytes + (bit >> 3)] |= static_cast<uint8_t>(q << (bit & 7));
      }
    }
  });
  return codes;
}

at::Tensor planes_from_row_codes_cpu(const at::Tensor& row_codes, int64_t rows, int64_t cols, int64_t bits) {
  const PlanesFromRowCodesShape shape = planes_from_row_codes_shape(row_codes, rows, cols, bits);
  const int64_t words = shape.words, row_bytes = 4 * shape.row_words, plane_stride = shape.outer_pad * words;
  const int container = container_bits(bits);
  auto planes = at::zeros({bits, shape.outer_pad, words}, row_codes.options().dtype(at::kInt));
  const uint8_t* in = row_codes.data_ptr<uint8_t>();
  uint32_t* out = reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>());
  // A task a column: its words are its own (no two threads write one word).
  at::parallel_for(0, cols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t bit = c * container;
      for (int64_t r = 0; r < words * 32; ++r) {
        const uint32_t q = (static_cast<uint32_t>(in[r * row_bytes + (bit >> 3)]) >> (bit & 7)) &
                           ((1u << container) - 1u);
        for (int64_t p = 0; p < bits; ++p) out[p * plane_stride + c * words + (r >> 5)] |= ((q >> p) & 1u) << (r & 31);
      }
    }
  });
  return planes;
}

namespace {

#if defined(PYG_QUANT_X86_DISPATCH)
// Σ_p popcount(plane p of outer entries [o0, o1)) << p, eight words a vpopcntq.
__attribute__((target("avx512f,avx512vpopcntdq"))) void code_sums_avx512(const uint64_t* in, int64_t bits,
                                                                          int64_t outer, int64_t words64, int64_t o0,
                                                                          int64_t o1, int64_t* out) {
  const __mmask8 tail = static_cast<__mmask8>((1u << (words64 % 8)) - 1u);
  for (int64_t o = o0; o < o1; ++o) {
    int64_t total = 0;
    for (int64_t p = 0; p < bits; ++p) {
      const uint64_t* v = in + (p * outer + o) * words64;
      __m512i count = _mm512_setzero_si512();
      int64_t w = 0;
      for (; w + 8 <= words64; w += 8) count = _mm512_add_epi64(count, _mm512_popcnt_epi64(_mm512_loadu_si512(v + w)));
      if (tail != 0) count = _mm512_add_epi64(count, _mm512_popcnt_epi64(_mm512_maskz_loadu_epi64(tail, v + w)));
      total += _mm512_reduce_add_epi64(count) << p;
    }
    out[o] = total;
  }
}
#endif

}  // namespace

at::Tensor packed_code_sums_cpu(const at::Tensor& planes_in) {
  check_code_sums_planes(planes_in);
  TORCH_CHECK_VALUE(planes_in.size(2) % 2 == 0, "planes must have an even number of words");  // read as 64-bit words
  const auto planes = planes_in.contiguous();
  const int64_t bits = planes.size(0), outer = planes.size(1), words64 = planes.size(2) / 2;
  auto sums = at::empty({outer}, planes.options().dtype(at::kLong));
  const int32_t* in = planes.data_ptr<int32_t>();
  int64_t* out = sums.data_ptr<int64_t>();
#if defined(PYG_QUANT_X86_DISPATCH)
  if (cpu_has_avx512_popcnt()) {
    at::parallel_for(0, outer, 64, [&](int64_t begin, int64_t end) {
      code_sums_avx512(as_u64(in), bits, outer, words64, begin, end, out);
    });
    return sums;
  }
#endif
  at::parallel_for(0, outer, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      int64_t total = 0;
      for (int64_t p = 0; p < bits; ++p) {
        const uint64_t* v = as_u64(in + (p * outer + o) * words64 * 2);
        int64_t count = 0;
        for (int64_t w = 0; w < words64; ++w) count += popcount64(v[w]);
        total += count << p;
      }
      out[o] = total;
    }
  });
  return sums;
}

namespace {

// Ranges as float32 [groups] lo, scale and inverse scale (three tensors: an op's outputs may not share storage),
// each group's written by `range`.
template <typename RangeOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor> range_rows(int64_t groups, const at::TensorOptions& options,
                                                          RangeOf range) {
  const auto f32 = options.dtype(at::kFloat);
  at::Tensor lo = at::empty({groups}, f32), scale = at::empty({groups}, f32), inv = at::empty({groups}, f32);
  float *lp = lo.data_ptr<float>(), *sp = scale.data_ptr<float>(), *ip = inv.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g) {
    const Range r = range(g);
    lp[g] = r.lo;
    sp[g] = r.scale;
    ip[g] = r.inv;
  }
  return {lo, scale, inv};
}

// The per-column ranges that column keys describe, with range_of's float32 steps (those of
// quantize_pack_ranges_composed: the same subtraction, divisions and zero test).
std::tuple<at::Tensor, at::Tensor, at::Tensor> ranges_from_col_keys(const at::Tensor& col_keys, int64_t bits) {
  const int64_t cols = col_keys.size(0) / 2;
  const int64_t* k = col_keys.data_ptr<int64_t>();
  const float max_code = static_cast<float>((1 << bits) - 1);
  return range_rows(cols, col_keys.options(), [&](int64_t c) {
    float mn, mx;
    column_extrema(static_cast<uint64_t>(k[c]), static_cast<uint64_t>(k[cols + c]), mn, mx);
    return range_of(mn, mx, max_code);
  });
}

// x's own ranges per column (dim 0) or per row (dim 1), as amin / amax and range_of give them: a NaN in a group makes
// both ends NaN.  (Which zero a zero extremum is, -0 or +0, amin leaves to its vector lanes; no code or value depends
// on it.)  Loops, not tensor ops: a layer's output has few columns, and a dozen small ops cost more than the pack.
std::tuple<at::Tensor, at::Tensor, at::Tensor> own_ranges(const at::Tensor& x, int64_t bits, int64_t dim) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float max_code = static_cast<float>((1 << bits) - 1);
  if (dim == 1) {
    return range_rows(rows, x.options(), [&](int64_t r) { return row_range(xp + r * cols, cols, max_code); });
  }
  // per column: one pass over the rows, each column's extrema and NaN flag in a row of accumulators
  std::vector<float> mn(xp, xp + cols), mx(xp, xp + cols);
  std::vector<int32_t> nan(cols, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xp + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = row[c];
      nan[c] |= v != v;
      mn[c] = v < mn[c] ? v : mn[c];
      mx[c] = v > mx[c] ? v : mx[c];
    }
  }
  return range_rows(cols, x.options(), [&](int64_t c) {
    return nan[c] ? range_of(NAN, NAN, max_code) : range_of(mn[c], mx[c], max_code);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_ranges_cpu(
    const at::Tensor& x_in, int64_t bits, int64_t dim, bool col_layout, const std::optional<at::Tensor>& noise,
    bool row_codes, const std::optional<at::Tensor>& col_keys, bool code_sums) {
  check_quantize_ranges_args(x_in, bits, dim, col_layout, noise, col_keys);
  const at::Tensor x = x_in.contiguous();
  const auto [lo, scale, inv] = col_keys.has_value() ? ranges_from_col_keys(*col_keys, bits) : own_ranges(x, bits, dim);
  // lo / inv broadcast along the other dimension
  const auto shape = [&](const at::Tensor& t) { return dim == 0 ? t.view({1, -1}) : t.view({-1, 1}); };
  const at::Tensor planes = quantize_pack_cpu(x, shape(lo), shape(inv), bits, col_layout, noise);
  const QuantizedRanges ranges{planes, lo, scale, code_sums_if(code_sums, packed_code_sums_cpu)(planes)};
  return with_row_codes(ranges, x.size(1), col_layout, row_codes, pack_row_codes_cpu);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_stored_ranges_cpu(
    const at::Tensor& x, int64_t bits, const std::optional<at::Tensor>& col_keys, const at::Tensor& stored_keys,
    bool row_codes, bool code_sums) {
  check_quantize_ranges_args(x, bits, 0, true, std::nullopt, col_keys);
  check_col_keys(stored_keys, x.size(1), x.device(), "x", "stored_keys");
  at::Tensor keys = stored_keys;
  if (col_keys.has_value()) {
    // a column is finite when neither of its slots holds a non-finite value's key (one loop: a few columns)
    const int64_t cols = x.size(1);
    keys = stored_keys.clone();
    const int64_t* seen = col_keys->data_ptr<int64_t>();
    int64_t* k = keys.data_ptr<int64_t>();
    for (int64_t c = 0; c < cols; ++c) {
      if (std::max(seen[c], seen[cols + c]) >= static_cast<int64_t>(kNonFiniteKey)) k[c] = k[cols + c] = kNanKey;
    }
  }
  return quantize_pack_ranges_cpu(x, bits, 0, true, std::nullopt, row_codes, keys, code_sums);
}

}  // namespace pyg_quant
