// Aggregation over a block-sparse bit adjacency: out[i, d] = Σ_j A_ij · Q_jd.
// Only stored (non-empty) tiles are visited: zero tiles cost nothing.  A tile
// row of column tile c lines up with words 8c..8c+7 of every column-layout
// feature plane (pyg_quant/layout.py), so dense tiles are popcounted against the
// features in place, per row window.  Every other entry (a set bit of a sparse
// tile, or a CSR residual entry) adds its source's codes (unpacked once per call)
// to its row: a row sums all its entries at once, its columns held in registers,
// and the affine epilogue runs on the row right after.  A tile under
// kSparseTileBitsPerPlanePair set bits per plane pair is walked bit by bit (the
// popcount work of a tile does not shrink with its fill); both paths give the
// same integers.
#include "spmm_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "epilogue.h"
#include "layout.h"
#include "popcount.h"
#include "quantize_cpu.h"
#include "row_codes.h"
#include "spmm_args.h"

namespace pyg_quant {
namespace {
constexpr int64_t kTileWords64 = kTileWords / 2;  // a tile row as 64-bit words
// A walked set bit costs one vector add per 16 columns, a popcounted tile 16 rows × 4 words × cols × plane pairs
// scalar popcounts (64 a column and plane pair, against a set bit's cols / 16): the walk wins below ~1,000 set bits
// per plane pair (benchmarks/RESULTS.md, CPU kernels).
constexpr int64_t kSparseTileBitsPerPlanePair = 1100;
// Columns one pass of a row sums: 16 int32 vectors, all held in registers while the row's entries are added.
constexpr int64_t kColBlock = 256;

// The least and the largest entry of an int32 tensor (n > 0) in one pass over its memory: a loop, not two ATen
// reductions and their dispatch, for the bounds checks below.
std::pair<int32_t, int32_t> int32_extrema(const at::Tensor& t) {
  const int32_t* p = t.data_ptr<int32_t>();
  const auto [lo, hi] = std::minmax_element(p, p + t.numel());
  return {*lo, *hi};
}

// One output row's operands: the row's tile bits in the sparse tiles of its window, its residual entries, and the
// popcounted sums of its window's dense tiles (null when it has none).
struct RowSource {
  const uint8_t* code;        // unpacked x codes [nodes_pad, cols]
  int64_t cols;
  const uint64_t* tiles;      // tile_bits as 64-bit words
  int64_t tile_plane;         // words of one adjacency bit plane
  int a_bits;
  const int32_t* tcol;
  const int64_t* sparse;      // the window's walked tiles
  int64_t num_sparse;
  int64_t r;                  // the row within its window
  const int32_t* rcol;
  const int32_t* rval;        // null: every residual weight is 1
  int64_t e0, e1;             // the row's residual entries
  const int64_t* dense_row;   // [cols] or null
};

// The row's sums over columns [d0, d0 + live), to dst[0..live): in uint32 lanes (wrapping: the exact sums' low 32
// bits) or exact in int64 (rows whose sums may pass 2^31).
template <typename Acc>
void row_sums_scalar(const RowSource& s, int64_t d0, int64_t live, Acc* dst) {
  for (int64_t d = 0; d < live; ++d) dst[d] = s.dense_row ? static_cast<Acc>(s.dense_row[d0 + d]) : Acc(0);
  for (int64_t i = 0; i < s.num_sparse; ++i) {
    const int64_t t = s.sparse[i];
    const uint64_t* trow = s.tiles + t * kTileRows * kTileWords64 + s.r * kTileWords64;
    const uint8_t* base = s.code + static_cast<int64_t>(s.tcol[t]) * kTileCols * s.cols + d0;
    for (int a = 0; a < s.a_bits; ++a) {
      for (int64_t w = 0; w < kTileWords64; ++w) {
        for (uint64_t v = trow[a * s.tile_plane + w]; v; v &= v - 1) {
          const uint8_t* src = base + (w * 64 + __builtin_ctzll(v)) * s.cols;
          for (int64_t d = 0; d < live; ++d) dst[d] += static_cast<Acc>(src[d]) << a;
        }
      }
    }
  }
  for (int64_t e = s.e0; e < s.e1; ++e) {
    const uint8_t* src = s.code + static_cast<int64_t>(s.rcol[e]) * s.cols + d0;
    const Acc weight = s.rval ? static_cast<Acc>(s.rval[e]) : Acc(1);
    for (int64_t d = 0; d < live; ++d) dst[d] += weight * static_cast<Acc>(src[d]);
  }
}

#if defined(PYG_QUANT_X86_DISPATCH)
// row_sums_scalar<uint32_t>'s integers with NC int32 vectors of 16 columns kept in registers, entries in the outer
// loop so that each entry's index and code row are read once; the last vector is masked to `live`.
template <int NC>
PYG_QUANT_TARGET_AVX512 void row_sums_avx512(const RowSource& s, int64_t d0, int64_t live, uint32_t* dst) {
  const __mmask16 last = static_cast<__mmask16>(live - 16 * (NC - 1) >= 16 ? 0xffffu
                                                                           : (1u << (live - 16 * (NC - 1))) - 1u);
#define codes16(src, k)                                                                      \
  _mm512_cvtepu8_epi32((k) == NC - 1 ? _mm_maskz_loadu_epi8(last, (src) + 16 * (k)) \
                                     : _mm_loadu_si128(reinterpret_cast<const __m128i*>((src) + 16 * (k))))
  __m512i acc[NC];
#pragma GCC unroll 16
  for (int k = 0; k < NC; ++k) {
    if (s.dense_row != nullptr) {
      // The int64 dense sums' low 32 bits, as the uint32 sums keep them.
      const __mmask16 m = k == NC - 1 ? last : static_cast<__mmask16>(0xffffu);
      const __m256i lo = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(m),
                                                                         s.dense_row + d0 + 16 * k));
      const __m256i hi = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(m >> 8),
                                                                         s.dense_row + d0 + 16 * k + 8));
      acc[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else {
      acc[k] = _mm512_setzero_si512();
    }
  }
  for (int64_t i = 0; i < s.num_sparse; ++i) {
    const int64_t t = s.sparse[i];
    const uint64_t* trow = s.tiles + t * kTileRows * kTileWords64 + s.r * kTileWords64;
    const uint8_t* base = s.code + static_cast<int64_t>(s.tcol[t]) * kTileCols * s.cols + d0;
    for (int a = 0; a < s.a_bits; ++a) {
      for (int64_t w = 0; w < kTileWords64; ++w) {
        for (uint64_t v = trow[a * s.tile_plane + w]; v; v &= v - 1) {
          const uint8_t* src = base + (w * 64 + __builtin_ctzll(v)) * s.cols;
          if (a == 0) {
#pragma GCC unroll 16
            for (int k = 0; k < NC; ++k) acc[k] = _mm512_add_epi32(acc[k], codes16(src, k));
          } else {
#pragma GCC unroll 16
            for (int k = 0; k < NC; ++k) acc[k] = _mm512_add_epi32(acc[k], _mm512_slli_epi32(codes16(src, k), a));
          }
        }
      }
    }
  }
  if (s.rval == nullptr) {
    for (int64_t e = s.e0; e < s.e1; ++e) {
      const uint8_t* src = s.code + static_cast<int64_t>(s.rcol[e]) * s.cols + d0;
#pragma GCC unroll 16
      for (int k = 0; k < NC; ++k) acc[k] = _mm512_add_epi32(acc[k], codes16(src, k));
    }
  } else {
    for (int64_t e = s.e0; e < s.e1; ++e) {
      const uint8_t* src = s.code + static_cast<int64_t>(s.rcol[e]) * s.cols + d0;
      const __m512i weight = _mm512_set1_epi32(s.rval[e]);
#pragma GCC unroll 16
      for (int k = 0; k < NC; ++k) acc[k] = _mm512_add_epi32(acc[k], _mm512_mullo_epi32(weight, codes16(src, k)));
    }
  }
#undef codes16
#pragma GCC unroll 16
  for (int k = 0; k < NC; ++k) {
    _mm512_mask_storeu_epi32(dst + 16 * k, k == NC - 1 ? last : static_cast<__mmask16>(0xffffu), acc[k]);
  }
}

