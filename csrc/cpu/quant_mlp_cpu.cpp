// quant_mlp on the CPU: a block of rows through every layer at once, each layer's integer products one int8 GEMM of
// the rows' codes and the weight codes (int8_gemm.h), the per-row quantization and the affine epilogue in AVX-512
// where the CPU has it (the portable loops otherwise, with the same results).
#include "quant_mlp_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "cpu_features.h"
#include "epilogue.h"
#include "epilogue_avx512.h"
#include "int8_gemm.h"
#include "ordered_key.h"
#include "quant_mlp_args.h"
#include "quantize_cpu.h"
#include "quantize_steps.h"
#include "row_codes.h"
#include "scratch.h"
#include "unpack_avx2.h"
#include "unpack_avx512.h"

namespace pyg_quant {
namespace {

struct Layer {
  const uint8_t* w;  // [out, in]
  const float* lo;
  const float* scale;
  const int64_t* sums;
  const float* col_term;  // bitmm_col_term of each output column
  const float* bias;  // nullptr: none
  int64_t in, out;
  float max_code;
  bool relu;
};

// A row's range, its codes and their sum.
template <typename Code>
int64_t quantize_row(const float* h, int64_t in, float max_code, Code* codes, Range* range) {
  *range = row_range(h, in, max_code);
  int64_t row_sum = 0;
  for (int64_t c = 0; c < in; ++c) {
    const uint32_t q = code_of(h[c], *range, 0.5f, max_code);
    codes[c] = static_cast<Code>(q);
    row_sum += q;
  }
  return row_sum;
}

#if defined(PYG_QUANT_X86_DISPATCH)
// row_range 16 values at a time.  The extrema are order-free but for the sign of a zero: the scalar loop keeps the
// first of equal values, so a zero extremum takes the sign of the row's first zero.
PYG_QUANT_TARGET_AVX512 Range row_range_avx512(const float* h, int64_t in, float max_code) {
  const __m512 first = _mm512_set1_ps(h[0]);  // past the row's end: a value of the row, neutral for both extrema
  __m512 mn = first, mx = first;
  __mmask16 nan = 0;
  for (int64_t c = 0; c < in; c += 16) {
    const __mmask16 m = static_cast<__mmask16>(in - c >= 16 ? 0xffff : (1u << (in - c)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(first, m, h + c);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mn = _mm512_min_ps(mn, v);
    mx = _mm512_max_ps(mx, v);
  }
  if (nan) return range_of(NAN, NAN, max_code);
  float lo = _mm512_reduce_min_ps(mn), hi = _mm512_reduce_max_ps(mx);
  if (lo == 0.0f || hi == 0.0f) {
    int64_t c = 0;
    while (h[c] != 0.0f) ++c;  // there is one: an extremum is 0
    lo = lo == 0.0f ? h[c] : lo;
    hi = hi == 0.0f ? h[c] : hi;
  }
  return range_of(lo, hi, max_code);
}

// quantize_row's codes and their sum, 16 values at a time: the same float32 steps as code_of (x − lo, times inv, plus
// one half, each rounded; a NaN or a negative goes to 0 and the top clamps to max_code, as its two comparisons do),
// truncated to int32 (the value is in [0, max_code]).
PYG_QUANT_TARGET_AVX512 int64_t codes_avx512(const float* h, int64_t in, Range range, float max_code, int8_t* codes,
                                             bool shift) {
  const __m512i flip = _mm512_set1_epi32(shift ? 0x80 : 0);
  const __m512 lo = _mm512_set1_ps(range.lo), inv = _mm512_set1_ps(range.inv), half = _mm512_set1_ps(0.5f);
  const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(max_code);
  __m512i total = _mm512_setzero_si512();
  for (int64_t c = 0; c < in; c += 16) {
    const __mmask16 m = static_cast<__mmask16>(in - c >= 16 ? 0xffff : (1u << (in - c)) - 1u);
    __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, h + c), lo), inv), half);
    t = _mm512_min_ps(_mm512_max_ps(t, zero), top);  // max(NaN, 0) is 0: maxps returns its second operand
    const __m512i q = _mm512_maskz_cvttps_epi32(m, t);
    total = _mm512_add_epi32(total, q);
    _mm_mask_storeu_epi8(codes + c, m, _mm512_cvtepi32_epi8(_mm512_xor_si512(q, flip)));  // 8-bit: less 128
  }
  return _mm512_reduce_add_epi32(total);
}

