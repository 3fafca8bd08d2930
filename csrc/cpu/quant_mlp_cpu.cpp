// quant_mlp on the CPU: rows in parallel, each row carried through every layer in thread-local buffers
// (float32 values, uint8 codes), int32 dot products against the uint8 weight codes.
#include "quant_mlp_cpu.h"

#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu_features.h"
#include "epilogue.h"
#include "epilogue_avx512.h"
#include "ordered_key.h"
#include "quant_mlp_args.h"
#include "quantize_cpu.h"
#include "quantize_steps.h"
#include "row_codes.h"

namespace pyg_quant {
namespace {

struct Layer {
  const uint8_t* w;  // [out, in]
  const float* lo;
  const float* scale;
  const int64_t* sums;
  const float* bias;  // nullptr: none
  int64_t in, out;
  float max_code;
  bool relu;
};

// Σ_k a[k]·w[k] over uint8 codes, exact in int32 (check_quant_mlp_args bounds in·(2^a − 1)·(2^w − 1)).
// SSE2: 16 codes at a time widened to int16 (codes <= 255 fit) and multiplied pairwise into int32 (pmaddwd: at
// most 2·255² each).
inline int32_t dot_u8(const uint8_t* a, const uint8_t* w, int64_t n) {
  int64_t k = 0;
  int32_t acc = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  __m128i sum = zero;
  for (; k + 16 <= n; k += 16) {
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k));
    const __m128i vw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
    sum = _mm_add_epi32(sum, _mm_madd_epi16(_mm_unpacklo_epi8(va, zero), _mm_unpacklo_epi8(vw, zero)));
    sum = _mm_add_epi32(sum, _mm_madd_epi16(_mm_unpackhi_epi8(va, zero), _mm_unpackhi_epi8(vw, zero)));
  }
  alignas(16) int32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), sum);
  acc = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
  for (; k < n; ++k) acc += static_cast<int32_t>(a[k]) * static_cast<int32_t>(w[k]);
  return acc;
}

// A row's range: amin / amax (a NaN anywhere makes both NaN, as they do).
inline Range row_range(const float* h, int64_t in, float max_code) {
  float mn = h[0], mx = h[0];
  bool nan = false;
  for (int64_t c = 0; c < in; ++c) {
    const float v = h[c];
    nan |= v != v;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  if (nan) mn = mx = NAN;
  return range_of(mn, mx, max_code);
}

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
PYG_QUANT_TARGET_AVX512 int64_t codes_avx512(const float* h, int64_t in, Range range, float max_code, int8_t* codes) {
  const __m512 lo = _mm512_set1_ps(range.lo), inv = _mm512_set1_ps(range.inv), half = _mm512_set1_ps(0.5f);
  const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(max_code);
  __m512i total = _mm512_setzero_si512();
  for (int64_t c = 0; c < in; c += 16) {
    const __mmask16 m = static_cast<__mmask16>(in - c >= 16 ? 0xffff : (1u << (in - c)) - 1u);
    __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, h + c), lo), inv), half);
    t = _mm512_min_ps(_mm512_max_ps(t, zero), top);  // max(NaN, 0) is 0: maxps returns its second operand
    const __m512i q = _mm512_maskz_cvttps_epi32(m, t);
    total = _mm512_add_epi32(total, q);
    _mm_mask_storeu_epi8(codes + c, m, _mm512_cvtepi32_epi8(q));
  }
  return _mm512_reduce_add_epi32(total);
}
#endif

// Whether every layer's codes fit int8 (at most 7 bits a side), which torch's int8 GEMM multiplies; its products are
// exact in int32 as the row loop's are (check_quant_mlp_args bounds them).
bool int8_products(at::IntArrayRef act_bits, at::IntArrayRef weight_bits) {
  for (size_t l = 0; l < act_bits.size(); ++l) {
    if (act_bits[l] > 7 || weight_bits[l] > 7) return false;
  }
  return true;
}

// Rows of the int8 path a block: its buffers stay a few MB however many rows x has.
constexpr int64_t kInt8BlockRows = 2048;

}  // namespace