using RowSumsFn = void (*)(const RowSource&, int64_t, int64_t, uint32_t*);

template <int... NC>
constexpr std::array<RowSumsFn, sizeof...(NC) + 1> row_sums_table(std::integer_sequence<int, NC...>) {
  return {nullptr, &row_sums_avx512<NC + 1>...};
}
constexpr auto kRowSumsAvx512 = row_sums_table(std::make_integer_sequence<int, kColBlock / 16>{});

// affine_epilogue on a row, 16 columns at a time: the same float32 operations in the same order (vector IEEE
// operations round as scalar ones do, nothing is contracted), so the floats are bit-identical.  A missing row scale
// skips `v * 1`, which is v itself; a missing bias adds zeros, as the scalar loop does.
PYG_QUANT_TARGET_AVX512 void affine_row_avx512(const int32_t* sums, const float* lo, const float* scale,
                                               const float* bias, float row_sum, float self_w,
                                               const uint8_t* self_codes, const float* row_scale, int64_t row,
                                               bool relu, int64_t cols, float* o) {
  const __m512 row_sum_v = _mm512_set1_ps(row_sum), self_w_v = _mm512_set1_ps(self_w);
  const __m512 row_s_v = _mm512_set1_ps(row_scale != nullptr ? row_scale[row] : 1.0f);
  for (int64_t d = 0; d < cols; d += 16) {
    const __mmask16 m = static_cast<__mmask16>(cols - d >= 16 ? 0xffffu : (1u << (cols - d)) - 1u);
    const __m512 product = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, sums + d));
    const __m512 lo_v = _mm512_maskz_loadu_ps(m, lo + d), scale_v = _mm512_maskz_loadu_ps(m, scale + d);
    const __m512 code = self_codes != nullptr
                            ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, self_codes + d)))
                            : _mm512_setzero_ps();
    const __m512 self_value = _mm512_add_ps(lo_v, _mm512_mul_ps(scale_v, code));
    __m512 v = _mm512_add_ps(_mm512_mul_ps(lo_v, row_sum_v), _mm512_mul_ps(scale_v, product));
    v = _mm512_add_ps(v, _mm512_mul_ps(self_w_v, self_value));
    if (row_scale != nullptr) v = _mm512_mul_ps(v, row_s_v);
    v = _mm512_add_ps(v, bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + d) : _mm512_setzero_ps());
    if (relu) v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NLE_UQ), v);  // NaN kept
    _mm512_mask_storeu_ps(o + d, m, v);
  }
}

