// Fake quantization and the MSE range search on the CPU (the maths: csrc/fake_quantize.h).
#include "fake_quantize_cpu.h"

#include "cpu_features.h"
#include "fake_quantize.h"
#include "fake_quantize_args.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace pyg_quant {
namespace {

// Rows summed by one task of the per-column search: a fixed size, so that the order of the float64
// sums (hence a near-tie's winner) does not depend on the number of threads.
constexpr int64_t kRowsPerChunk = 512;

struct GroupStride {  // group of element (r, c) = r * row + c * col
  int64_t row, col;
};

GroupStride group_stride(int64_t dim) {
  if (dim == 0) return {0, 1};
  if (dim == 1) return {1, 0};
  return {0, 0};
}

int first_smallest(const double* errors, int count) {
  int best = 0;
  for (int k = 1; k < count; ++k)
    if (errors[k] < errors[best]) best = k;  // a NaN error never wins; ties keep the wider range
  return best;
}

// The parameters of every group, one array each, and the output's pointers.
struct FakeQuantizeRows {
  const float *x, *lo, *hi, *noise;  // noise null: round to nearest
  const float *scale, *inv;           // affine_params of each group (its lo is the group's lo)
  float* out;
  bool* mask;  // null: no mask
  int64_t cols;
  GroupStride g;
  float levels;
};

// Values c0 <= c < cols of row r (the portable loop, and the AVX2 loop's tail).
inline void fake_quantize_values(const FakeQuantizeRows& a, int64_t r, int64_t c0) {
  const int64_t row = r * a.cols;
  for (int64_t c = c0; c < a.cols; ++c) {
    const int64_t grp = r * a.g.row + c * a.g.col;
    const AffineParams p{a.lo[grp], a.scale[grp], a.inv[grp]};
    a.out[row + c] = fake_quantize_value(a.x[row + c], p, a.noise ? a.noise[row + c] : 0.5f, a.levels);
  }
}

inline void fake_quantize_mask(const FakeQuantizeRows& a, int64_t r) {
  const int64_t row = r * a.cols;
  for (int64_t c = 0; c < a.cols; ++c) {
    const int64_t grp = r * a.g.row + c * a.g.col;
    a.mask[row + c] = a.x[row + c] >= a.lo[grp] && a.x[row + c] <= a.hi[grp];
  }
}

void fake_quantize_rows(const FakeQuantizeRows& a, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    fake_quantize_values(a, r, 0);
    if (a.mask) fake_quantize_mask(a, r);
  }
}

#if defined(PYG_QUANT_X86_DISPATCH)
// fake_quantize_value eight at a time, the same float32 steps in the same order (no FMA), so the same bits: floorf
// is one instruction here, a libm call in the portable loop (which GCC does not vectorize under trapping math).
PYG_QUANT_TARGET_AVX2 void fake_quantize_rows_avx2(const FakeQuantizeRows& a, int64_t begin, int64_t end) {
  const __m256 zero = _mm256_setzero_ps(), levels = _mm256_set1_ps(a.levels), half = _mm256_set1_ps(0.5f);
  const int64_t vec_end = a.cols / 8 * 8;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t row = r * a.cols, grp = r * a.g.row;
    for (int64_t c = 0; c < vec_end; c += 8) {
      __m256 lo, scale, inv;
      if (a.g.col == 0) {
        lo = _mm256_set1_ps(a.lo[grp]);
        scale = _mm256_set1_ps(a.scale[grp]);
        inv = _mm256_set1_ps(a.inv[grp]);
      } else {
        lo = _mm256_loadu_ps(a.lo + grp + c);
        scale = _mm256_loadu_ps(a.scale + grp + c);
        inv = _mm256_loadu_ps(a.inv + grp + c);
      }
      const __m256 u = a.noise ? _mm256_loadu_ps(a.noise + row + c) : half;
      __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(a.x + row + c), lo), inv);
      t = _mm256_floor_ps(_mm256_add_ps(t, u));
      t = _mm256_blendv_ps(t, zero, _mm256_cmp_ps(t, zero, _CMP_LT_OQ));  // NaN fails both tests and stays
      t = _mm256_blendv_ps(t, levels, _mm256_cmp_ps(t, levels, _CMP_GT_OQ));
      _mm256_storeu_ps(a.out + row + c, _mm256_add_ps(_mm256_mul_ps(t, scale), lo));
    }
    fake_quantize_values(a, r, vec_end);
    if (a.mask) fake_quantize_mask(a, r);
  }
}
#endif

}  // namespace