// row_range_avx512 and codes_avx512 with AVX2, 8 values at a time, the last few of a row by the scalar steps.
PYG_QUANT_TARGET_AVX2 Range row_range_avx2(const float* h, int64_t in, float max_code) {
  __m256 mn = _mm256_set1_ps(h[0]), mx = mn, nan = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= in; c += 8) {
    const __m256 v = _mm256_loadu_ps(h + c);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mn = _mm256_min_ps(mn, v);
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float lows[8], highs[8];
  _mm256_store_ps(lows, mn);
  _mm256_store_ps(highs, mx);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  float lo = lows[0], hi = highs[0];
  for (int j = 1; j < 8; ++j) {
    lo = lows[j] < lo ? lows[j] : lo;
    hi = highs[j] > hi ? highs[j] : hi;
  }
  for (; c < in; ++c) {
    any_nan |= h[c] != h[c];
    lo = h[c] < lo ? h[c] : lo;
    hi = h[c] > hi ? h[c] : hi;
  }
  if (any_nan) return range_of(NAN, NAN, max_code);
  if (lo == 0.0f || hi == 0.0f) {
    c = 0;
    while (h[c] != 0.0f) ++c;  // there is one: an extremum is 0
    lo = lo == 0.0f ? h[c] : lo;
    hi = hi == 0.0f ? h[c] : hi;
  }
  return range_of(lo, hi, max_code);
}

PYG_QUANT_TARGET_AVX2 int64_t codes_avx2(const float* h, int64_t in, Range range, float max_code, int8_t* codes,
                                         bool shift) {
  const __m256i flip = _mm256_set1_epi32(shift ? 0x80 : 0);
  // the low byte of each int32 lane, lane 0's four then lane 1's, in the low 8 bytes
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i gather = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
  const __m256 lo = _mm256_set1_ps(range.lo), inv = _mm256_set1_ps(range.inv), half = _mm256_set1_ps(0.5f);
  const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(max_code);
  __m256i total = _mm256_setzero_si256();
  int64_t c = 0;
  for (; c + 8 <= in; c += 8) {
    __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(h + c), lo), inv), half);
    t = _mm256_min_ps(_mm256_max_ps(t, zero), top);  // max(NaN, 0) is 0: maxps returns its second operand
    const __m256i q = _mm256_cvttps_epi32(t);
    total = _mm256_add_epi32(total, q);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(_mm256_xor_si256(q, flip), low_bytes),
                                                      gather);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + c), _mm256_castsi256_si128(bytes));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  int64_t sum = 0;
  for (int j = 0; j < 8; ++j) sum += lanes[j];
  for (; c < in; ++c) {
    const uint32_t q = code_of(h[c], range, 0.5f, max_code);
    sum += q;
    codes[c] = static_cast<int8_t>(shift ? q ^ 0x80u : q);
  }
  return sum;
}
#endif

// Rows of the int8 path a block: its buffers stay a few MB however many rows x has (a multiple of 32, so that a
// block starts at a word of column-layout codes).
constexpr int64_t kInt8BlockRows = 2048;

// The chain's input as contiguous column-layout codes with ranges per column or one range (dequantize_col_word_avx512
// reads them), in place of float rows.
struct ColCodes {
  const uint32_t* planes;
  int64_t bits, plane_stride, words;
  const float* lo;
  const float* scale;
  bool per_column;
};

// The chain's input as row-layout codes taken as they are (the first product's operand), ranges per row or one range.
struct RowCodes {
  const uint32_t* planes;
  int64_t bits, plane_stride, words;  // in 32-bit words
  const float* lo;
  const float* scale;
  bool per_row;
  const uint8_t* bytes = nullptr;  // or the codes themselves, uint8 [rows, cols] (planes unused)
};

