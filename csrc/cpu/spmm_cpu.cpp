// Aggregation over a block-sparse bit adjacency: out[i, d] = Σ_j A_ij · Q_jd.
// Only stored (non-empty) tiles are visited: zero tiles cost nothing.  A tile
// row of column tile c lines up with words 8c..8c+7 of every column-layout
// feature plane (pyg_quant/layout.py), so features are read in place; each
// tile is loaded once and used for every feature and every plane pair.
// Entries of blocks too sparse for a tile come from the CSR residual: each adds
// its source's codes (unpacked once per call) to its row.  On a CPU a sparse
// tile is also cheaper walked bit by bit than popcounted (the popcount work of a
// tile does not shrink with its fill), so tiles under kSparseTileBitsPerPlanePair
// set bits per plane pair take that path; both paths give the same integers.
#include "spmm_cpu.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
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
// A walked set bit costs about one vectorised code row add (cols/8 instructions),
// a popcounted tile about 16 rows × 4 words × cols × plane pairs popcounts: the
// walk wins below ~64 set bits per plane pair.
constexpr int64_t kSparseTileBitsPerPlanePair = 64;
}  // namespace

namespace {

// Whether every sum of a row's products stays below 2^31, so that 32-bit sums are exact: at most (the longest
// residual row × its largest weight + the most tiles a window holds × 256 columns × (2^a_bits - 1)) × (2^x_bits - 1).
// Weights (res_val) are the adjacency's non-negative codes; a negative one sends the caller to 64-bit sums.
bool sums_fit_31_bits(const at::Tensor& window_ptr, const at::Tensor& res_ptr, const at::Tensor& res_val,
                      int a_bits, int x_bits, int64_t rows) {
  int64_t longest_row = 0, largest_weight = 1, most_tiles = 0;
  if (rows > 0) longest_row = (res_ptr.narrow(0, 1, rows) - res_ptr.narrow(0, 0, rows)).max().item<int64_t>();
  if (res_val.defined() && res_val.numel() > 0) {
    if (res_val.min().item<int32_t>() < 0) return false;
    largest_weight = res_val.max().item<int32_t>();
  }
  if (window_ptr.size(0) > 1) {
    const int64_t windows = window_ptr.size(0) - 1;
    most_tiles = (window_ptr.narrow(0, 1, windows) - window_ptr.narrow(0, 0, windows)).max().item<int64_t>();
  }
  const double bound = (static_cast<double>(longest_row) * static_cast<double>(largest_weight) +
                        static_cast<double>(most_tiles) * kTileCols * static_cast<double>((1 << a_bits) - 1)) *
                       static_cast<double>((1 << x_bits) - 1);
  return bound < 2147483648.0;
}

// The least and the largest entry of an int32 tensor (n > 0) in one pass over its memory: a loop, not two ATen
// reductions and their dispatch, for the bounds checks below.
std::pair<int32_t, int32_t> int32_extrema(const at::Tensor& t) {
  const int32_t* p = t.data_ptr<int32_t>();
  const auto [lo, hi] = std::minmax_element(p, p + t.numel());
  return {*lo, *hi};
}

#if defined(PYG_QUANT_X86_DISPATCH)
// acc_row[d] += Σ_e weight_e · src_e[d] over residual entries [e0, e1) (weight 1 without rval), in uint32 lanes
// that wrap as the scalar loop's uint32 sums do, 16 columns a vector held in a register across the entries.
PYG_QUANT_TARGET_AVX512 void residual_row_avx512(uint32_t* acc_row, const uint8_t* code, int64_t cols,
                                                 const int32_t* rcol, const int32_t* rval, int64_t e0, int64_t e1) {
  for (int64_t d0 = 0; d0 < cols; d0 += 16) {
    const int64_t live = std::min<int64_t>(16, cols - d0);
    const __mmask16 m = static_cast<__mmask16>(live == 16 ? 0xffffu : (1u << live) - 1u);
    __m512i acc = _mm512_maskz_loadu_epi32(m, acc_row + d0);
    if (rval == nullptr) {
      for (int64_t e = e0; e < e1; ++e) {
        const uint8_t* src = code + static_cast<int64_t>(rcol[e]) * cols + d0;
        acc = _mm512_add_epi32(acc, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, src)));
      }
    } else {
      for (int64_t e = e0; e < e1; ++e) {
        const uint8_t* src = code + static_cast<int64_t>(rcol[e]) * cols + d0;
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(_mm512_set1_epi32(rval[e]),
                                                       _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, src))));
      }
    }
    _mm512_mask_storeu_epi32(acc_row + d0, m, acc);
  }
}
#endif

