#pragma once
// The affine epilogue of an integer product (epilogue.h's bitmm_affine_epilogue), 16 columns at a time with AVX-512
// (8 with AVX2), for the CPU kernels that finish a block of int32 / int64 products at once (bitmm_affine, quant_mlp).
#include <cstdint>
#include <vector>

#include "cpu_features.h"
#include "epilogue.h"

namespace pyg_quant {

// bitmm_col_term of every column: K·lb_j + rb_j·colsum_j, made once for all the rows.
inline std::vector<float> bitmm_col_terms(int64_t k, const float* lb, const float* rb, const int64_t* col_sums,
                                          int64_t cols) {
  std::vector<float> terms(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j) {
    terms[j] = bitmm_col_term(static_cast<float>(k), lb[j], rb[j], static_cast<float>(col_sums[j]));
  }
  return terms;
}

#if defined(PYG_QUANT_X86_DISPATCH)
// bitmm_affine_epilogue on 16 columns at a time: the same float32 operations in the same order (vector IEEE
// operations round exactly as scalar ones, and nothing is contracted), then the same bias and ReLU.  Int32 or int64
// products convert to float32 as the scalar casts do (to nearest).
template <typename Product>
PYG_QUANT_TARGET_AVX512_DQ inline void bitmm_affine_rows_avx512(
    const Product* p, const int64_t* rs, const float* col_term, const float* la, const float* ra, const float* lb,
    const float* rb, const float* bias, bool relu, int64_t cols, int64_t r0, int64_t r1, float* o) {
  for (int64_t i = r0; i < r1; ++i) {
    const __m512 la_v = _mm512_set1_ps(la[i]), ra_v = _mm512_set1_ps(ra[i]);
    const __m512 rs_v = _mm512_set1_ps(static_cast<float>(rs[i]));
    const Product* p_row = p + i * cols;
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 m = static_cast<__mmask16>(cols - j >= 16 ? 0xffffu : (1u << (cols - j)) - 1u);
      __m512 p_v;
      if constexpr (sizeof(Product) == 4) {
        p_v = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, p_row + j));
      } else {
        const __m256 low = _mm512_cvtepi64_ps(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(m), p_row + j));
        const __m256 high = _mm512_cvtepi64_ps(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(m >> 8), p_row + j + 8));
        p_v = _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
      }
      const __m512 lb_v = _mm512_maskz_loadu_ps(m, lb + j), rb_v = _mm512_maskz_loadu_ps(m, rb + j);
      const __m512 inner = _mm512_add_ps(_mm512_mul_ps(lb_v, rs_v), _mm512_mul_ps(rb_v, p_v));
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(la_v, _mm512_maskz_loadu_ps(m, col_term + j)),
                                     _mm512_mul_ps(ra_v, inner));
      __m512 f = _mm512_add_ps(v, bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + j) : _mm512_setzero_ps());
      if (relu) f = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_NLE_UQ), f);  // NaN kept
      _mm512_mask_storeu_ps(o + i * cols + j, m, f);
    }
  }
}

// bitmm_affine_rows_avx512 with AVX2, for int32 products: 8 columns at a time, the last few by the scalar epilogue.
PYG_QUANT_TARGET_AVX2 inline void bitmm_affine_rows_avx2(const int32_t* p, const int64_t* rs, const float* col_term,
                                                         const float* la, const float* ra, const float* lb,
                                                         const float* rb, const float* bias, bool relu, int64_t cols,
                                                         int64_t r0, int64_t r1, float* o) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = r0; i < r1; ++i) {
    const float rs_i = static_cast<float>(rs[i]);
    const __m256 la_v = _mm256_set1_ps(la[i]), ra_v = _mm256_set1_ps(ra[i]), rs_v = _mm256_set1_ps(rs_i);
    const int32_t* p_row = p + i * cols;
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) {
      const __m256 p_v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p_row + j)));
      const __m256 inner = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(lb + j), rs_v),
                                         _mm256_mul_ps(_mm256_loadu_ps(rb + j), p_v));
      const __m256 v = _mm256_add_ps(_mm256_mul_ps(la_v, _mm256_loadu_ps(col_term + j)), _mm256_mul_ps(ra_v, inner));
      __m256 f = _mm256_add_ps(v, bias != nullptr ? _mm256_loadu_ps(bias + j) : zero);
      if (relu) f = _mm256_and_ps(_mm256_cmp_ps(f, zero, _CMP_NLE_UQ), f);  // NaN kept
      _mm256_storeu_ps(o + i * cols + j, f);
    }
    for (; j < cols; ++j) {
      o[i * cols + j] = bitmm_affine_epilogue(static_cast<float>(p_row[j]), rs_i, col_term[j], la[i], ra[i], lb[j],
                                              rb[j], bias != nullptr ? bias[j] : 0.0f, relu);
    }
  }
}
#endif

}  // namespace pyg_quant