// Row r of `in` as bytes at dst (the first `cols` codes; with `shift`, each less 128); returns the row's code sum.
// Codes held as bytes are written to dst only when shifted (unshifted, the GEMM reads them in place).
int64_t unpack_row(const RowCodes& in, int64_t r, int64_t cols, int8_t* dst, bool shift, bool avx512, bool avx2) {
  uint8_t* out = reinterpret_cast<uint8_t*>(dst);
  if (in.bytes != nullptr) {
    const uint8_t* row = in.bytes + r * cols;
    if (shift) {
      for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<uint8_t>(row[c] ^ 0x80u);
    }
    return byte_sum(row, cols);
  }
#if defined(PYG_QUANT_X86_DISPATCH)
  if (avx512 || avx2) {
    return (avx512 ? unpack_row_avx512 : unpack_row_avx2)(reinterpret_cast<const uint64_t*>(in.planes),
                                                          in.plane_stride / 2, static_cast<int>(in.bits), r,
                                                          in.words / 2, cols, out, shift);
  }
#endif
  int64_t sum = 0;
  const uint32_t* row = in.planes + r * in.words;
  for (int64_t c = 0; c < cols; ++c) {
    uint32_t q = 0;
    for (int64_t p = 0; p < in.bits; ++p) q |= ((row[p * in.plane_stride + (c >> 5)] >> (c & 31)) & 1u) << p;
    sum += q;
    out[c] = static_cast<uint8_t>(shift ? q ^ 0x80u : q);
  }
  return sum;
}

// The last steps of a row of quant_mlp_rows' output from column `from` on: each value times the row's `scale` (when
// given), then the max of its column key and of its min slot's complement into `keys` (when given; ordered_key.h).
inline void finish_row(float* row, int64_t from, int64_t cols, const float* scale, uint32_t* keys) {
  for (int64_t o = from; o < cols; ++o) {
    if (scale != nullptr) row[o] = row[o] * *scale;
    if (keys != nullptr) {
      keys[o] = std::max(keys[o], ordered_key(row[o]));
      keys[cols + o] = std::max(keys[cols + o], min_slot_key(row[o]));
    }
  }
}

// finish_row of `n` rows (`scale`: one a row).
inline void finish_rows(float* rows, int64_t n, int64_t cols, const float* scale, uint32_t* keys) {
  for (int64_t r = 0; r < n; ++r) finish_row(rows + r * cols, 0, cols, scale != nullptr ? scale + r : nullptr, keys);
}

#if defined(PYG_QUANT_X86_DISPATCH)
// finish_rows with AVX2, 8 columns at a time (a key flips a negative value's bits and sets a positive one's sign bit).
PYG_QUANT_TARGET_AVX2 void finish_rows_avx2(float* rows, int64_t n, int64_t cols, const float* scale,
                                            uint32_t* keys) {
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i ones = _mm256_set1_epi32(-1);
  for (int64_t r = 0; r < n; ++r) {
    float* row = rows + r * cols;
    const __m256 s = _mm256_set1_ps(scale != nullptr ? scale[r] : 1.0f);
    int64_t o = 0;
    for (; o + 8 <= cols; o += 8) {
      __m256 v = _mm256_loadu_ps(row + o);
      if (scale != nullptr) {
        v = _mm256_mul_ps(v, s);
        _mm256_storeu_ps(row + o, v);
      }
      if (keys != nullptr) {
        const __m256i b = _mm256_castps_si256(v);
        const __m256i key = _mm256_xor_si256(b, _mm256_or_si256(_mm256_srai_epi32(b, 31), sign));
        __m256i* hi = reinterpret_cast<__m256i*>(keys + o);
        __m256i* lo = reinterpret_cast<__m256i*>(keys + cols + o);
        _mm256_storeu_si256(hi, _mm256_max_epu32(_mm256_loadu_si256(hi), key));
        _mm256_storeu_si256(lo, _mm256_max_epu32(_mm256_loadu_si256(lo), _mm256_xor_si256(key, ones)));
      }
    }
    finish_row(row, o, cols, scale != nullptr ? scale + r : nullptr, keys);
  }
}
#endif

