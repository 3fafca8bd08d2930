// Any-bitwidth integer GEMM on bit planes: out = Σ_{p,q} 2^(p+q) · popc(A_p & B_q).
// A is row-layout planes [s, M_pad, W], B col-layout planes [t, N_pad, W] (see
// pyg_quant/layout.py): both run their bits along K, so one output entry is a
// dot product of two bit vectors per plane pair.  Each 64-bit word of A's planes
// is loaded once and used against every plane of B (QGTC's cross-plane reuse);
// the per-pair counts stay below K and combine into int64 at the end.
#include "bitmm_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <cstring>
#include <vector>

#include "bitmm_args.h"
#include "cpu_features.h"
#include "epilogue.h"
#include "epilogue_avx512.h"
#include "int8_gemm.h"
#include "popcount.h"
#include "scratch.h"
#include "unpack_avx2.h"
#include "unpack_avx512.h"

namespace pyg_quant {
namespace {

constexpr int64_t kRowBlock = 4;
constexpr int64_t kColBlock = 32;

template <int S, int T>
int64_t dot_planes(const uint64_t* a, int64_t a_plane_stride, const uint64_t* b, int64_t b_plane_stride,
                   int64_t words, int s_rt, int t_rt) {
  const int s = S > 0 ? S : s_rt;
  const int t = T > 0 ? T : t_rt;
  int64_t counts[8][8] = {};
  for (int64_t w = 0; w < words; ++w) {
    uint64_t bv[8];
    for (int q = 0; q < t; ++q) bv[q] = b[q * b_plane_stride + w];
    for (int p = 0; p < s; ++p) {
      const uint64_t av = a[p * a_plane_stride + w];
      for (int q = 0; q < t; ++q) counts[p][q] += popcount64(av & bv[q]);
    }
  }
  int64_t total = 0;
  for (int p = 0; p < s; ++p)
    for (int q = 0; q < t; ++q) total += counts[p][q] << (p + q);
  return total;
}

using DotFn = int64_t (*)(const uint64_t*, int64_t, const uint64_t*, int64_t, int64_t, int, int);

DotFn pick_dot(int s, int t) {
#define PQ_CASE(S, T) \
  if (s == S && t == T) return &dot_planes<S, T>;
  PQ_CASE(1, 1) PQ_CASE(1, 2) PQ_CASE(1, 4) PQ_CASE(1, 8)
  PQ_CASE(2, 1) PQ_CASE(2, 2) PQ_CASE(2, 4) PQ_CASE(2, 8)
  PQ_CASE(4, 1) PQ_CASE(4, 2) PQ_CASE(4, 4) PQ_CASE(4, 8)
  PQ_CASE(8, 1) PQ_CASE(8, 2) PQ_CASE(8, 4) PQ_CASE(8, 8)
#undef PQ_CASE
  return &dot_planes<0, 0>;
}

#if defined(PYG_QUANT_X86_DISPATCH)
// The same product from unpacked codes: Σ_k A[r,k]·B[c,k] over every packed position (padding included, as the
// plane-pair popcounts count it), 64 codes a vpdpbusd.  vpdpbusd multiplies unsigned by signed bytes, so the
// operand of at most 7 bits is the signed one.  Its int32 lanes wrap like the int32 result does, so a narrow
// result is exact modulo 2^32 as before; a wide one sums blocks small enough to stay exact in int32.

// Words (64 codes) per block of a wide product: a block's sum is at most 1024·64·255·127 < 2^31.
constexpr int64_t kWideBlockWords = 1024;

// 1 + the last word any plane of B sets a bit in along K (0 for none): the words past it add nothing to a product,
// and K's padding to 256 bits is up to three such words a row.
int64_t used_words(const uint64_t* planes, int64_t plane_stride, int bits, int64_t cols, int64_t words) {
  int64_t used = 0;
  for (int p = 0; p < bits; ++p) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint64_t* row = planes + p * plane_stride + c * words;
      for (int64_t w = words - 1; w >= used; --w) {
        if (row[w] != 0) {
          used = w + 1;
          break;
        }
      }
    }
  }
  return used;
}

// The int8 path's unpacked codes: B's and a chunk of A's rows, at most kInt8ChunkRows and about kInt8ChunkBytes.
constexpr int64_t kInt8ChunkRows = 1024;
constexpr int64_t kInt8ChunkBytes = int64_t{4} << 20;

