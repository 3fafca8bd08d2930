#pragma once
// Bit-plane codes to bytes with AVX-512, for the CPU kernels that hand codes to torch's int8 GEMM (bitmm_int's int8
// path, quant_mlp on codes taken as they are).
#include <cstdint>

#include "cpu_features.h"

namespace pyg_quant {

#if defined(PYG_QUANT_X86_DISPATCH)
// 64 consecutive codes of a bit-plane operand, one a byte: plane p's word sets bit p of the bytes its bits select.
PYG_QUANT_TARGET_AVX512 inline __m512i codes_of_64(const uint64_t* word, int64_t plane_stride, int bits) {
  __m512i v = _mm512_setzero_si512();
  for (int p = 0; p < bits; ++p) {
    v = _mm512_mask_add_epi8(v, static_cast<__mmask64>(word[p * plane_stride]), v,
                             _mm512_set1_epi8(static_cast<char>(1 << p)));
  }
  return v;
}

// The codes of the first `used` words of rows [r0, r1) of row-layout planes (`words` words a row), used·64 bytes a
// row, row r at dst + (r − r0)·used·64; with `shift`, each code less 128 (an 8-bit code as an int8), and the row's
// sum of the codes stored (unshifted) in sums[r − r0].
PYG_QUANT_TARGET_AVX512 inline void unpack_rows_avx512(const uint64_t* planes, int64_t plane_stride, int bits,
                                                       int64_t r0, int64_t r1, int64_t words, int64_t used,
                                                       uint8_t* dst, bool shift = false, int64_t* sums = nullptr) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  for (int64_t r = r0; r < r1; ++r) {
    uint8_t* row = dst + (r - r0) * used * 64;
    __m512i total = zero;
    for (int64_t w = 0; w < used; ++w) {
      const __m512i v = codes_of_64(planes + r * words + w, plane_stride, bits);
      if (sums != nullptr) total = _mm512_add_epi64(total, _mm512_sad_epu8(v, zero));
      _mm512_storeu_si512(row + w * 64, shift ? _mm512_xor_si512(v, flip) : v);
    }
    if (sums != nullptr) sums[r - r0] = _mm512_reduce_add_epi64(total);
  }
}

// The codes of row r of row-layout planes (`words` 64-bit words a row), its first `cols` only, as bytes at dst (with
// `shift`, each less 128); returns their sum (unshifted).  The padding past `cols` is neither stored nor summed.
PYG_QUANT_TARGET_AVX512 inline int64_t unpack_row_avx512(const uint64_t* planes, int64_t plane_stride, int bits,
                                                         int64_t r, int64_t words, int64_t cols, uint8_t* dst,
                                                         bool shift) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  __m512i total = zero;
  for (int64_t w = 0; w * 64 < cols; ++w) {
    const int64_t left = cols - w * 64;
    const __mmask64 m = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    const __m512i v = _mm512_maskz_mov_epi8(m, codes_of_64(planes + r * words + w, plane_stride, bits));
    total = _mm512_add_epi64(total, _mm512_sad_epu8(v, zero));
    _mm512_mask_storeu_epi8(dst + w * 64, m, shift ? _mm512_xor_si512(v, flip) : v);
  }
  return _mm512_reduce_add_epi64(total);
}
#endif

}  // namespace pyg_quant