// quant_mlp of `x_in` (float32 rows), or of the values of `col_codes` (x_in: their planes), or with `row_codes` (x_in:
// their planes) as the first layer's quantized input, with `rows` rows; widths from the caller's argument check.
at::Tensor quant_mlp_rows(const at::Tensor& x_in, const ColCodes* col_codes, const RowCodes* row_codes, int64_t rows,
                          const std::vector<int64_t>& widths, at::TensorList weight_codes, at::TensorList weight_lo,
                          at::TensorList weight_scale, at::TensorList weight_sums,
                          const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                          at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                          const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys) {
  const int64_t layers = static_cast<int64_t>(weight_codes.size());
  const bool packed = col_codes != nullptr || row_codes != nullptr;
  const at::Tensor x = packed ? x_in : x_in.contiguous();
  std::vector<at::Tensor> keep;  // contiguous copies live until the end
  std::vector<Layer> plan;
  std::vector<std::vector<float>> col_terms;  // each layer's own buffer (moved, never copied, as plan grows)
  for (int64_t l = 0; l < layers; ++l) {
    keep.push_back(weight_codes[l].contiguous());
    keep.push_back(weight_lo[l].contiguous());
    keep.push_back(weight_scale[l].contiguous());
    keep.push_back(weight_sums[l].contiguous());
    const std::optional<at::Tensor> b = bias.get(l);
    keep.push_back(b.has_value() ? b->contiguous() : at::Tensor());
    const size_t i = keep.size() - 5;
    col_terms.push_back(bitmm_col_terms(widths[l], keep[i + 1].data_ptr<float>(), keep[i + 2].data_ptr<float>(),
                                        keep[i + 3].data_ptr<int64_t>(), widths[l + 1]));
    plan.push_back({keep[i].data_ptr<uint8_t>(), keep[i + 1].data_ptr<float>(), keep[i + 2].data_ptr<float>(),
                    keep[i + 3].data_ptr<int64_t>(), col_terms.back().data(),
                    keep[i + 4].defined() ? keep[i + 4].data_ptr<float>() : nullptr,
                    widths[l], widths[l + 1], static_cast<float>((1 << act_bits[l]) - 1), relu.get(l)});
  }
  const int64_t out_cols = widths.back();
  auto out = at::empty({rows, out_cols}, x.options().dtype(at::kFloat));
  if (rows == 0) return out;
  const int64_t max_width = *std::max_element(widths.begin(), widths.end());
  const float* xp = packed ? nullptr : x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const at::Tensor scales = row_scale.has_value() ? row_scale->contiguous() : at::Tensor();
  const float* sp = scales.defined() ? scales.data_ptr<float>() : nullptr;
  // col_keys: each task reduces its rows' keys (max slots, then min slots) and merges them once.
  int64_t* keys = col_keys.has_value() ? col_keys->data_ptr<int64_t>() : nullptr;
  std::mutex keys_mutex;
  const auto merge_keys = [&](const std::vector<uint32_t>& task_keys) {
    if (keys == nullptr) return;
    const std::lock_guard<std::mutex> lock(keys_mutex);
    for (int64_t i = 0; i < 2 * out_cols; ++i) keys[i] = std::max<int64_t>(keys[i], task_keys[i]);
  };
  {
    // A block of rows at a time, layer by layer: the rows' codes (int8; 8-bit codes less 128), one int8 GEMM against
    // the layer's weight codes (int8_gemm) for the integer products, then each row's epilogue;
    // the same integers and the same epilogue as a row-at-a-time loop, several times faster.  With a = a' + 128 and
    // w = w' + 128 where shifted, Σ a·w = Σ a'·w' + 128·Σ w·[a shifted] + 128·Σ a·[w shifted] − 128²·K·[both],
    // every term exact in int32 (check_quant_mlp_args bounds K·(2^a − 1)·(2^w − 1)).
    const int64_t block = std::min(rows, kInt8BlockRows);
    int64_t weight_bytes = 0;
    for (const Layer& layer : plan) weight_bytes += layer.in * layer.out;
    // codes of x: each thread's values of a word of rows
    const int64_t word_floats = col_codes != nullptr ? at::get_num_threads() * 32 * widths[0] : 0;
    Scratch scratch(2 * block * max_width * sizeof(float) + block * max_width * (1 + sizeof(int32_t)) +
                    block * (sizeof(Range) + sizeof(int64_t) + 2 * sizeof(float)) + weight_bytes +
                    word_floats * sizeof(float) + (9 + layers) * 64);
    float* buffer_a = scratch.take<float>(block * max_width);
    float* buffer_b = scratch.take<float>(block * max_width);
    int8_t* codes = scratch.take<int8_t>(block * max_width);
    int32_t* products = scratch.take<int32_t>(block * max_width);
    Range* ranges = scratch.take<Range>(block);
    int64_t* row_sums = scratch.take<int64_t>(block);
    float* row_lo = scratch.take<float>(block);
    float* row_scale = scratch.take<float>(block);
    float* word_values = scratch.take<float>(word_floats);
    std::vector<const int8_t*> weights;  // [out, in] weight codes (8-bit ones less 128)
    for (int64_t l = 0; l < layers; ++l) {
      const Layer& layer = plan[l];
      const uint8_t* w = layer.w;
      if (weight_bits[l] == 8) {
        uint8_t* shifted = reinterpret_cast<uint8_t*>(scratch.take<int8_t>(layer.in * layer.out));
        for (int64_t i = 0; i < layer.in * layer.out; ++i) shifted[i] = w[i] ^ 0x80u;
        w = shifted;
      }
      weights.push_back(reinterpret_cast<const int8_t*>(w));
    }
#if defined(PYG_QUANT_X86_DISPATCH)
    const bool vector = cpu_has_avx512_vnni(), vector_epilogue = cpu_has_avx512_dq();
    const bool avx2 = !vector && cpu_has_avx2();
#else
    const bool vector = false, avx2 = false;
#endif
    std::vector<uint32_t> all_keys(keys != nullptr ? 2 * out_cols : 0, 0u);
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t n = std::min(block, rows - r0);
      const float* h = xp + r0 * widths[0];
      for (int64_t l = 0; l < layers; ++l) {
        const Layer& layer = plan[l];
        const bool last = l + 1 == layers, shift_a = act_bits[l] == 8, shift_w = weight_bits[l] == 8;
        float* next = last ? op + r0 * out_cols : (l % 2 == 0 ? buffer_a : buffer_b);
        // Row i of the block (its values at `row`): its range, codes and code sum.
        const auto quantize = [&](int64_t i, const float* row) {
          int8_t* row_codes = codes + i * layer.in;
#if defined(PYG_QUANT_X86_DISPATCH)
          if (vector || avx2) {
            ranges[i] = (vector ? row_range_avx512 : row_range_avx2)(row, layer.in, layer.max_code);
            row_sums[i] = (vector ? codes_avx512 : codes_avx2)(row, layer.in, ranges[i], layer.max_code, row_codes,
                                                              shift_a);
          } else
#endif
          {
            row_sums[i] = quantize_row(row, layer.in, layer.max_code, reinterpret_cast<uint8_t*>(row_codes),
                                       &ranges[i]);
            if (shift_a) {
              for (int64_t c = 0; c < layer.in; ++c) row_codes[c] = static_cast<int8_t>(row_codes[c] ^ 0x80);
            }
          }
          row_lo[i] = ranges[i].lo;
          row_scale[i] = ranges[i].scale;
        };
        const int8_t* gemm_codes = codes;  // the GEMM's operand, layer.in bytes a row
        if (l == 0 && row_codes != nullptr) {
          // Codes of x taken as they are: each row's bytes and code sum, its range x's own (no range, no rounding).
          // Codes given as bytes of up to 7 bits are the GEMM's operand where they lie.
          const RowCodes& in = *row_codes;
          const bool in_place = in.bytes != nullptr && !shift_a;
          if (in_place) gemm_codes = reinterpret_cast<const int8_t*>(in.bytes + r0 * layer.in);
          at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              const int64_t r = r0 + i, g = in.per_row ? r : 0;
              row_sums[i] = unpack_row(in, r, layer.in, in_place ? nullptr : codes + i * layer.in, shift_a, vector,
                                       avx2);
              row_lo[i] = in.lo[g];
              row_scale[i] = in.scale[g];
              ranges[i] = {in.lo[g], in.scale[g], 0.0f};
            }
          });
        } else