// The int32 product from both operands' codes unpacked to int8 (with AVX-512, or with AVX2 where the CPU has no
// AVX-512), by int8_gemm (torch's oneDNN GEMM: AMX or VNNI, blocked for the cache; the AVX2 kernel elsewhere), several
// times faster than the one-row loops below, over the words of K that B uses.  An 8-bit
// operand's codes go in less 128: with a = a' + 128 and b = b' + 128 (each where shifted), over the Kp unpacked
// positions Σ a·b = Σ a'·b' + 128·Σ b·[a shifted] + 128·Σ a·[b shifted] − 128²·Kp·[both], every term exact (the
// caller keeps K·(2^s − 1)·(2^t − 1), and so |Σ a'·b'|, within int32 on this path).
void bitmm_int_int8(const uint64_t* ap, int64_t a_plane, int s, const uint64_t* bp, int64_t b_plane, int t,
                    int64_t words, int64_t rows, int64_t cols, const at::Tensor& out, bool avx512) {
  const auto unpack = avx512 ? unpack_rows_avx512 : unpack_rows_avx2;
  const int64_t used = used_words(bp, b_plane, t, cols, words);
  if (used == 0) {
    out.zero_();
    return;
  }
  const bool shift_a = s == 8, shift_b = t == 8;
  const int64_t row_bytes = used * 64;
  const int64_t chunk_rows = std::min({rows, kInt8ChunkRows, std::max<int64_t>(16, kInt8ChunkBytes / row_bytes)});
  Scratch scratch(cols * row_bytes + chunk_rows * row_bytes + 2 * 64);
  uint8_t* b_codes = scratch.take<uint8_t>(cols * row_bytes);
  uint8_t* a_codes = scratch.take<uint8_t>(chunk_rows * row_bytes);
  std::vector<int64_t> b_sums(shift_a ? cols : 0), a_sums(shift_b ? chunk_rows : 0);
  at::parallel_for(0, cols, 16, [&](int64_t begin, int64_t end) {
    unpack(bp, b_plane, t, begin, end, words, used, b_codes + begin * row_bytes, shift_b,
           shift_a ? b_sums.data() + begin : nullptr);
  });
  const int64_t both = shift_a && shift_b ? 128 * 128 * row_bytes : 0;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - r0);
    at::parallel_for(r0, r0 + n, 16, [&](int64_t begin, int64_t end) {
      unpack(ap, a_plane, s, begin, end, words, used, a_codes + (begin - r0) * row_bytes, shift_a,
             shift_b ? a_sums.data() + (begin - r0) : nullptr);
    });
    const at::Tensor chunk = out.narrow(0, r0, n);
    int8_gemm(chunk, reinterpret_cast<const int8_t*>(a_codes), row_bytes, n, s,
              reinterpret_cast<const int8_t*>(b_codes), row_bytes, cols, t, row_bytes);
    if (shift_a || shift_b) {
      int32_t* o = chunk.data_ptr<int32_t>();
      at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t row_term = shift_b ? 128 * a_sums[i] : 0;
          for (int64_t c = 0; c < cols; ++c) {
            o[i * cols + c] = static_cast<int32_t>(o[i * cols + c] + row_term + (shift_a ? 128 * b_sums[c] : 0) - both);
          }
        }
      });
    }
  }
}

// The codes of columns [c0, c1) of B, interleaved in blocks of 16 columns: block cb, word w, column j of the block
// at ((cb·words + w)·16 + j)·64, so that the dot loop walks one pointer.
PYG_QUANT_TARGET_AVX512 void unpack_cols_avx512(const uint64_t* planes, int64_t plane_stride, int bits, int64_t c0,
                                                int64_t c1, int64_t words, uint8_t* dst) {
  for (int64_t c = c0; c < c1; ++c) {
    for (int64_t w = 0; w < words; ++w) {
      _mm512_storeu_si512(dst + (((c / 16) * words + w) * 16 + c % 16) * 64,
                          codes_of_64(planes + c * words + w, plane_stride, bits));
    }
  }
}

// acc + Σ of products of unsigned bytes of a and signed bytes of b[0..64) per int32 lane (kSwap: b unsigned, a
// signed), as _mm512_dpbusd_epi32.  In inline assembly so that each accumulator stays in its register: GCC 12
// copies every accumulator of the intrinsic twice per loop trip.  AT&T order: the signed operand (register or
// memory) first, then the unsigned one, then the accumulator.
template <bool kSwap>
PYG_QUANT_TARGET_AVX512 inline __m512i dpbusd_mem(__m512i acc, __m512i a, const uint8_t* b) {
  if constexpr (kSwap) {
    const __m512i bv = _mm512_loadu_si512(b);
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(bv), "v"(a));
  } else {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const __m512i*>(b)));
  }
  return acc;
}