// row_sums_avx512 and affine_row_avx512 with AVX2, 8 columns a register: NC registers (up to 64 columns) of sums at a
// time.  `code_end`: the end of x's codes, past which the last register of a row does not load 8 bytes.
PYG_QUANT_TARGET_AVX2 inline __m256i codes8(const uint8_t* src, int64_t n, const uint8_t* code_end) {
  uint64_t v = 0;
  if (n == 8 || src + 8 <= code_end) {
    std::memcpy(&v, src, 8);
  } else {
    for (int64_t j = 0; j < n; ++j) v |= static_cast<uint64_t>(src[j]) << (8 * j);
  }
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v)));
}

template <int NC>
PYG_QUANT_TARGET_AVX2 void row_sums_avx2(const RowSource& s, int64_t d0, int64_t live, uint32_t* dst,
                                         const uint8_t* code_end) {
  const int64_t last = live - 8 * (NC - 1);  // columns of the last register: 1..8
  __m256i acc[NC];
#pragma GCC unroll 8
  for (int k = 0; k < NC; ++k) {
    if (s.dense_row != nullptr) {
      alignas(32) uint32_t low[8] = {};  // the int64 dense sums' low 32 bits, as the uint32 sums keep them
      for (int64_t j = 0; j < (k == NC - 1 ? last : 8); ++j) low[j] = static_cast<uint32_t>(s.dense_row[d0 + 8 * k + j]);
      acc[k] = _mm256_load_si256(reinterpret_cast<const __m256i*>(low));
    } else {
      acc[k] = _mm256_setzero_si256();
    }
  }
  for (int64_t i = 0; i < s.num_sparse; ++i) {
    const int64_t t = s.sparse[i];
    const uint64_t* trow = s.tiles + t * kTileRows * kTileWords64 + s.r * kTileWords64;
    const uint8_t* base = s.code + static_cast<int64_t>(s.tcol[t]) * kTileCols * s.cols + d0;
    for (int a = 0; a < s.a_bits; ++a) {
      const __m128i shift = _mm_cvtsi32_si128(a);
      for (int64_t w = 0; w < kTileWords64; ++w) {
        for (uint64_t v = trow[a * s.tile_plane + w]; v; v &= v - 1) {
          const uint8_t* src = base + (w * 64 + __builtin_ctzll(v)) * s.cols;
#pragma GCC unroll 8
          for (int k = 0; k < NC; ++k) {
            acc[k] = _mm256_add_epi32(acc[k], _mm256_sll_epi32(codes8(src + 8 * k, k == NC - 1 ? last : 8, code_end),
                                                               shift));
          }
        }
      }
    }
  }
  for (int64_t e = s.e0; e < s.e1; ++e) {
    const uint8_t* src = s.code + static_cast<int64_t>(s.rcol[e]) * s.cols + d0;
    if (s.rval == nullptr) {
#pragma GCC unroll 8
      for (int k = 0; k < NC; ++k) acc[k] = _mm256_add_epi32(acc[k], codes8(src + 8 * k, k == NC - 1 ? last : 8, code_end));
    } else {
      const __m256i weight = _mm256_set1_epi32(s.rval[e]);
#pragma GCC unroll 8
      for (int k = 0; k < NC; ++k) {
        acc[k] = _mm256_add_epi32(acc[k],
                                  _mm256_mullo_epi32(weight, codes8(src + 8 * k, k == NC - 1 ? last : 8, code_end)));
      }
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < NC - 1; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * k), acc[k]);
  alignas(32) uint32_t tail[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tail), acc[NC - 1]);
  std::memcpy(dst + 8 * (NC - 1), tail, last * sizeof(uint32_t));
}