at::Tensor quant_mlp_cpu(const at::Tensor& x_in, at::TensorList weight_codes, at::TensorList weight_lo,
                         at::TensorList weight_scale, at::TensorList weight_sums,
                         const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                         at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                         const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& col_keys) {
  const std::vector<int64_t> widths = check_quant_mlp_args(x_in, weight_codes, weight_lo, weight_scale, weight_sums,
                                                           bias, act_bits, weight_bits, relu, row_scale, col_keys);
  const int64_t layers = static_cast<int64_t>(weight_codes.size()), rows = x_in.size(0);
  const at::Tensor x = x_in.contiguous();
  std::vector<at::Tensor> keep;  // contiguous copies live until the end
  std::vector<Layer> plan;
  for (int64_t l = 0; l < layers; ++l) {
    keep.push_back(weight_codes[l].contiguous());
    keep.push_back(weight_lo[l].contiguous());
    keep.push_back(weight_scale[l].contiguous());
    keep.push_back(weight_sums[l].contiguous());
    const std::optional<at::Tensor> b = bias.get(l);
    keep.push_back(b.has_value() ? b->contiguous() : at::Tensor());
    const size_t i = keep.size() - 5;
    plan.push_back({keep[i].data_ptr<uint8_t>(), keep[i + 1].data_ptr<float>(), keep[i + 2].data_ptr<float>(),
                    keep[i + 3].data_ptr<int64_t>(), keep[i + 4].defined() ? keep[i + 4].data_ptr<float>() : nullptr,
                    widths[l], widths[l + 1], static_cast<float>((1 << act_bits[l]) - 1), relu.get(l)});
  }
  const int64_t out_cols = widths.back();
  auto out = at::empty({rows, out_cols}, x.options());
  if (rows == 0) return out;
  const int64_t max_width = *std::max_element(widths.begin(), widths.end());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const at::Tensor scales = row_scale.has_value() ? row_scale->contiguous() : at::Tensor();
  const float* sp = scales.defined() ? scales.data_ptr<float>() : nullptr;
  // col_keys: each task reduces its rows' keys (max slots, then min slots) and merges them once.
  int64_t* keys = col_keys.has_value() ? col_keys->data_ptr<int64_t>() : nullptr;
  std::mutex keys_mutex;
  // The row's last steps: the row scale, then its share of the column keys.
  const auto finish_row = [&](int64_t r, uint32_t* task_keys) {
    float* row = op + r * out_cols;
    if (sp != nullptr) {
      for (int64_t o = 0; o < out_cols; ++o) row[o] = row[o] * sp[r];
    }
    if (keys != nullptr) {
      for (int64_t o = 0; o < out_cols; ++o) {
        task_keys[o] = std::max(task_keys[o], ordered_key(row[o]));
        task_keys[out_cols + o] = std::max(task_keys[out_cols + o], min_slot_key(row[o]));
      }
    }
  };
  const auto merge_keys = [&](const std::vector<uint32_t>& task_keys) {
    if (keys == nullptr) return;
    const std::lock_guard<std::mutex> lock(keys_mutex);
    for (int64_t i = 0; i < 2 * out_cols; ++i) keys[i] = std::max<int64_t>(keys[i], task_keys[i]);
  };
  if (int8_products(act_bits, weight_bits)) {
    // A block of rows at a time, layer by layer: the rows' codes (int8: at most 7 bits), one int8 GEMM against the
    // layer's weight codes (torch's: oneDNN, AMX or VNNI) for the integer products, then each row's epilogue; the
    // same integers and the same epilogue as the row-at-a-time loop below, several times faster.
    const auto int8 = x.options().dtype(at::kChar);
    std::vector<at::Tensor> weights_t;  // [in, out] views of the [out, in] weight codes
    for (const Layer& layer : plan) {
      weights_t.push_back(at::from_blob(const_cast<uint8_t*>(layer.w), {layer.in, layer.out}, {1, layer.in}, int8));
    }
    const int64_t block = std::min(rows, kInt8BlockRows);
    std::vector<float> buffer_a(block * max_width), buffer_b(block * max_width);
    std::vector<int8_t> codes(block * max_width);
    std::vector<Range> ranges(block);
    std::vector<int64_t> row_sums(block);
    std::vector<float> row_lo(block), row_scale(block);
#if defined(PYG_QUANT_X86_DISPATCH)
    const bool vector = cpu_has_avx512_vnni(), vector_epilogue = cpu_has_avx512_dq();
#endif
    at::Tensor products = at::empty({block * max_width}, x.options().dtype(at::kInt));
    std::vector<uint32_t> all_keys(keys != nullptr ? 2 * out_cols : 0, 0u);
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t n = std::min(block, rows - r0);
      const float* h = xp + r0 * widths[0];
      for (int64_t l = 0; l < layers; ++l) {
        const Layer& layer = plan[l];
        const bool last = l + 1 == layers;
        float* next = last ? op + r0 * out_cols : (l % 2 == 0 ? buffer_a.data() : buffer_b.data());
        at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const float* row = h + i * layer.in;
            int8_t* row_codes = codes.data() + i * layer.in;
#if defined(PYG_QUANT_X86_DISPATCH)
            if (vector) {
              ranges[i] = row_range_avx512(row, layer.in, layer.max_code);
              row_sums[i] = codes_avx512(row, layer.in, ranges[i], layer.max_code, row_codes);
              row_lo[i] = ranges[i].lo;
              row_scale[i] = ranges[i].scale;
              continue;
            }
#endif
            row_sums[i] = quantize_row(row, layer.in, layer.max_code, row_codes, &ranges[i]);
            row_lo[i] = ranges[i].lo;
            row_scale[i] = ranges[i].scale;
          }
        });
        at::Tensor product = products.narrow(0, 0, n * layer.out).view({n, layer.out});
        at::_int_mm_out(product, at::from_blob(codes.data(), {n, layer.in}, int8), weights_t[l]);
        const int32_t* pp = product.data_ptr<int32_t>();
        const double k = static_cast<double>(layer.in);
        at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