// Lane j: Σ over words [w0, w1) of a's codes times those of column j of a 16-column block b (interleaved as
// above).  Sixteen named accumulators keep the loop to one load and sixteen vpdpbusd a word.
template <bool kSwap>  // kSwap: B's codes are the unsigned operand (A's fit in 7 bits)
PYG_QUANT_TARGET_AVX512 inline __m512i dot_16_cols(const uint8_t* a, const uint8_t* b, int64_t w0, int64_t w1) {
  __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
          c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
  for (int64_t w = w0; w < w1; ++w) {
    const __m512i av = _mm512_loadu_si512(a + w * 64);
    const uint8_t* bw = b + w * 16 * 64;
#define PYG_QUANT_DP(j) c##j = dpbusd_mem<kSwap>(c##j, av, bw + (j) * 64);
    PYG_QUANT_DP(0) PYG_QUANT_DP(1) PYG_QUANT_DP(2) PYG_QUANT_DP(3) PYG_QUANT_DP(4) PYG_QUANT_DP(5)
    PYG_QUANT_DP(6) PYG_QUANT_DP(7) PYG_QUANT_DP(8) PYG_QUANT_DP(9) PYG_QUANT_DP(10) PYG_QUANT_DP(11)
    PYG_QUANT_DP(12) PYG_QUANT_DP(13) PYG_QUANT_DP(14) PYG_QUANT_DP(15)
#undef PYG_QUANT_DP
  }
  const __m512i acc[16] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15};
  return sum_lanes_16(acc);
}

// Rows [r0, r1) of the product from B's interleaved codes (zero past `cols`); a_codes: a words·64-byte buffer for
// one row of A's codes.
template <bool kSwap>
PYG_QUANT_TARGET_AVX512 void bitmm_rows_avx512(const uint64_t* ap, int64_t a_plane, int s, const uint8_t* b_codes,
                                               int64_t words, int64_t cols, int64_t r0, int64_t r1, int32_t* out32,
                                               int64_t* out64, uint8_t* a_codes) {
  alignas(64) int32_t lanes[16];
  for (int64_t r = r0; r < r1; ++r) {
    unpack_rows_avx512(ap, a_plane, s, r, r + 1, words, words, a_codes);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const uint8_t* b = b_codes + c0 * words * 64;
      const int64_t live = std::min<int64_t>(16, cols - c0);
      if (out32 != nullptr) {
        _mm512_store_si512(lanes, dot_16_cols<kSwap>(a_codes, b, 0, words));
        std::memcpy(out32 + r * cols + c0, lanes, live * sizeof(int32_t));
      } else {
        int64_t totals[16] = {};
        for (int64_t w0 = 0; w0 < words; w0 += kWideBlockWords) {
          _mm512_store_si512(lanes, dot_16_cols<kSwap>(a_codes, b, w0, std::min(words, w0 + kWideBlockWords)));
          for (int j = 0; j < 16; ++j) totals[j] += lanes[j];
        }
        std::memcpy(out64 + r * cols + c0, totals, live * sizeof(int64_t));
      }
    }
  }
}

void bitmm_int_avx512(const uint64_t* ap, int64_t a_plane, int s, const uint64_t* bp, int64_t b_plane, int t,
                      int64_t words, int64_t rows, int64_t cols, int32_t* out32, int64_t* out64) {
  const int64_t col_pad = (cols + 15) / 16 * 16, row_bytes = words * 64;
  std::vector<uint8_t> b_codes(col_pad * row_bytes, 0);
  at::parallel_for(0, cols, 16, [&](int64_t begin, int64_t end) {
    unpack_cols_avx512(bp, b_plane, t, begin, end, words, b_codes.data());
  });
  const bool swap = t > 7;  // the caller sends 8 x 8 bits elsewhere
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> a_codes(row_bytes);
    if (swap) {
      bitmm_rows_avx512<true>(ap, a_plane, s, b_codes.data(), words, cols, begin, end, out32, out64, a_codes.data());
    } else {
      bitmm_rows_avx512<false>(ap, a_plane, s, b_codes.data(), words, cols, begin, end, out32, out64, a_codes.data());
    }
  });
}
#endif

}  // namespace