std::tuple<at::Tensor, at::Tensor> fake_quantize_cpu(const at::Tensor& x_in, const std::optional<at::Tensor>& lo_in,
                                                     const std::optional<at::Tensor>& hi_in, int64_t bits, int64_t dim,
                                                     const std::optional<at::Tensor>& noise_in, bool with_mask,
                                                     bool random_noise, std::optional<at::Generator> generator) {
  check_fake_quantize_args(x_in, lo_in, hi_in, bits, dim, noise_in, random_noise);
  const at::Tensor x = x_in.contiguous();
  const auto [lo_t, hi_t] = ranges_or_extrema(x, lo_in, hi_in, dim);
  const at::Tensor noise_t = rounding_noise(x, noise_in, random_noise, std::move(generator));
  at::Tensor out = at::empty_like(x);
  at::Tensor mask = at::empty(with_mask ? x.sizes() : at::IntArrayRef{0}, x.options().dtype(at::kBool));
  const int64_t rows = x.size(0), cols = x.size(1);
  const float levels = static_cast<float>((1 << bits) - 1);
  const float *xp = x.data_ptr<float>(), *lo = lo_t.data_ptr<float>(), *hi = hi_t.data_ptr<float>();
  const float* noise = noise_t.defined() ? noise_t.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  bool* mp = with_mask ? mask.data_ptr<bool>() : nullptr;
  // One scale and reciprocal per group, not per element: the division dominated a small tensor's time.
  const int64_t groups = lo_t.numel();
  std::vector<float> scale(groups), inv(groups);
  for (int64_t grp = 0; grp < groups; ++grp) {
    const AffineParams p = affine_params(lo[grp], hi[grp], levels);
    scale[grp] = p.scale;
    inv[grp] = p.inv;
  }
  const FakeQuantizeRows rows_of{xp, lo, hi, noise, scale.data(), inv.data(), op, mp, cols, group_stride(dim), levels};
#if defined(PYG_QUANT_X86_DISPATCH)
  const bool avx2 = cpu_has_avx2();
#endif
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
#if defined(PYG_QUANT_X86_DISPATCH)
    if (avx2) return fake_quantize_rows_avx2(rows_of, begin, end);
#endif
    fake_quantize_rows(rows_of, begin, end);
  });
  return {out, mask};
}

std::tuple<at::Tensor, at::Tensor> mse_range_cpu(const at::Tensor& x_in, int64_t dim, int64_t bits,
                                                 at::ArrayRef<double> grid) {
  const std::vector<float> shrink = check_mse_args(x_in, bits, dim, grid);
  const int k_count = static_cast<int>(shrink.size());
  // One range for the tensor is one column of all its values.
  const at::Tensor x = dim < 0 ? x_in.contiguous().reshape({-1, 1}) : x_in.contiguous();
  const int64_t group_dim = dim < 0 ? 0 : dim;
  const auto [lo_t, hi_t] = ranges_or_extrema(x, std::nullopt, std::nullopt, group_dim);
  const int64_t rows = x.size(0), cols = x.size(1), groups = lo_t.numel();
  const float levels = static_cast<float>((1 << bits) - 1);
  const float *xp = x.data_ptr<float>(), *lo = lo_t.data_ptr<float>(), *hi = hi_t.data_ptr<float>();

  std::vector<MseCandidate> cand(static_cast<size_t>(groups) * k_count);
  for (int64_t grp = 0; grp < groups; ++grp)
    for (int k = 0; k < k_count; ++k) cand[grp * k_count + k] = mse_candidate(lo[grp], hi[grp], shrink[k], levels);

  std::vector<double> errors(static_cast<size_t>(groups) * k_count, 0.0);
  if (group_dim == 1) {  // per row: a row's sum stays in one task
    at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (cols * k_count)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int k = 0; k < k_count; ++k) {
          double sum = 0.0;
          const AffineParams& p = cand[r * k_count + k].params;
          for (int64_t c = 0; c < cols; ++c) sum += squared_error(xp[r * cols + c], p, levels);
          errors[r * k_count + k] = sum;
        }
    });
  } else {  // per column: fixed row chunks summed into partials, then added in chunk order
    const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
    std::vector<double> partial(static_cast<size_t>(chunks) * cols * k_count, 0.0);
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        double* acc = partial.data() + chunk * cols * k_count;
        for (int64_t r = chunk * kRowsPerChunk; r < std::min(rows, (chunk + 1) * kRowsPerChunk); ++r)
          for (int64_t c = 0; c < cols; ++c)
            for (int k = 0; k < k_count; ++k)
              acc[c * k_count + k] += squared_error(xp[r * cols + c], cand[c * k_count + k].params, levels);
      }
    });
    for (int64_t chunk = 0; chunk < chunks; ++chunk)
      for (int64_t i = 0; i < cols * k_count; ++i) errors[i] += partial[chunk * cols * k_count + i];
  }

  at::Tensor best_lo = at::empty({groups}, x.options()), best_hi = at::empty({groups}, x.options());
  float *blo = best_lo.data_ptr<float>(), *bhi = best_hi.data_ptr<float>();
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int k = first_smallest(errors.data() + grp * k_count, k_count);
    blo[grp] = cand[grp * k_count + k].params.lo;
    bhi[grp] = cand[grp * k_count + k].hi;
  }
  return {best_lo, best_hi};
}

}  // namespace pyg_quant