using RowSumsAvx2Fn = void (*)(const RowSource&, int64_t, int64_t, uint32_t*, const uint8_t*);
constexpr RowSumsAvx2Fn kRowSumsAvx2[] = {nullptr, row_sums_avx2<1>, row_sums_avx2<2>, row_sums_avx2<3>,
                                          row_sums_avx2<4>, row_sums_avx2<5>, row_sums_avx2<6>, row_sums_avx2<7>,
                                          row_sums_avx2<8>};
constexpr int64_t kAvx2Cols = 64;  // columns of one row_sums_avx2 call

PYG_QUANT_TARGET_AVX2 void affine_row_avx2(const int32_t* sums, const float* lo, const float* scale,
                                           const float* bias, float row_sum, float self_w, const uint8_t* self_codes,
                                           const float* row_scale, int64_t row, bool relu, int64_t cols, float* o) {
  const __m256 row_sum_v = _mm256_set1_ps(row_sum), self_w_v = _mm256_set1_ps(self_w), zero = _mm256_setzero_ps();
  const float row_s = row_scale != nullptr ? row_scale[row] : 1.0f;
  const __m256 row_s_v = _mm256_set1_ps(row_s);
  int64_t d = 0;
  for (; d + 8 <= cols; d += 8) {
    const __m256 product = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + d)));
    const __m256 lo_v = _mm256_loadu_ps(lo + d), scale_v = _mm256_loadu_ps(scale + d);
    __m256 code = zero;
    if (self_codes != nullptr) {
      uint64_t c8;
      std::memcpy(&c8, self_codes + d, 8);
      code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(c8))));
    }
    const __m256 self_value = _mm256_add_ps(lo_v, _mm256_mul_ps(scale_v, code));
    __m256 v = _mm256_add_ps(_mm256_mul_ps(lo_v, row_sum_v), _mm256_mul_ps(scale_v, product));
    v = _mm256_add_ps(v, _mm256_mul_ps(self_w_v, self_value));
    if (row_scale != nullptr) v = _mm256_mul_ps(v, row_s_v);
    v = _mm256_add_ps(v, bias != nullptr ? _mm256_loadu_ps(bias + d) : zero);
    if (relu) v = _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_NLE_UQ), v);  // NaN kept
    _mm256_storeu_ps(o + d, v);
  }
  for (; d < cols; ++d) {
    o[d] = affine_epilogue(static_cast<float>(sums[d]), lo[d], scale[d], row_sum, self_w,
                           self_codes ? static_cast<float>(self_codes[d]) : 0.0f, row_s, bias ? bias[d] : 0.0f, relu);
  }
}
#endif

