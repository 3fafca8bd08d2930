// int8_gemm: torch's int8 GEMM (oneDNN) where the CPU has AVX-512 VNNI; on a CPU with AVX2 only, torch's is a scalar
// loop, far slower than its float32 GEMM (benchmarks/RESULTS.md, CPU kernels), so the product runs here in AVX2:
// vpmaddubsw multiplies the unsigned bytes of one operand by the signed bytes of the other and adds pairs in int16,
// which is exact while no pair can leave int16, and whole int16 sums are widened to int32 (vpmaddwd by ones) before
// they could.
#include "int8_gemm.h"

#include <ATen/ops/_int_mm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu_features.h"

namespace pyg_quant {
namespace {

#if defined(PYG_QUANT_X86_DISPATCH)
// The AVX2 kernel's layout of w: blocks of 16 columns, each K in quads (4 bytes of K of each of its 16 columns, 64
// bytes), zero past K and past the last column, so that one broadcast quad of a row of a against two registers of a
// block gives the row's next 4 products of 16 columns in vpmaddubsw's int16 pair sums (as oneDNN's and FBGEMM's AVX2
// kernels do).  Returns each column's sum of its bytes (the 8 x 8-bit path's correction).
constexpr int64_t kBlockCols = 16;
constexpr int64_t kQuadBytes = 4 * kBlockCols;
constexpr int64_t kRows = 4;  // rows of a a step: 8 int16 and 8 int32 sums, two registers of w

inline int64_t quads_of(int64_t k) { return (k + 3) / 4; }

// The largest magnitude of an operand's code as int8_gemm takes it.
inline int64_t code_magnitude(int64_t bits) { return bits == 8 ? 128 : (int64_t{1} << bits) - 1; }

void pack_columns(const int8_t* w, int64_t ldw, int64_t cols, int64_t k, int64_t quads, int8_t* dst, int64_t* sums) {
  const int64_t blocks = (cols + kBlockCols - 1) / kBlockCols;
  std::memset(dst, 0, blocks * quads * kQuadBytes);
  for (int64_t j = 0; j < cols; ++j) {
    int8_t* block = dst + (j / kBlockCols) * quads * kQuadBytes + (j % kBlockCols) * 4;
    const int8_t* row = w + j * ldw;
    for (int64_t q = 0; q < k / 4; ++q) std::memcpy(block + q * kQuadBytes, row + 4 * q, 4);
    for (int64_t i = k / 4 * 4; i < k; ++i) block[(i / 4) * kQuadBytes + i % 4] = row[i];
    int64_t sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += row[i];
    sums[j] = sum;
  }
}

// The operands' roles: a's bytes unsigned and w's signed, or the other way round (the unsigned one holds codes of up
// to 7 bits, so that a pair of products stays within int16); or two 8-bit operands, where a's code a + 128 is split
// into nibbles: a·w = 16·hi·w + lo·w − 128·w, each nibble product unsigned by signed.
enum class Mode { kUnsignedA, kUnsignedW, kNibbles };

// Quad q of a row of a as 4 bytes; with kTail, the last quad of a row of k bytes (zero past k).
template <bool kTail>
inline int32_t row_quad(const int8_t* row, int64_t q, int64_t k) {
  int32_t v = 0;
  if constexpr (kTail) {
    for (int64_t i = 4 * q; i < k; ++i) v |= static_cast<int32_t>(static_cast<uint8_t>(row[i])) << (8 * (i - 4 * q));
  } else {
    std::memcpy(&v, row + 4 * q, 4);
  }
  return v;
}

// One quad of K: rows [0, R) of a against two registers (16 columns) of w, into the int16 (or, kNibbles, int32) sums.
template <int R, Mode M, bool kTail>
PYG_QUANT_TARGET_AVX2 inline void gemm_quad(const int8_t* a, int64_t lda, int64_t k, int64_t q, __m256i w0,
                                            __m256i w1, __m256i (&acc16)[R][2], __m256i (&acc32)[R][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i av = _mm256_set1_epi32(row_quad<kTail>(a + r * lda, q, k));
    if constexpr (M == Mode::kNibbles) {
      const __m256i sixteens = _mm256_set1_epi16(16), nibble = _mm256_set1_epi8(0x0F);
      const __m256i code = _mm256_xor_si256(av, _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i lo = _mm256_and_si256(code, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(code, 4), nibble);
      acc32[r][0] = _mm256_add_epi32(acc32[r][0],
                                     _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(hi, w0), sixteens),
                                                      _mm256_madd_epi16(_mm256_maddubs_epi16(lo, w0), ones)));
      acc32[r][1] = _mm256_add_epi32(acc32[r][1],
                                     _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(hi, w1), sixteens),
                                                      _mm256_madd_epi16(_mm256_maddubs_epi16(lo, w1), ones)));
    } else if constexpr (M == Mode::kUnsignedA) {
      acc16[r][0] = _mm256_add_epi16(acc16[r][0], _mm256_maddubs_epi16(av, w0));
      acc16[r][1] = _mm256_add_epi16(acc16[r][1], _mm256_maddubs_epi16(av, w1));
    } else {
      acc16[r][0] = _mm256_add_epi16(acc16[r][0], _mm256_maddubs_epi16(w0, av));
      acc16[r][1] = _mm256_add_epi16(acc16[r][1], _mm256_maddubs_epi16(w1, av));
    }
  }
}

