#pragma once
// The affine epilogue of an integer product (epilogue.h's bitmm_affine_epilogue), 8 columns at a time with AVX-512,
// for the CPU kernels that finish a block of int32 / int64 products at once (bitmm_affine, quant_mlp).
#include <cstdint>

#include "cpu_features.h"

namespace pyg_quant {

#if defined(PYG_QUANT_X86_DISPATCH)
// bitmm_affine_epilogue on 8 columns at a time: the same float64 operations in the same order (vector IEEE
// operations round exactly as scalar ones, and nothing is contracted), then the same float32 rounding, bias and
// ReLU.  Int32 or int64 products convert to float64 as the scalar casts do (to nearest).
template <typename Product>
PYG_QUANT_TARGET_AVX512_DQ inline void bitmm_affine_rows_avx512(
    const Product* p, const int64_t* rs, const int64_t* cs, const float* la, const float* ra, const float* lb,
    const float* rb, const float* bias, double k, bool relu, int64_t cols, int64_t r0, int64_t r1, float* o) {
  for (int64_t i = r0; i < r1; ++i) {
    const double la_i = la[i], ra_i = ra[i], rs_i = static_cast<double>(rs[i]);
    const __m512d k_la = _mm512_set1_pd(k * la_i), la_v = _mm512_set1_pd(la_i), ra_v = _mm512_set1_pd(ra_i);
    const __m512d rs_v = _mm512_set1_pd(rs_i);
    for (int64_t j = 0; j < cols; j += 8) {
      const __mmask8 m = static_cast<__mmask8>(cols - j >= 8 ? 0xff : (1u << (cols - j)) - 1u);
      const __m512d lb_v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, lb + j));
      const __m512d rb_v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, rb + j));
      const __m512d cs_v = _mm512_cvtepi64_pd(_mm512_maskz_loadu_epi64(m, cs + j));
      __m512d p_v;
      if constexpr (sizeof(Product) == 4) {
        p_v = _mm512_cvtepi32_pd(_mm256_maskz_loadu_epi32(m, p + i * cols + j));
      } else {
        p_v = _mm512_cvtepi64_pd(_mm512_maskz_loadu_epi64(m, p + i * cols + j));
      }
      __m512d v = _mm512_mul_pd(k_la, lb_v);
      v = _mm512_add_pd(v, _mm512_mul_pd(_mm512_mul_pd(la_v, rb_v), cs_v));
      v = _mm512_add_pd(v, _mm512_mul_pd(_mm512_mul_pd(ra_v, lb_v), rs_v));
      v = _mm512_add_pd(v, _mm512_mul_pd(_mm512_mul_pd(ra_v, rb_v), p_v));
      __m256 f = _mm512_cvtpd_ps(v);
      f = _mm256_add_ps(f, bias != nullptr ? _mm256_maskz_loadu_ps(m, bias + j) : _mm256_setzero_ps());
      if (relu) f = _mm256_maskz_mov_ps(_mm256_cmp_ps_mask(f, _mm256_setzero_ps(), _CMP_NLE_UQ), f);  // NaN kept
      _mm256_mask_storeu_ps(o + i * cols + j, m, f);
    }
  }
}
#endif

}  // namespace pyg_quant