at::Tensor bitmm_int_cpu(const at::Tensor& a_in, const at::Tensor& b_in, int64_t rows, int64_t cols, bool wide) {
  check_bitmm_int_args(a_in, b_in, rows, cols, /*word_multiple=*/2);  // the planes are read as 64-bit words
  const auto a = a_in.contiguous();
  const auto b = b_in.contiguous();
  const int s = a.size(0), t = b.size(0);
  const int64_t words = a.size(2) / 2;
  const int64_t a_plane = a.size(1) * words, b_plane = b.size(1) * words;
  const uint64_t* ap = as_u64(a.data_ptr<int32_t>());
  const uint64_t* bp = as_u64(b.data_ptr<int32_t>());
  auto out = at::empty({rows, cols}, a.options().dtype(wide ? at::kLong : at::kInt));
  const DotFn dot = pick_dot(s, t);
  int64_t* out64 = wide ? out.data_ptr<int64_t>() : nullptr;
  int32_t* out32 = wide ? nullptr : out.data_ptr<int32_t>();
  if (rows == 0 || cols == 0) return out;
#if defined(PYG_QUANT_X86_DISPATCH)
  if ((cpu_has_avx512_vnni() || int8_gemm_own_kernel()) && !wide) {
    bitmm_int_int8(ap, a_plane, s, bp, b_plane, t, words, rows, cols, out, cpu_has_avx512_vnni());
    return out;
  }
  if (cpu_has_avx512_vnni() && (s <= 7 || t <= 7)) {
    bitmm_int_avx512(ap, a_plane, s, bp, b_plane, t, words, rows, cols, out32, out64);
    return out;
  }
#endif

  at::parallel_for(0, (rows + kRowBlock - 1) / kRowBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t col0 = 0; col0 < cols; col0 += kColBlock) {
      const int64_t col1 = std::min(cols, col0 + kColBlock);
      for (int64_t r = begin * kRowBlock; r < std::min(rows, end * kRowBlock); ++r) {
        for (int64_t c = col0; c < col1; ++c) {
          const int64_t v = dot(ap + r * words, a_plane, bp + c * words, b_plane, words, s, t);
          if (wide) {
            out64[r * cols + c] = v;
          } else {
            out32[r * cols + c] = static_cast<int32_t>(v);
          }
        }
      }
    }
  });
  return out;
}

at::Tensor bitmm_affine_cpu(const at::Tensor& product_in, const at::Tensor& row_sums_in, const at::Tensor& col_sums_in,
                            const at::Tensor& a_lo_in, const at::Tensor& a_scale_in, const at::Tensor& b_lo_in,
                            const at::Tensor& b_scale_in, int64_t k, const std::optional<at::Tensor>& bias_in,
                            bool relu) {
  check_bitmm_affine_args(product_in, row_sums_in, col_sums_in, a_lo_in, a_scale_in, b_lo_in, b_scale_in, k, bias_in);
  const int64_t rows = product_in.size(0), cols = product_in.size(1);
  const auto row_sums = row_sums_in.contiguous(), col_sums = col_sums_in.contiguous();
  const auto a_lo = a_lo_in.contiguous(), a_scale = a_scale_in.contiguous();
  const auto b_lo = b_lo_in.contiguous(), b_scale = b_scale_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  auto out = at::empty({rows, cols}, a_lo.options());
  const int64_t* rs = row_sums.data_ptr<int64_t>();
  const float *la = a_lo.data_ptr<float>(), *ra = a_scale.data_ptr<float>();
  const float *lb = b_lo.data_ptr<float>(), *rb = b_scale.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const std::vector<float> col_term = bitmm_col_terms(k, lb, rb, col_sums.data_ptr<int64_t>(), cols);
  float* o = out.data_ptr<float>();
  const auto product = product_in.contiguous();  // int32 or int64, each converted to float32 to nearest
#if defined(PYG_QUANT_X86_DISPATCH)
  const bool vector = cpu_has_avx512_dq(), avx2 = !vector && cpu_has_avx2();
#endif
  const auto run = [&](const auto* p) {
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
#if defined(PYG_QUANT_X86_DISPATCH)
      if (vector) {
        bitmm_affine_rows_avx512(p, rs, col_term.data(), la, ra, lb, rb, bp, relu, cols, begin, end, o);
        return;
      }
      if constexpr (std::is_same_v<std::decay_t<decltype(*p)>, int32_t>) {
        if (avx2) {
          bitmm_affine_rows_avx2(p, rs, col_term.data(), la, ra, lb, rb, bp, relu, cols, begin, end, o);
          return;
        }
      }
#endif
      for (int64_t i = begin; i < end; ++i) {
        const float rs_i = static_cast<float>(rs[i]);
        for (int64_t j = 0; j < cols; ++j) {
          o[i * cols + j] = bitmm_affine_epilogue(static_cast<float>(p[i * cols + j]), rs_i, col_term[j], la[i],
                                                  ra[i], lb[j], rb[j], bp ? bp[j] : 0.0f, relu);
        }
      }
    });
  };
  if (product.scalar_type() == at::kInt) {
    run(product.data_ptr<int32_t>());
  } else {
    run(product.data_ptr<int64_t>());
  }
  return out;
}

}  // namespace pyg_quant