#if defined(PYG_QUANT_X86_DISPATCH)
        if (l == 0 && col_codes != nullptr) {
          // Codes of x: a word of 32 rows at a time to floats in the thread's buffer (in cache), quantized from
          // there, so that the values of x are never stored whole.
          const ColCodes& in = *col_codes;
          at::parallel_for(0, (n + 31) / 32, 1, [&](int64_t begin, int64_t end) {
            float* values = word_values + at::get_thread_num() * 32 * layer.in;
            for (int64_t g = begin; g < end; ++g) {
              const int64_t live = std::min<int64_t>(32, n - 32 * g);
              dequantize_col_word_avx512(in.planes, in.bits, in.plane_stride, in.words, layer.in, (r0 >> 5) + g, live,
                                         in.lo, in.scale, in.per_column, values, layer.in);
              for (int64_t j = 0; j < live; ++j) quantize(32 * g + j, values + j * layer.in);
            }
          });
        } else
#endif
        {
          at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) quantize(i, h + i * layer.in);
          });
        }
        int8_gemm(at::from_blob(products, {n, layer.out}, x.options().dtype(at::kInt)), gemm_codes, layer.in, n,
                  act_bits[l], weights[l], layer.in, layer.out, weight_bits[l], layer.in);
        const int32_t* pp = products;
        at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
          if (shift_a || shift_w) {
            const int64_t both = shift_a && shift_w ? 128 * 128 * layer.in : 0;
            for (int64_t i = begin; i < end; ++i) {
              const int64_t row_term = shift_w ? 128 * row_sums[i] : 0;
              for (int64_t o = 0; o < layer.out; ++o) {
                products[i * layer.out + o] = static_cast<int32_t>(
                    products[i * layer.out + o] + row_term + (shift_a ? 128 * layer.sums[o] : 0) - both);
              }
            }
          }