// Where a row's sums go: the int32 or int64 product, or affine_epilogue's floats.
struct RowSink {
  int32_t* out32 = nullptr;
  int64_t* out64 = nullptr;
  float* out_f = nullptr;
  const float *lo = nullptr, *scale = nullptr, *self_w = nullptr, *row_scale = nullptr, *bias = nullptr;
  const int64_t* row_sums = nullptr;
  const uint8_t* self_codes = nullptr;  // x's codes [nodes_pad, cols] for the self term, or null
  int64_t self_len = 0;
  bool relu = false;
};

// The integer product of bit_spmm_int (wide: exact int64, else the int32 low bits) or, with an affine sink, the
// epilogue applied to each row right after its exact sums.  Rows sum in 32-bit lanes unless a bound on the row
// (Σ|weights| · (2^x_bits - 1)) reaches 2^31 for an exact result, when they sum in int64.
void bit_spmm_rows(const at::Tensor& window_ptr_in, const at::Tensor& tile_col_in, const at::Tensor& tile_bits_in,
                   const at::Tensor& res_ptr_in, const at::Tensor& res_col_in,
                   const std::optional<at::Tensor>& res_val_in, const at::Tensor& x, int64_t rows, int64_t cols,
                   bool exact, const at::Tensor& codes, RowSink sink) {
  const int64_t num_windows = window_ptr_in.size(0) - 1;
  const auto window_ptr = window_ptr_in.contiguous();
  const auto tile_col = tile_col_in.contiguous();
  const auto tile_bits = tile_bits_in.contiguous();
  const int a_bits = tile_bits.size(0), x_bits = x.size(0);
  const int64_t num_tiles = tile_bits.size(1);
  const int64_t x_words64 = x.size(2) / 2, x_outer = x.size(1);
  const int64_t* wptr = window_ptr.data_ptr<int64_t>();
  const int32_t* tcol = tile_col.data_ptr<int32_t>();
  const uint64_t* tiles = as_u64(tile_bits.data_ptr<int32_t>());
  const uint64_t* xp = as_u64(x.data_ptr<int32_t>());
  const int64_t tile_plane = num_tiles * kTileRows * kTileWords64;
  const int64_t x_plane = x_outer * x_words64;
  const auto res_ptr = res_ptr_in.contiguous();
  const auto res_col = res_col_in.contiguous();
  const auto res_val = res_val_in.has_value() ? res_val_in->contiguous() : at::Tensor();
  const int64_t* rptr = res_ptr.data_ptr<int64_t>();
  const int32_t* rcol = res_col.data_ptr<int32_t>();
  const int32_t* rval = res_val.defined() ? res_val.data_ptr<int32_t>() : nullptr;
  const uint8_t* code = codes.defined() ? codes.data_ptr<uint8_t>() : nullptr;
  const int64_t x_max = (int64_t{1} << x_bits) - 1;
  const bool avx512 = cpu_has_avx512_vnni(), avx2 = !avx512 && cpu_has_avx2();
  const uint8_t* code_end = code != nullptr ? code + codes.numel() : nullptr;
  at::parallel_for(0, num_windows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> dense(kTileRows * cols), wide_row(cols), sparse, dense_tiles;
    std::vector<uint32_t> sums(cols);
    for (int64_t win = begin; win < end; ++win) {
      const int64_t live_rows = std::min<int64_t>(kTileRows, rows - win * kTileRows);
      if (live_rows <= 0) continue;
      sparse.clear();
      dense_tiles.clear();
      for (int64_t t = wptr[win]; t < wptr[win + 1]; ++t) {
        const uint64_t* tile = tiles + t * kTileRows * kTileWords64;
        int64_t set_bits = 0;
        for (int a = 0; a < a_bits; ++a)
          for (int64_t w = 0; w < kTileRows * kTileWords64; ++w) set_bits += popcount64(tile[a * tile_plane + w]);
        (set_bits < kSparseTileBitsPerPlanePair * a_bits * x_bits ? sparse : dense_tiles).push_back(t);
      }
      if (!dense_tiles.empty()) {
        // Dense tiles: popcounts of tile rows against x's plane words, exact in int64.
        std::fill(dense.begin(), dense.end(), int64_t{0});
        for (const int64_t t : dense_tiles) {
          const uint64_t* tile = tiles + t * kTileRows * kTileWords64;
          const uint64_t* xcol = xp + static_cast<int64_t>(tcol[t]) * kTileWords64;
          for (int64_t d = 0; d < cols; ++d) {
            for (int q = 0; q < x_bits; ++q) {
              const uint64_t* xv = xcol + q * x_plane + d * x_words64;
              const uint64_t x0 = xv[0], x1 = xv[1], x2 = xv[2], x3 = xv[3];
              if ((x0 | x1 | x2 | x3) == 0) continue;
              for (int64_t r = 0; r < live_rows; ++r) {
                int64_t sum = 0;
                for (int a = 0; a < a_bits; ++a) {
                  const uint64_t* av = tile + a * tile_plane + r * kTileWords64;
                  const int64_t count = popcount64(av[0] & x0) + popcount64(av[1] & x1) + popcount64(av[2] & x2) +
                                        popcount64(av[3] & x3);
                  sum += count << a;
                }
                dense[r * cols + d] += sum << q;
              }
            }
          }
        }
      }
      for (int64_t r = 0; r < live_rows; ++r) {
        const int64_t row = win * kTileRows + r;
        const RowSource src{code,  cols, tiles, tile_plane, a_bits, tcol,          sparse.data(),
                            static_cast<int64_t>(sparse.size()),       r,    rcol, rval,
                            rptr[row], rptr[row + 1], dense_tiles.empty() ? nullptr : dense.data() + r * cols};
        // Whether 32-bit sums are exact: Σ over the row's entries of |weight| · (2^x_bits - 1) stays below 2^31
        // (the loop stops once it cannot).
        bool fits = true;
        if (exact) {
          constexpr int64_t kLimit = int64_t{1} << 31;
          int64_t bound = 0;
          for (int64_t t = wptr[win]; t < wptr[win + 1] && bound < kLimit; ++t) {
            const uint64_t* trow = tiles + t * kTileRows * kTileWords64 + r * kTileWords64;
            for (int a = 0; a < a_bits; ++a)
              for (int64_t w = 0; w < kTileWords64; ++w)
                bound += static_cast<int64_t>(popcount64(trow[a * tile_plane + w])) * x_max << a;
          }
          if (rval == nullptr) {
            bound += (src.e1 - src.e0) * x_max;
          } else {
            for (int64_t e = src.e0; e < src.e1 && bound < kLimit; ++e) bound += std::abs(int64_t{rval[e]}) * x_max;
          }
          fits = bound < kLimit;
        }
        int32_t* sums32 = sink.out32 != nullptr ? sink.out32 + row * cols : reinterpret_cast<int32_t*>(sums.data());
        const int64_t* wide_sums = nullptr;
        if (fits) {
          for (int64_t d0 = 0; d0 < cols; d0 += kColBlock) {
            const int64_t live = std::min<int64_t>(kColBlock, cols - d0);
            uint32_t* dst = reinterpret_cast<uint32_t*>(sums32) + d0;
#if defined(PYG_QUANT_X86_DISPATCH)
            if (avx512) {
              kRowSumsAvx512[(live + 15) / 16](src, d0, live, dst);
              continue;
            }
            if (avx2) {
              for (int64_t e0 = 0; e0 < live; e0 += kAvx2Cols) {
                const int64_t n = std::min(kAvx2Cols, live - e0);
                kRowSumsAvx2[(n + 7) / 8](src, d0 + e0, n, dst + e0, code_end);
              }
              continue;
            }
#endif
            row_sums_scalar<uint32_t>(src, d0, live, dst);
          }
          if (sink.out64 != nullptr) {
            for (int64_t d = 0; d < cols; ++d) sink.out64[row * cols + d] = sums32[d];
          }
        } else {
          int64_t* dst = sink.out64 != nullptr ? sink.out64 + row * cols : wide_row.data();
          row_sums_scalar<int64_t>(src, 0, src.cols, dst);
          wide_sums = dst;
        }
        if (sink.out_f == nullptr) continue;
        const float self_w = sink.self_w ? sink.self_w[sink.self_len == 1 ? 0 : row] : 0.0f;
        const float row_s = sink.row_scale ? sink.row_scale[row] : 1.0f;
        const float row_sum = static_cast<float>(sink.row_sums[row]);
        const uint8_t* self_codes = sink.self_codes ? sink.self_codes + row * cols : nullptr;
        float* o = sink.out_f + row * cols;
#if defined(PYG_QUANT_X86_DISPATCH)
        if (avx512 && wide_sums == nullptr) {
          affine_row_avx512(sums32, sink.lo, sink.scale, sink.bias, row_sum, self_w, self_codes, sink.row_scale, row,
                            sink.relu, cols, o);
          continue;
        }
        if (avx2 && wide_sums == nullptr) {
          affine_row_avx2(sums32, sink.lo, sink.scale, sink.bias, row_sum, self_w, self_codes, sink.row_scale, row,
                          sink.relu, cols, o);
          continue;
        }
#endif
        for (int64_t d = 0; d < cols; ++d) {
          const float product = wide_sums ? static_cast<float>(wide_sums[d]) : static_cast<float>(sums32[d]);
          o[d] = affine_epilogue(product, sink.lo[d], sink.scale[d], row_sum, self_w,
                                 self_codes ? static_cast<float>(self_codes[d]) : 0.0f, row_s,
                                 sink.bias ? sink.bias[d] : 0.0f, sink.relu);
        }
      }
    }
  });
}

