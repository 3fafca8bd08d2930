// Any-bitwidth integer GEMM on bit planes: out = Σ_{p,q} 2^(p+q) · popc(A_p & B_q).
// A is row-layout planes [s, M_pad, W], B col-layout planes [t, N_pad, W] (see
// pyg_quant/layout.py): both run their bits along K, so one output entry is a
// dot product of two bit vectors per plane pair.  Each 64-bit word of A's planes
// is loaded once and used against every plane of B (QGTC's cross-plane reuse);
// the per-pair counts stay below K and combine into int64 at the end.
#include "bitmm_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "popcount.h"
#include "../epilogue.h"

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

}  // namespace

at::Tensor bitmm_int_cpu(const at::Tensor& a_in, const at::Tensor& b_in, int64_t rows, int64_t cols, bool wide) {
  TORCH_CHECK_VALUE(a_in.dim() == 3 && b_in.dim() == 3 && a_in.scalar_type() == at::kInt &&
                        b_in.scalar_type() == at::kInt,
                    "a_planes and b_planes must be int32[bits, outer, words]");
  TORCH_CHECK_VALUE(a_in.size(2) == b_in.size(2) && a_in.size(2) % 2 == 0,
                    "a_planes and b_planes must pack the same (even) number of words along K");
  TORCH_CHECK_VALUE(a_in.size(0) <= 8 && b_in.size(0) <= 8, "at most 8 bit planes per operand");
  TORCH_CHECK_VALUE(rows <= a_in.size(1) && cols <= b_in.size(1), "rows/cols exceed the padded operands");
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

void check_bitmm_affine_args(const at::Tensor& product, const at::Tensor& row_sums, const at::Tensor& col_sums,
                             const at::Tensor& a_lo, const at::Tensor& a_scale, const at::Tensor& b_lo,
                             const at::Tensor& b_scale, int64_t k, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(product.dim() == 2 && (product.scalar_type() == at::kInt || product.scalar_type() == at::kLong),
                    "product must be a 2-D int32 or int64 tensor");
  const int64_t rows = product.size(0), cols = product.size(1);
  TORCH_CHECK_VALUE(row_sums.dim() == 1 && row_sums.size(0) == rows && row_sums.scalar_type() == at::kLong,
                    "row_sums must be int64 [", rows, "]");
  TORCH_CHECK_VALUE(col_sums.dim() == 1 && col_sums.size(0) == cols && col_sums.scalar_type() == at::kLong,
                    "col_sums must be int64 [", cols, "]");
  for (const auto* t : {&a_lo, &a_scale}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat,
                      "a_lo and a_scale must be float32 [", rows, "]");
  }
  for (const auto* t : {&b_lo, &b_scale}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == cols && t->scalar_type() == at::kFloat,
                      "b_lo and b_scale must be float32 [", cols, "]");
  }
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == cols && bias->scalar_type() == at::kFloat,
                      "bias must be float32 [", cols, "]");
  }
  TORCH_CHECK_VALUE(k >= 0, "k must be non-negative");
  for (const auto* t : {&row_sums, &col_sums, &a_lo, &a_scale, &b_lo, &b_scale}) {
    TORCH_CHECK_VALUE(t->device() == product.device(), "every operand must be on the product's device");
  }
  if (bias.has_value()) TORCH_CHECK_VALUE(bias->device() == product.device(), "bias must be on the product's device");
}

at::Tensor bitmm_affine_cpu(const at::Tensor& product_in, const at::Tensor& row_sums_in, const at::Tensor& col_sums_in,
                            const at::Tensor& a_lo_in, const at::Tensor& a_scale_in, const at::Tensor& b_lo_in,
                            const at::Tensor& b_scale_in, int64_t k, const std::optional<at::Tensor>& bias_in,
                            bool relu) {
  check_bitmm_affine_args(product_in, row_sums_in, col_sums_in, a_lo_in, a_scale_in, b_lo_in, b_scale_in, k, bias_in);
  const int64_t rows = product_in.size(0), cols = product_in.size(1);
  const auto product = product_in.to(at::kLong).contiguous();  // exact: |P| < 2^63, and < 2^53 after the bound check
  const auto row_sums = row_sums_in.contiguous(), col_sums = col_sums_in.contiguous();
  const auto a_lo = a_lo_in.contiguous(), a_scale = a_scale_in.contiguous();
  const auto b_lo = b_lo_in.contiguous(), b_scale = b_scale_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  auto out = at::empty({rows, cols}, a_lo.options());
  const int64_t* p = product.data_ptr<int64_t>();
  const int64_t *rs = row_sums.data_ptr<int64_t>(), *cs = col_sums.data_ptr<int64_t>();
  const float *la = a_lo.data_ptr<float>(), *ra = a_scale.data_ptr<float>();
  const float *lb = b_lo.data_ptr<float>(), *rb = b_scale.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const double kd = static_cast<double>(k);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        o[i * cols + j] = bitmm_affine_epilogue(static_cast<double>(p[i * cols + j]), static_cast<double>(rs[i]),
                                                static_cast<double>(cs[j]), la[i], ra[i], lb[j], rb[j], kd,
                                                bp ? bp[j] : 0.0f, relu);
      }
    }
  });
  return out;
}

}  // namespace pyg_quant