// Whether a row's residual entries were added by the vector kernel: uint32 sums on a CPU that has it.
template <typename Acc>
bool residual_row_vectorized(bool vector_residual, Acc* acc_row, const uint8_t* code, int64_t cols,
                             const int32_t* rcol, const int32_t* rval, int64_t e0, int64_t e1) {
#if defined(PYG_QUANT_X86_DISPATCH)
  if constexpr (std::is_same_v<Acc, uint32_t>) {
    if (vector_residual) {
      residual_row_avx512(acc_row, code, cols, rcol, rval, e0, e1);
      return true;
    }
  }
#endif
  return false;
}

// bit_spmm_int; `unpacked` (if given) receives x's unpacked codes [nodes_pad, cols] when the product needed them
// (undefined otherwise), so that the affine epilogue's self term does not unpack them again.
at::Tensor bit_spmm_int_impl(const at::Tensor& window_ptr_in, const at::Tensor& tile_col_in,
                             const at::Tensor& tile_bits_in, const at::Tensor& res_ptr_in, const at::Tensor& res_col_in,
                             const std::optional<at::Tensor>& res_val_in, const at::Tensor& x_in, int64_t rows,
                             int64_t cols, bool wide, const std::optional<at::Tensor>& x_codes, at::Tensor* unpacked) {
  // x_codes is checked for the schema's sake: the CPU walks its own unpacked codes.
  check_spmm_operands(window_ptr_in, tile_col_in, tile_bits_in, res_ptr_in, res_col_in, res_val_in, x_in, rows, cols,
                      x_codes);
  const int64_t num_windows = window_ptr_in.size(0) - 1;
  const auto window_ptr = window_ptr_in.contiguous();
  const auto tile_col = tile_col_in.contiguous();
  const auto tile_bits = tile_bits_in.contiguous();
  const auto x = x_in.contiguous();
  const int a_bits = tile_bits.size(0), x_bits = x.size(0);
  const int64_t num_tiles = tile_bits.size(1);
  const int64_t x_words64 = x.size(2) / 2, x_outer = x.size(1);
  const int64_t* wptr = window_ptr.data_ptr<int64_t>();
  const int32_t* tcol = tile_col.data_ptr<int32_t>();
  const uint64_t* tiles = as_u64(tile_bits.data_ptr<int32_t>());
  const uint64_t* xp = as_u64(x.data_ptr<int32_t>());
  const int64_t tile_plane = num_tiles * kTileRows * kTileWords64;
  const int64_t x_plane = x_outer * x_words64;
  if (num_tiles > 0) {
    const auto [min_col, max_col] = int32_extrema(tile_col);
    TORCH_CHECK_VALUE(min_col >= 0 && (max_col + 1) * kTileWords64 <= x_words64,
                      "tile_col points past x_planes' node words");
  }

  const auto res_ptr = res_ptr_in.contiguous();
  const auto res_col = res_col_in.contiguous();
  const auto res_val = res_val_in.has_value() ? res_val_in->contiguous() : at::Tensor();
  const int64_t* rptr = res_ptr.data_ptr<int64_t>();
  const int32_t* rcol = res_col.data_ptr<int32_t>();
  const int32_t* rval = res_val.defined() ? res_val.data_ptr<int32_t>() : nullptr;
  at::Tensor codes;  // [nodes_pad, cols] uint8
  if (res_col.numel() > 0) {
    const auto [min_col, max_col] = int32_extrema(res_col);
    TORCH_CHECK_VALUE(min_col >= 0 && max_col < x_words64 * 64, "res_col points past x_planes' nodes");
  }
  if (res_col.numel() > 0 || num_tiles > 0) codes = unpack_codes_cpu(x, x_words64 * 64, cols, /*col_layout=*/true);
  const uint8_t* code = codes.defined() ? codes.data_ptr<uint8_t>() : nullptr;

  // Every row is written below (each lies in a window), so the output needs no zero fill.
  auto out = at::empty({rows, cols}, x.options().dtype(wide ? at::kLong : at::kInt));
  int64_t* out64 = wide ? out.data_ptr<int64_t>() : nullptr;
  int32_t* out32 = wide ? nullptr : out.data_ptr<int32_t>();

  // The window loop, summing in Acc: uint32_t for int32 results (wrapping sums give the int64 sums' low 32 bits,
  // which is what the int32 result keeps) or when no sum can reach 2^31 (sums_fit_31_bits), else int64_t.  A vector
  // add of the residual's code rows then takes twice the lanes, each code widened to 32 bits instead of 64.
  const bool vector_residual = cpu_has_avx512_vnni();
  const auto run = [&](auto acc_tag) {
    using Acc = decltype(acc_tag);
    at::parallel_for(0, num_windows, 1, [&](int64_t begin, int64_t end) {
      std::vector<Acc> acc(kTileRows * cols);
      for (int64_t win = begin; win < end; ++win) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        const int64_t live_rows = std::min<int64_t>(kTileRows, rows - win * kTileRows);
        if (live_rows <= 0) continue;
        for (int64_t t = wptr[win]; t < wptr[win + 1]; ++t) {
          const uint64_t* tile = tiles + t * kTileRows * kTileWords64;
          int64_t set_bits = 0;
          for (int a = 0; a < a_bits; ++a)
            for (int64_t w = 0; w < kTileRows * kTileWords64; ++w) set_bits += popcount64(tile[a * tile_plane + w]);
          if (set_bits < kSparseTileBitsPerPlanePair * a_bits * x_bits) {
            const int64_t first_node = static_cast<int64_t>(tcol[t]) * kTileWords64 * 64;
            for (int a = 0; a < a_bits; ++a) {
              for (int64_t r = 0; r < live_rows; ++r) {
                Acc* acc_row = acc.data() + r * cols;
                for (int64_t w = 0; w < kTileWords64; ++w) {
                  for (uint64_t v = tile[a * tile_plane + r * kTileWords64 + w]; v; v &= v - 1) {
                    const uint8_t* src = code + (first_node + w * 64 + __builtin_ctzll(v)) * cols;
                    for (int64_t d = 0; d < cols; ++d) acc_row[d] += static_cast<Acc>(src[d]) << a;
                  }
                }
              }
            }
            continue;
          }
          const uint64_t* xcol = xp + static_cast<int64_t>(tcol[t]) * kTileWords64;
          for (int64_t d = 0; d < cols; ++d) {
            for (int q = 0; q < x_bits; ++q) {
              const uint64_t* xv = xcol + q * x_plane + d * x_words64;
              const uint64_t x0 = xv[0], x1 = xv[1], x2 = xv[2], x3 = xv[3];
              if ((x0 | x1 | x2 | x3) == 0) continue;
              for (int64_t r = 0; r < live_rows; ++r) {
                Acc sum = 0;
                for (int a = 0; a < a_bits; ++a) {
                  const uint64_t* av = tile + a * tile_plane + r * kTileWords64;
                  const Acc count = static_cast<Acc>(popcount64(av[0] & x0) + popcount64(av[1] & x1) +
                                                     popcount64(av[2] & x2) + popcount64(av[3] & x3));
                  sum += count << a;
                }
                acc[r * cols + d] += sum << q;
              }
            }
          }
        }
        for (int64_t r = 0; r < live_rows; ++r) {
          const int64_t row = win * kTileRows + r;
          Acc* __restrict__ acc_row = acc.data() + r * cols;
          if (residual_row_vectorized(vector_residual, acc_row, code, cols, rcol, rval, rptr[row], rptr[row + 1])) {
            // added by the vector kernel
          } else if (rval == nullptr) {
            for (int64_t e = rptr[row]; e < rptr[row + 1]; ++e) {
              const uint8_t* __restrict__ src = code + static_cast<int64_t>(rcol[e]) * cols;
              for (int64_t d = 0; d < cols; ++d) acc_row[d] += static_cast<Acc>(src[d]);
            }
          } else {
            for (int64_t e = rptr[row]; e < rptr[row + 1]; ++e) {
              const uint8_t* __restrict__ src = code + static_cast<int64_t>(rcol[e]) * cols;
              const Acc weight = static_cast<Acc>(rval[e]);
              for (int64_t d = 0; d < cols; ++d) acc_row[d] += weight * static_cast<Acc>(src[d]);
            }
          }
          for (int64_t d = 0; d < cols; ++d) {
            if (wide) {
              out64[row * cols + d] = static_cast<int64_t>(acc_row[d]);
            } else {
              out32[row * cols + d] = static_cast<int32_t>(acc_row[d]);
            }
          }
        }
      }
    });
  };
  if (!wide || sums_fit_31_bits(window_ptr, res_ptr, res_val, a_bits, x_bits, rows)) {
    run(uint32_t{});
  } else {
    run(int64_t{});
  }
  if (unpacked != nullptr) *unpacked = codes;
  return out;
}

}  // namespace