// Rows [0, R) of a (lda apart) against one block of 16 columns of w (packed): out rows ldo apart, `live` columns.
// `defer` quads of int16 pair sums at most between two widenings to int32, so that no int16 lane can overflow.
template <int R, Mode M>
PYG_QUANT_TARGET_AVX2 void gemm_micro(const int8_t* a, int64_t lda, int64_t k, const int8_t* wp, int64_t quads,
                                      int64_t defer, int32_t* out, int64_t ldo, int64_t live) {
  const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
  __m256i acc16[R][2], acc32[R][2];
  for (int r = 0; r < R; ++r) acc16[r][0] = acc16[r][1] = acc32[r][0] = acc32[r][1] = zero;
  const int64_t full = k / 4;  // quads read whole from a's rows
  for (int64_t q0 = 0; q0 < quads; q0 += defer) {
    const int64_t q1 = std::min(quads, q0 + defer);
    for (int64_t q = q0; q < std::min(q1, full); ++q) {
      gemm_quad<R, M, false>(a, lda, k, q, _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + q * kQuadBytes)),
                             _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + q * kQuadBytes + 32)), acc16,
                             acc32);
    }
    if (q1 > full) {
      gemm_quad<R, M, true>(a, lda, k, full, _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + full * kQuadBytes)),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + full * kQuadBytes + 32)), acc16,
                            acc32);
    }
    if constexpr (M != Mode::kNibbles) {
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < 2; ++c) {
          acc32[r][c] = _mm256_add_epi32(acc32[r][c], _mm256_madd_epi16(acc16[r][c], ones));
          acc16[r][c] = zero;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (live == kBlockCols) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), acc32[r][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 8), acc32[r][1]);
    } else {
      alignas(32) int32_t lanes[kBlockCols];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc32[r][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), acc32[r][1]);
      std::memcpy(out + r * ldo, lanes, live * sizeof(int32_t));
    }
  }
}

template <Mode M>
void gemm_avx2(const int8_t* a, int64_t lda, int64_t n, const int8_t* w, int64_t ldw, int64_t cols, int64_t k,
               int64_t defer, int32_t* out) {
  const int64_t quads = quads_of(k), blocks = (cols + kBlockCols - 1) / kBlockCols;
  std::vector<int8_t> storage(blocks * quads * kQuadBytes + 32);
  int8_t* packed = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 31) & ~uintptr_t{31});
  std::vector<int64_t> w_sums(cols);
  pack_columns(w, ldw, cols, k, quads, packed, w_sums.data());
  at::parallel_for(0, (n + kRows - 1) / kRows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t i = g * kRows, rows = std::min(kRows, n - i);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t live = std::min(kBlockCols, cols - b * kBlockCols);
        const int8_t* wp = packed + b * quads * kQuadBytes;
        int32_t* o = out + i * cols + b * kBlockCols;
        switch (rows) {
          case 4: gemm_micro<4, M>(a + i * lda, lda, k, wp, quads, defer, o, cols, live); break;
          case 3: gemm_micro<3, M>(a + i * lda, lda, k, wp, quads, defer, o, cols, live); break;
          case 2: gemm_micro<2, M>(a + i * lda, lda, k, wp, quads, defer, o, cols, live); break;
          default: gemm_micro<1, M>(a + i * lda, lda, k, wp, quads, defer, o, cols, live); break;
        }
      }
      if constexpr (M == Mode::kNibbles) {  // − 128·Σ_k w[j, k], as int32 adds wrap
        for (int64_t r = i; r < i + rows; ++r) {
          for (int64_t j = 0; j < cols; ++j) {
            out[r * cols + j] = static_cast<int32_t>(static_cast<uint32_t>(out[r * cols + j]) -
                                                     static_cast<uint32_t>(128 * w_sums[j]));
          }
        }
      }
    }
  });
}
#endif

}  // namespace

bool int8_gemm_own_kernel() { return !cpu_has_avx512_vnni() && cpu_has_avx2(); }

void int8_gemm(const at::Tensor& out, const int8_t* a, int64_t lda, int64_t n, int64_t a_bits, const int8_t* w,
               int64_t ldw, int64_t cols, int64_t w_bits, int64_t k) {
  TORCH_CHECK(out.scalar_type() == at::kInt && out.is_contiguous() && out.dim() == 2 && out.size(0) == n &&
                  out.size(1) == cols,
              "int8_gemm: out must be a contiguous int32 [n, cols]");
  TORCH_CHECK(a_bits >= 1 && a_bits <= 8 && w_bits >= 1 && w_bits <= 8, "int8_gemm: bits must be 1..8");
  if (n == 0 || cols == 0) return;
  if (k == 0) {
    out.zero_();
    return;
  }
#if defined(PYG_QUANT_X86_DISPATCH)
  if (int8_gemm_own_kernel()) {
    int32_t* o = out.data_ptr<int32_t>();
    if (a_bits == 8 && w_bits == 8) {
      gemm_avx2<Mode::kNibbles>(a, lda, n, w, ldw, cols, k, quads_of(k), o);
      return;
    }
    // vpmaddubsw's pair sums stay in int16 (at most 2 · 127 · 128); `defer` quads of them fit an int16 lane.
    const int64_t defer = std::max<int64_t>(1, 32767 / (2 * code_magnitude(a_bits) * code_magnitude(w_bits)));
    if (a_bits <= 7) {
      gemm_avx2<Mode::kUnsignedA>(a, lda, n, w, ldw, cols, k, defer, o);
    } else {
      gemm_avx2<Mode::kUnsignedW>(a, lda, n, w, ldw, cols, k, defer, o);
    }
    return;
  }
#endif
  const auto bytes = out.options().dtype(at::kChar);
  at::Tensor result = out;
  at::_int_mm_out(result, at::from_blob(const_cast<int8_t*>(a), {n, k}, {lda, 1}, bytes),
                  at::from_blob(const_cast<int8_t*>(w), {k, cols}, {1, ldw}, bytes));
}

}  // namespace pyg_quant