#if defined(PYG_QUANT_X86_DISPATCH)
          if (vector_epilogue) {
            bitmm_affine_rows_avx512(pp, row_sums, layer.col_term, row_lo, row_scale, layer.lo, layer.scale,
                                     layer.bias, layer.relu, layer.out, begin, end, next);
            return;
          }
          if (avx2) {
            bitmm_affine_rows_avx2(pp, row_sums, layer.col_term, row_lo, row_scale, layer.lo, layer.scale,
                                   layer.bias, layer.relu, layer.out, begin, end, next);
            return;
          }
#endif
          for (int64_t i = begin; i < end; ++i) {
            const float rs = static_cast<float>(row_sums[i]);
            for (int64_t o = 0; o < layer.out; ++o) {
              next[i * layer.out + o] = bitmm_affine_epilogue(
                  static_cast<float>(pp[i * layer.out + o]), rs, layer.col_term[o], ranges[i].lo, ranges[i].scale,
                  layer.lo[o], layer.scale[o], layer.bias ? layer.bias[o] : 0.0f, layer.relu);
            }
          }
        });
        h = next;
      }
      // The rows' last steps: the row scale, then their share of the column keys.
#if defined(PYG_QUANT_X86_DISPATCH)
      const auto finish = (vector || avx2) ? &finish_rows_avx2 : &finish_rows;
#else
      const auto finish = &finish_rows;
#endif
      finish(op + r0 * out_cols, n, out_cols, sp != nullptr ? sp + r0 : nullptr,
             keys != nullptr ? all_keys.data() : nullptr);
    }
    merge_keys(all_keys);
    return out;
  }
}

}  // namespace

at::Tensor quant_mlp_cpu(const at::Tensor& x, at::TensorList weight_codes, at::TensorList weight_lo,
                         at::TensorList weight_scale, at::TensorList weight_sums,
                         const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                         at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                         const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys) {
  const std::vector<int64_t> widths = check_quant_mlp_args(x, weight_codes, weight_lo, weight_scale, weight_sums,
                                                           bias, act_bits, weight_bits, relu, row_scale, col_keys);
  return quant_mlp_rows(x, nullptr, nullptr, x.size(0), widths, weight_codes, weight_lo, weight_scale, weight_sums, bias,
                        act_bits, weight_bits, relu, row_scale, col_keys);
}