#if defined(PYG_QUANT_X86_DISPATCH)
          if (vector_epilogue) {
            bitmm_affine_rows_avx512(pp, row_sums.data(), layer.sums, row_lo.data(), row_scale.data(), layer.lo,
                                     layer.scale, layer.bias, k, layer.relu, layer.out, begin, end, next);
            return;
          }
#endif
          for (int64_t i = begin; i < end; ++i) {
            const double rs = static_cast<double>(row_sums[i]);
            for (int64_t o = 0; o < layer.out; ++o) {
              next[i * layer.out + o] = bitmm_affine_epilogue(
                  static_cast<double>(pp[i * layer.out + o]), rs, static_cast<double>(layer.sums[o]),
                  ranges[i].lo, ranges[i].scale, layer.lo[o], layer.scale[o], k,
                  layer.bias ? layer.bias[o] : 0.0f, layer.relu);
            }
          }
        });
        h = next;
      }
      for (int64_t r = r0; r < r0 + n; ++r) finish_row(r, all_keys.data());
    }
    merge_keys(all_keys);
    return out;
  }
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer_a(max_width), buffer_b(max_width);
    std::vector<uint8_t> codes(max_width);
    std::vector<uint32_t> task_keys(keys != nullptr ? 2 * out_cols : 0, 0u);
    for (int64_t r = begin; r < end; ++r) {
      const float* h = xp + r * widths[0];
      for (int64_t l = 0; l < layers; ++l) {
        const Layer& layer = plan[l];
        float* next = l + 1 == layers ? op + r * out_cols : (l % 2 == 0 ? buffer_a.data() : buffer_b.data());
        Range range;
        const int64_t row_sum = quantize_row(h, layer.in, layer.max_code, codes.data(), &range);
        const double k = static_cast<double>(layer.in), rs = static_cast<double>(row_sum);
        for (int64_t o = 0; o < layer.out; ++o) {
          const int32_t product = dot_u8(codes.data(), layer.w + o * layer.in, layer.in);
          next[o] = bitmm_affine_epilogue(static_cast<double>(product), rs, static_cast<double>(layer.sums[o]),
                                          range.lo, range.scale, layer.lo[o], layer.scale[o], k,
                                          layer.bias ? layer.bias[o] : 0.0f, layer.relu);
        }
        h = next;
      }
      finish_row(r, task_keys.data());
    }
    merge_keys(task_keys);
  });
  return out;
}

at::Tensor quant_mlp_planes_cpu(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout,
                                const at::Tensor& lo, const at::Tensor& scale, int64_t dim,
                                at::TensorList weight_codes, at::TensorList weight_lo, at::TensorList weight_scale,
                                at::TensorList weight_sums, const c10::List<std::optional<at::Tensor>>& bias,
                                at::IntArrayRef act_bits, at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                                const std::optional<at::Tensor>& row_scale,
                                const std::optional<at::Tensor>& col_keys) {
  // The definition itself: the CPU kernel reads a row from a thread-local buffer either way.
  check_quant_mlp_planes_args(planes, rows, cols, col_layout, lo, scale, dim, weight_codes, weight_lo, weight_scale,
                              weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
  return quant_mlp_cpu(dequantize_cpu(planes, rows, cols, col_layout, lo, scale, dim), weight_codes, weight_lo,
                       weight_scale, weight_sums, bias, act_bits, weight_bits, relu, row_scale, col_keys);
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
