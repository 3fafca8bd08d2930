#pragma once
// Bit-plane codes to bytes with AVX2, for the int8 paths on CPUs without AVX-512 (unpack_avx512.h's functions, 32
// codes a register).
#include <cstdint>
#include <cstring>

#include "cpu_features.h"

namespace pyg_quant {

#if defined(PYG_QUANT_X86_DISPATCH)
// 32 consecutive codes of a bit-plane operand, one a byte, from each plane's 32-bit word: byte i takes bit i of
// every plane (vpshufb spreads byte i / 8 of the word over byte i, one bit of it is tested and becomes 0 or 1), the
// planes from the top one down, each step doubling the bytes so far.
PYG_QUANT_TARGET_AVX2 inline __m256i codes_of_32(const uint32_t* word, int64_t plane_stride, int bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i one = _mm256_set1_epi8(1);
  __m256i v = _mm256_setzero_si256();
  for (int p = bits - 1; p >= 0; --p) {
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(word[p * plane_stride])), spread);
    v = _mm256_or_si256(_mm256_add_epi8(v, v), _mm256_min_epu8(_mm256_and_si256(x, select), one));
  }
  return v;
}

// The sum of the four 64-bit lanes of vpsadbw sums.
PYG_QUANT_TARGET_AVX2 inline int64_t lane_total(__m256i s) {
  return _mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) + _mm256_extract_epi64(s, 2) +
         _mm256_extract_epi64(s, 3);
}

// unpack_rows_avx512 with AVX2: the codes of the first `used` 64-bit words of rows [r0, r1) of row-layout planes
// (`words` words a row, `plane_stride` words a plane), used·64 bytes a row at dst; with `shift`, each code less 128,
// and with `sums`, each row's sum of the codes (unshifted).
PYG_QUANT_TARGET_AVX2 inline void unpack_rows_avx2(const uint64_t* planes, int64_t plane_stride, int bits, int64_t r0,
                                                   int64_t r1, int64_t words, int64_t used, uint8_t* dst,
                                                   bool shift = false, int64_t* sums = nullptr) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const uint32_t* half = reinterpret_cast<const uint32_t*>(planes);
  for (int64_t r = r0; r < r1; ++r) {
    uint8_t* row = dst + (r - r0) * used * 64;
    __m256i total = _mm256_setzero_si256();
    for (int64_t h = 0; h < 2 * used; ++h) {
      const __m256i v = codes_of_32(half + 2 * r * words + h, 2 * plane_stride, bits);
      if (sums != nullptr) total = _mm256_add_epi64(total, _mm256_sad_epu8(v, _mm256_setzero_si256()));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + h * 32), shift ? _mm256_xor_si256(v, flip) : v);
    }
    if (sums != nullptr) sums[r - r0] = lane_total(total);
  }
}

// unpack_row_avx512 with AVX2: the first `cols` codes of row r as bytes at dst (with `shift`, each less 128); returns
// their sum (unshifted).  Nothing past `cols` is stored or summed.
PYG_QUANT_TARGET_AVX2 inline int64_t unpack_row_avx2(const uint64_t* planes, int64_t plane_stride, int bits, int64_t r,
                                                     int64_t words, int64_t cols, uint8_t* dst, bool shift) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i lane = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                        22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  const uint32_t* half = reinterpret_cast<const uint32_t*>(planes) + 2 * r * words;
  __m256i total = _mm256_setzero_si256();
  for (int64_t h = 0; h * 32 < cols; ++h) {
    const int64_t left = cols - h * 32;
    __m256i v = codes_of_32(half + h, 2 * plane_stride, bits);
    if (left < 32) v = _mm256_and_si256(v, _mm256_cmpgt_epi8(_mm256_set1_epi8(static_cast<char>(left)), lane));
    total = _mm256_add_epi64(total, _mm256_sad_epu8(v, _mm256_setzero_si256()));
    if (shift) v = _mm256_xor_si256(v, flip);
    if (left >= 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h * 32), v);
    } else {
      alignas(32) uint8_t last[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(last), v);
      std::memcpy(dst + h * 32, last, left);
    }
  }
  return lane_total(total);
}
#endif

}  // namespace pyg_quant