at::Tensor quant_mlp_planes_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                                at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                                at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                const std::optional<at::Tensor>& row_scale,
                                const std::optional<at::Tensor>& col_keys) {
  const std::vector<int64_t> widths =
      check_quant_mlp_planes_args(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo,
                                  weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
#if defined(PYG_QUANT_X86_DISPATCH)
  if (dequantize_col_word_applies(planes, col_layout, dim)) {
    // The first layer dequantizes a word of rows at a time into cache and quantizes it per row right away (the same
    // floats, the same codes): the whole float matrix cost more than the product.
    const at::Tensor contiguous = planes.contiguous(), lo_t = lo.contiguous(), scale_t = scale.contiguous();
    const ColCodes col_codes{reinterpret_cast<const uint32_t*>(contiguous.data_ptr<int32_t>()), contiguous.size(0),
                             contiguous.stride(0), contiguous.size(2), lo_t.data_ptr<float>(),
                             scale_t.data_ptr<float>(), dim == 0};
    return quant_mlp_rows(contiguous, &col_codes, nullptr, rows, widths, weight_codes, weight_lo, weight_scale,
                          weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
  }
#endif
  // Otherwise the definition itself.
  return quant_mlp_cpu(dequantize_cpu(planes, rows, cols, col_layout, lo, scale, dim), weight_codes, weight_lo,
                       weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
}

namespace {

// quant_mlp_quantized of the codes as bytes, uint8 [rows, cols] (what the loader stores): the rows are read as they
// are, with no planes packed and unpacked between.
at::Tensor quant_mlp_byte_codes(const at::Tensor& codes, int64_t rows, int64_t cols, const at::Tensor& lo,
                                const at::Tensor& scale, int64_t dim, at::TensorList weight_codes,
                                at::TensorList weight_lo, at::TensorList weight_scale, at::TensorList weight_sums,
                                const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                const std::optional<at::Tensor>& row_scale,
                                const std::optional<at::Tensor>& col_keys) {
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.size(0) == rows && codes.size(1) == cols, "planes given as codes must "
                    "be uint8 [rows=", rows, ", cols=", cols, "], got ", codes.sizes());
  check_dequantize_ranges(codes, lo, scale, rows, cols, dim);
  const std::vector<int64_t> widths =
      check_quant_mlp_layers(rows, cols, codes.device(), "planes", weight_codes, weight_lo, weight_scale, weight_sums,
                             bias, act_bits, weight_bits, relu, row_scale, col_keys);
  const at::Tensor contiguous = codes.contiguous(), lo_t = lo.contiguous(), scale_t = scale.contiguous();
  const uint8_t* bytes = contiguous.data_ptr<uint8_t>();
  const uint8_t largest = largest_code(bytes, rows * cols);
  TORCH_CHECK_VALUE(largest < (int64_t{1} << act_bits[0]), "planes holds the code ", static_cast<int>(largest),
                    ", more than the first layer's act_bits (", act_bits[0], ") allow");
  RowCodes row_codes{nullptr, 0, 0, 0, lo_t.data_ptr<float>(), scale_t.data_ptr<float>(), dim == 1};
  row_codes.bytes = bytes;
  return quant_mlp_rows(contiguous, nullptr, &row_codes, rows, widths, weight_codes, weight_lo, weight_scale,
                        weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
}

}  // namespace

at::Tensor quant_mlp_quantized_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                   const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                   at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                                   at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                                   at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                   const std::optional<at::Tensor>& row_scale,
                                   const std::optional<at::Tensor>& col_keys) {
  TORCH_CHECK_VALUE(!col_layout, "planes must be in the row layout (col_layout=False): the codes are the product's "
                    "operand as they are");
  TORCH_CHECK_VALUE(dim != 0, "planes must have ranges per row (dim=1) or one range (dim=-1), got dim=0: ranges per "
                    "column do not factor out of the product");
  if (planes.scalar_type() == at::kByte) return quant_mlp_byte_codes(planes, rows, cols, lo, scale, dim, weight_codes,
                                                                     weight_lo, weight_scale, weight_sums, bias,
                                                                     act_bits, weight_bits, relu, row_scale, col_keys);
  const std::vector<int64_t> widths =
      check_quant_mlp_planes_args(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo,
                                  weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
  TORCH_CHECK_VALUE(planes.size(0) <= act_bits[0], "planes hold ", planes.size(0), "-bit codes, more than the first "
                    "layer's act_bits (", act_bits[0], ")");
  const at::Tensor contiguous = planes.contiguous(), lo_t = lo.contiguous(), scale_t = scale.contiguous();
  // The AVX-512 unpacker reads 64-bit words: a row's words are padded to 256 bits, so they pair up.
  TORCH_CHECK_VALUE(contiguous.size(2) % 2 == 0, "planes must hold an even number of words a row, got ",
                    contiguous.size(2));
  const RowCodes row_codes{reinterpret_cast<const uint32_t*>(contiguous.data_ptr<int32_t>()), contiguous.size(0),
                           contiguous.stride(0), contiguous.size(2), lo_t.data_ptr<float>(),
                           scale_t.data_ptr<float>(), dim == 1};
  return quant_mlp_rows(contiguous, nullptr, &row_codes, rows, widths, weight_codes, weight_lo, weight_scale,
                        weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
}

namespace {

// The definition of the row-codes ops: the float chain's output quantized per column with the fixed ranges
// (quantize_pack, column layout), as packed row codes (pack_row_codes).
at::Tensor output_row_codes(const at::Tensor& out, const at::Tensor& out_lo, const at::Tensor& out_inv_scale,
                            int64_t out_bits) {
  const at::Tensor planes = quantize_pack_cpu(out, out_lo.view({1, -1}), out_inv_scale.view({1, -1}), out_bits,
                                              /*col_layout=*/true, std::nullopt);
  return pack_row_codes_cpu(planes, out.size(1), /*col_layout=*/true);
}

}  // namespace

at::Tensor quant_mlp_row_codes_cpu(const at::Tensor& x, at::TensorList weight_codes, at::TensorList weight_lo,
                                   at::TensorList weight_scale, at::TensorList weight_sums,
                                   const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                   at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                   const std::optional<at::Tensor>& row_scale, const at::Tensor& out_lo,
                                   const at::Tensor& out_inv_scale, int64_t out_bits) {
  const std::vector<int64_t> widths = check_quant_mlp_args(x, weight_codes, weight_lo, weight_scale, weight_sums,
                                                           bias, act_bits, weight_bits, relu, row_scale, std::nullopt);
  check_quant_mlp_out_codes(out_lo, out_inv_scale, out_bits, widths.back(), x.device(), "x");
  return output_row_codes(quant_mlp_cpu(x, weight_codes, weight_lo, weight_scale, weight_sums, bias, act_bits,
                                        weight_bits, relu, row_scale, std::nullopt),
                          out_lo, out_inv_scale, out_bits);
}

at::Tensor quant_mlp_planes_row_codes_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                          const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                          at::TensorList weight_codes, at::TensorList weight_lo,
                                          at::TensorList weight_scale, at::TensorList weight_sums,
                                          const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                                          at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                          const std::optional<at::Tensor>& row_scale, const at::Tensor& out_lo,
                                          const at::Tensor& out_inv_scale, int64_t out_bits) {
  const std::vector<int64_t> widths =
      check_quant_mlp_planes_args(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo,
                                  weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale,
                                  std::nullopt);
  check_quant_mlp_out_codes(out_lo, out_inv_scale, out_bits, widths.back(), planes.device(), "planes");
  return output_row_codes(quant_mlp_planes_cpu(planes, rows, cols, col_layout, lo, scale, dim, weight_codes,
                                               weight_lo, weight_scale, weight_sums, bias, act_bits, weight_bits,
                                               relu, row_scale, std::nullopt),
                          out_lo, out_inv_scale, out_bits);
}

}  // namespace pyg_quant