// The checks of both ops, and x's unpacked codes [nodes_pad, cols] when the product (or the self term) reads them.
at::Tensor check_and_unpack(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                            const at::Tensor& res_ptr, const at::Tensor& res_col,
                            const std::optional<at::Tensor>& res_val, const at::Tensor& x, int64_t rows, int64_t cols,
                            const std::optional<at::Tensor>& x_codes, bool self_term) {
  // x_codes is checked for the schema's sake: the CPU walks its own unpacked codes.
  check_spmm_operands(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols, x_codes);
  const int64_t x_words64 = x.size(2) / 2;
  if (tile_col.numel() > 0) {
    const auto [min_col, max_col] = int32_extrema(tile_col.contiguous());
    TORCH_CHECK_VALUE(min_col >= 0 && (max_col + 1) * kTileWords64 <= x_words64,
                      "tile_col points past x_planes' node words");
  }
  if (res_col.numel() > 0) {
    const auto [min_col, max_col] = int32_extrema(res_col.contiguous());
    TORCH_CHECK_VALUE(min_col >= 0 && max_col < x_words64 * 64, "res_col points past x_planes' nodes");
  }
  if (res_col.numel() > 0 || tile_col.numel() > 0 || self_term) {
    return unpack_codes_cpu(x, x_words64 * 64, cols, /*col_layout=*/true);
  }
  return at::Tensor();
}

}  // namespace