at::Tensor bit_spmm_int_cpu(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                            const at::Tensor& res_ptr, const at::Tensor& res_col,
                            const std::optional<at::Tensor>& res_val, const at::Tensor& x, int64_t rows, int64_t cols,
                            bool wide, const std::optional<at::Tensor>& x_codes) {
  return bit_spmm_int_impl(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols, wide, x_codes,
                           nullptr);
}

// The integer product, then csrc/epilogue.h row by row (the same arithmetic as the GPU's).
at::Tensor bit_spmm_affine_cpu(const at::Tensor& window_ptr, const at::Tensor& tile_col, const at::Tensor& tile_bits,
                               const at::Tensor& res_ptr, const at::Tensor& res_col,
                               const std::optional<at::Tensor>& res_val, const at::Tensor& x, const at::Tensor& lo,
                               const at::Tensor& scale, const at::Tensor& row_sums,
                               const std::optional<at::Tensor>& self_weight, const std::optional<at::Tensor>& row_scale,
                               const std::optional<at::Tensor>& bias, bool relu, int64_t rows, int64_t cols,
                               bool wide, const std::optional<at::Tensor>& x_codes) {
  const int64_t self_len = check_spmm_affine_vectors(lo, scale, row_sums, self_weight, row_scale, bias, x, rows, cols);
  at::Tensor codes;  // x's codes, unpacked once for the product and the self term
  const auto product = bit_spmm_int_impl(window_ptr, tile_col, tile_bits, res_ptr, res_col, res_val, x, rows, cols,
                                         /*wide=*/true, x_codes, &codes);
  if (self_weight.has_value()) {
    if (!codes.defined()) codes = unpack_codes_cpu(x.contiguous(), x.size(2) * 32, cols, /*col_layout=*/true);
  } else {
    codes = at::Tensor();
  }
  const auto lo_c = lo.contiguous(), scale_c = scale.contiguous(), row_sums_c = row_sums.contiguous();
  const auto self_c = self_weight.has_value() ? self_weight->contiguous() : at::Tensor();
  const auto row_scale_c = row_scale.has_value() ? row_scale->contiguous() : at::Tensor();
  const auto bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* lo_p = lo_c.data_ptr<float>();
  const float* scale_p = scale_c.data_ptr<float>();
  const int64_t* row_sum_p = row_sums_c.data_ptr<int64_t>();
  const float* self_p = self_c.defined() ? self_c.data_ptr<float>() : nullptr;
  const float* row_scale_p = row_scale_c.defined() ? row_scale_c.data_ptr<float>() : nullptr;
  const float* bias_p = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  const uint8_t* code_p = codes.defined() ? codes.data_ptr<uint8_t>() : nullptr;
  const int64_t* prod_p = product.data_ptr<int64_t>();
  auto out = at::empty({rows, cols}, x.options().dtype(at::kFloat));
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const double self_w = self_p ? static_cast<double>(self_p[self_len == 1 ? 0 : row]) : 0.0;
      const double row_s = row_scale_p ? static_cast<double>(row_scale_p[row]) : 1.0;
      for (int64_t d = 0; d < cols; ++d) {
        const float self_code = code_p ? static_cast<float>(code_p[row * cols + d]) : 0.0f;
        out_p[row * cols + d] = affine_epilogue(static_cast<double>(prod_p[row * cols + d]), lo_p[d], scale_p[d],
                                                static_cast<double>(row_sum_p[row]), self_w, self_code, row_s,
                                                bias_p ? static_cast<double>(bias_p[d]) : 0.0, relu);
      }
    }
  });
  (void)wide;  // the product is exact whatever the caller's bound says: int64, from 32-bit sums only where they fit
  return out;
}

}  // namespace pyg_quant