at::Tensor bit_spmm_int_cpu(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                            const at::Tensor& res_ptr, const at::Tensor& res_col,
                            const std::optional<at::Tensor>& res_val, const at::Tensor& x_in, int64_t rows,
                            int64_t cols, bool wide, const std::optional<at::Tensor>& x_codes) {
  const auto x = x_in.contiguous();
  const auto codes =
      check_and_unpack(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols, x_codes, false);
  // Every row is written (each lies in a window), so the output needs no zero fill.
  auto out = at::empty({rows, cols}, x.options().dtype(wide ? at::kLong : at::kInt));
  RowSink sink;
  if (wide) {
    sink.out64 = out.data_ptr<int64_t>();
  } else {
    sink.out32 = out.data_ptr<int32_t>();
  }
  bit_spmm_rows(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols, /*exact=*/wide, codes,
                sink);
  return out;
}

// Each row's exact product, then csrc/epilogue.h on it while it is in cache (the same arithmetic as the GPU's).
at::Tensor bit_spmm_affine_cpu(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                               const at::Tensor& res_ptr, const at::Tensor& res_col,
                               const std::optional<at::Tensor>& res_val, const at::Tensor& x_in, const at::Tensor& lo,
                               const at::Tensor& scale, const at::Tensor& row_sums,
                               const std::optional<at::Tensor>& self_weight, const std::optional<at::Tensor>& row_scale,
                               const std::optional<at::Tensor>& bias, bool relu, int64_t rows, int64_t cols,
                               bool wide, const std::optional<at::Tensor>& x_codes) {
  const int64_t self_len = check_spmm_affine_vectors(lo, scale, row_sums, self_weight, row_scale, bias, x_in, rows,
                                                     cols);
  const auto x = x_in.contiguous();
  const auto codes = check_and_unpack(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols,
                                      x_codes, self_weight.has_value());
  const auto lo_c = lo.contiguous(), scale_c = scale.contiguous(), row_sums_c = row_sums.contiguous();
  const auto self_c = self_weight.has_value() ? self_weight->contiguous() : at::Tensor();
  const auto row_scale_c = row_scale.has_value() ? row_scale->contiguous() : at::Tensor();
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto out = at::empty({rows, cols}, x.options().dtype(at::kFloat));
  RowSink sink;
  sink.out_f = out.data_ptr<float>();
  sink.lo = lo_c.data_ptr<float>();
  sink.scale = scale_c.data_ptr<float>();
  sink.row_sums = row_sums_c.data_ptr<int64_t>();
  sink.self_w = self_c.defined() ? self_c.data_ptr<float>() : nullptr;
  sink.row_scale = row_scale_c.defined() ? row_scale_c.data_ptr<float>() : nullptr;
  sink.bias = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  sink.self_codes = self_weight.has_value() ? codes.data_ptr<uint8_t>() : nullptr;
  sink.self_len = self_len;
  sink.relu = relu;
  // The product is exact whatever the caller's bound says: 32-bit sums only for rows where they are.
  (void)wide;
  bit_spmm_rows(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols, /*exact=*/true, codes,
                sink);
  return out;
}

}  // namespace pyg_quant
