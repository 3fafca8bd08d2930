// Fake quantization, the MSE range search and ema_range's step on the GPU (the maths: csrc/fake_quantize.h and
// csrc/ema_range.h, shared with the CPU kernels; -fmad=false keeps every step rounded as there).  Float64 sums are
// reduced in a fixed order (no atomics), so a search gives the same range at every run.
#include "fake_quantize_cuda.h"

#include "fake_quantize.h"
#include "fake_quantize_args.h"
#include "layout.h"  // kMinRangeWidth
#include "philox.cuh"

#include <ATen/ATen.h>  // fake_quantize.h includes only the ATen ops it calls itself
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace pyg_quant {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kRowsPerChunk = 512;  // rows summed by one block of the per-column search
constexpr int kRowLanes = 8;        // threadIdx.y of the per-column search: 32 columns x 8 rows a block

struct Shrink {
  float factor[kMaxMseCandidates];
  int count;
};

// The shrink factor of the first smallest error (a NaN error never wins; ties keep the wider range).  Inlined with
// constant indices only (unrolled), so a register array stays in registers and the struct is read in place.
__device__ __forceinline__ float best_shrink(const double (&err)[kMaxMseCandidates], const Shrink& shrink) {
  double best_err = err[0];
  float best = shrink.factor[0];
#pragma unroll
  for (int k = 1; k < kMaxMseCandidates; ++k)
    if (k < shrink.count && err[k] < best_err) {
      best_err = err[k];
      best = shrink.factor[k];
    }
  return best;
}

int64_t blocks_for(int64_t work, int64_t per_block) {
  return std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, 65535 * 8));
}

// Where a search puts the range it found for group g: as it is, or (stored_lo given: ema_range) moved from the stored
// range, stored + m·(batch − stored) in the observers' float32 steps, with the hi that fake quantization uses
// (hi = lo where the range is narrower than kMinRangeWidth, as torch.where(hi - lo < width, lo, hi) in float32).
struct RangeOut {
  float *lo, *hi;
  const float* stored_lo = nullptr;
  const float* stored_hi = nullptr;
  float momentum = 0.0f;
  float* used_hi = nullptr;
};

__device__ __forceinline__ void store_range(const RangeOut& out, int64_t g, float lo, float hi) {
  if (out.stored_lo != nullptr) {
    const float s_lo = out.stored_lo[g], s_hi = out.stored_hi[g];
    lo = s_lo + (lo - s_lo) * out.momentum;
    hi = s_hi + (hi - s_hi) * out.momentum;
    out.used_hi[g] = hi - lo < static_cast<float>(kMinRangeWidth) ? lo : hi;
  }
  out.lo[g] = lo;
  out.hi[g] = hi;
}

// min / max that return NaN where either operand is NaN (amin / amax's rule; fminf would drop it).
__device__ __forceinline__ float nan_min(float a, float b) { return a != a || b != b ? NAN : fminf(a, b); }
__device__ __forceinline__ float nan_max(float a, float b) { return a != a || b != b ? NAN : fmaxf(a, b); }

// A row's extrema by its warp, NaN-propagating like amin / amax (every lane gets them).
__device__ __forceinline__ void row_extrema(const float* __restrict__ row, int64_t cols, int lane, float& lo,
                                            float& hi) {
  lo = INFINITY;
  hi = -INFINITY;
  for (int64_t c = lane; c < cols; c += 32) {
    lo = nan_min(lo, row[c]);
    hi = nan_max(hi, row[c]);
  }
  for (int s = 16; s > 0; s >>= 1) {
    lo = nan_min(lo, __shfl_xor_sync(kFullMask, lo, s));
    hi = nan_max(hi, __shfl_xor_sync(kFullMask, hi, s));
  }
}

// The rounding noise of one call: none (round to nearest), the caller's U[0, 1) tensor, or drawn here from a Philox
// generator state (random_noise, philox.cuh): element i's value depends on the seed, the generator's offset and i,
// not on the launch shape; a call moves the offset on by 4, and a CUDA graph replay draws afresh (the state is
// graph-safe).  One launch fewer than drawing the tensor with torch.rand first.
struct Noise {
  const float* given = nullptr;
  at::PhiloxCudaState philox;
  bool draw = false;
};

class NoiseSource {
 public:
  __device__ explicit NoiseSource(const Noise& n) : given_(n.given), draw_(n.draw) {
    if (draw_) {
      const auto state = at::cuda::philox::unpack(n.philox);
      seed_ = std::get<0>(state);
      offset_ = std::get<1>(state);
    }
  }
  // u of element i: U[0, 1) on the grid of 2^-24 (a float32 holds it exactly), or 1/2.
  __device__ __forceinline__ float at(int64_t i) const {
    if (given_ != nullptr) return given_[i];
    if (!draw_) return 0.5f;
    return philox_uniform(seed_, offset_, static_cast<uint64_t>(i));
  }

 private:
  const float* given_;
  bool draw_;
  uint64_t seed_ = 0, offset_ = 0;
};

__global__ void fake_quantize_kernel(const float* __restrict__ x, const float* __restrict__ lo,
                                     const float* __restrict__ hi, Noise noise, int64_t n, int64_t cols,
                                     int64_t row_stride, int64_t col_stride, float levels, float* __restrict__ out,
                                     bool* __restrict__ mask) {
  const NoiseSource u(noise);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols, group = r * row_stride + c * col_stride;
    const float v = x[i], l = lo[group], h = hi[group];
    out[i] = fake_quantize_value(v, affine_params(l, h, levels), u.at(i), levels);
    if (mask) mask[i] = v >= l && v <= h;
  }
}

// Each row over its own range (dim 1, no lo / hi given: a QAT linear layer's input, a range a node, and its weight, a
// range an output channel), a warp a row: the row's extrema, then its values, in one launch instead of three.
__global__ void fake_quantize_own_rows_kernel(const float* __restrict__ x, Noise noise, int64_t rows, int64_t cols,
                                              float levels, float* __restrict__ out, bool* __restrict__ mask) {
  const NoiseSource u(noise);
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    const float* row = x + r * cols;
    float l, h;
    row_extrema(row, cols, lane, l, h);
    const AffineParams p = affine_params(l, h, levels);
    for (int64_t c = lane; c < cols; c += 32) {
      const int64_t i = r * cols + c;
      const float v = row[c];
      out[i] = fake_quantize_value(v, p, u.at(i), levels);
      if (mask) mask[i] = v >= l && v <= h;
    }
  }
}

// Per row: a warp a row.  Extrema, then every candidate's error, butterfly-reduced (the same order at every run),
// then the first smallest.
__global__ void mse_rows_kernel(const float* __restrict__ x, int64_t rows, int64_t cols, Shrink shrink, float levels,
                                RangeOut best) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    const float* row = x + r * cols;
    float lo, hi;
    row_extrema(row, cols, lane, lo, hi);
    double err[kMaxMseCandidates];
#pragma unroll
    for (int k = 0; k < kMaxMseCandidates; ++k) {
      err[k] = 0.0;
      if (k >= shrink.count) continue;
      const AffineParams p = mse_candidate(lo, hi, shrink.factor[k], levels).params;
      for (int64_t c = lane; c < cols; c += 32) err[k] += squared_error(row[c], p, levels);
    }
#pragma unroll
    for (int k = 0; k < kMaxMseCandidates; ++k)
      for (int s = 16; s > 0; s >>= 1) err[k] += __shfl_xor_sync(kFullMask, err[k], s);
    if (lane == 0) {
      const MseCandidate chosen = mse_candidate(lo, hi, best_shrink(err, shrink), levels);
      store_range(best, r, chosen.params.lo, chosen.hi);
    }
  }
}

// Per column, pass 1: block (column tile, row chunk) sums each candidate's error of 32 columns over
// kRowsPerChunk rows into partial[chunk][k][col].  A per-tensor search runs as `cols` columns of one group
// (group_of_col = 0), so its 32 lanes stay busy.
__global__ void mse_cols_partial_kernel(const float* __restrict__ x, int64_t rows, int64_t cols,
                                        const float* __restrict__ lo, const float* __restrict__ hi, bool one_group,
                                        Shrink shrink, float levels, double* __restrict__ partial) {
  __shared__ double stage[kRowLanes][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + tx, chunk = blockIdx.y;
  const int64_t group = one_group ? 0 : c;
  const bool live = c < cols;
  const float l = live ? lo[group] : 0.0f, h = live ? hi[group] : 0.0f;
  const int64_t r_end = min(rows, (chunk + 1) * kRowsPerChunk);
  for (int k = 0; k < shrink.count; ++k) {
    const AffineParams p = mse_candidate(l, h, shrink.factor[k], levels).params;
    double sum = 0.0;
    if (live)
      for (int64_t r = chunk * kRowsPerChunk + ty; r < r_end; r += kRowLanes) sum += squared_error(x[r * cols + c], p, levels);
    stage[ty][tx] = sum;
    __syncthreads();
    if (ty == 0 && live) {
      double total = 0.0;
      for (int j = 0; j < kRowLanes; ++j) total += stage[j][tx];
      partial[(chunk * shrink.count + k) * cols + c] = total;
    }
    __syncthreads();
  }
}

// Per column, pass 2: a block a group.  Warp k adds candidate k's partials (lanes over the chunks, and the columns
// of a per-tensor search, in a fixed order; then a butterfly), and thread 0 keeps the first smallest error's range.
__global__ void mse_cols_select_kernel(const double* __restrict__ partial, int64_t chunks, int64_t cols,
                                       const float* __restrict__ lo, const float* __restrict__ hi, bool one_group,
                                       Shrink shrink, float levels, RangeOut best) {
  __shared__ double totals[kMaxMseCandidates];
  const int64_t group = blockIdx.x;
  const int lane = threadIdx.x & 31, k = threadIdx.x >> 5;
  const int64_t c_begin = one_group ? 0 : group, width = one_group ? cols : 1;
  if (k < shrink.count) {
    double sum = 0.0;
    for (int64_t i = lane; i < chunks * width; i += 32) {
      const int64_t chunk = i / width, c = c_begin + i % width;
      sum += partial[(chunk * shrink.count + k) * cols + c];
    }
    for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(kFullMask, sum, s);
    if (lane == 0) totals[k] = sum;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const MseCandidate chosen = mse_candidate(lo[group], hi[group], best_shrink(totals, shrink), levels);
  store_range(best, group, chosen.params.lo, chosen.hi);
}

// ema_range's min/max per row: a warp a row.
__global__ void extrema_rows_kernel(const float* __restrict__ x, int64_t rows, int64_t cols, RangeOut out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    float lo, hi;
    row_extrema(x + r * cols, cols, lane, lo, hi);
    if (lane == 0) store_range(out, r, lo, hi);
  }
}

// Per column (or per tensor), pass 1: block (column tile, row chunk) takes the min/max of 32 columns over
// kRowsPerChunk rows into part_lo / part_hi[chunk][col].
__global__ void extrema_cols_partial_kernel(const float* __restrict__ x, int64_t rows, int64_t cols,
                                            float* __restrict__ part_lo, float* __restrict__ part_hi) {
  __shared__ float stage_lo[kRowLanes][32], stage_hi[kRowLanes][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + tx, chunk = blockIdx.y;
  const int64_t r_end = min(rows, (chunk + 1) * kRowsPerChunk);
  float lo = INFINITY, hi = -INFINITY;
  if (c < cols)
    for (int64_t r = chunk * kRowsPerChunk + ty; r < r_end; r += kRowLanes) {
      const float v = x[r * cols + c];
      lo = nan_min(lo, v);
      hi = nan_max(hi, v);
    }
  stage_lo[ty][tx] = lo;
  stage_hi[ty][tx] = hi;
  __syncthreads();
  if (ty != 0 || c >= cols) return;
  for (int j = 1; j < kRowLanes; ++j) {
    lo = nan_min(lo, stage_lo[j][tx]);
    hi = nan_max(hi, stage_hi[j][tx]);
  }
  part_lo[chunk * cols + c] = lo;
  part_hi[chunk * cols + c] = hi;
}

// Pass 2: a warp a group reduces the partials (every column's for a per-tensor range) and stores the range.
__global__ void extrema_cols_finish_kernel(const float* __restrict__ part_lo, const float* __restrict__ part_hi,
                                           int64_t chunks, int64_t cols, bool one_group, RangeOut out) {
  const int64_t group = blockIdx.x;
  const int lane = threadIdx.x;
  const int64_t c_begin = one_group ? 0 : group, width = one_group ? cols : 1;
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = lane; i < chunks * width; i += 32) {
    const int64_t at = (i / width) * cols + c_begin + i % width;
    lo = nan_min(lo, part_lo[at]);
    hi = nan_max(hi, part_hi[at]);
  }
  for (int s = 16; s > 0; s >>= 1) {
    lo = nan_min(lo, __shfl_xor_sync(kFullMask, lo, s));
    hi = nan_max(hi, __shfl_xor_sync(kFullMask, hi, s));
  }
  if (lane == 0) store_range(out, group, lo, hi);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fake_quantize_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& lo_in,
                                                      const std::optional<at::Tensor>& hi_in, int64_t bits, int64_t dim,
                                                      const std::optional<at::Tensor>& noise_in, bool with_mask,
                                                      bool random_noise, std::optional<at::Generator> generator) {
  check_fake_quantize_args(x_in, lo_in, hi_in, bits, dim, noise_in, random_noise);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor given = noise_in ? noise_in->contiguous() : at::Tensor();
  Noise noise;
  noise.given = given.defined() ? given.data_ptr<float>() : nullptr;
  if (random_noise) {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        generator, at::cuda::detail::getDefaultCUDAGenerator(x.device().index()));
    const std::lock_guard<std::mutex> lock(gen->mutex_);
    noise.philox = gen->philox_cuda_state(4);
    noise.draw = true;
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor mask = at::empty(with_mask ? x.sizes() : at::IntArrayRef{0}, x.options().dtype(at::kBool));
  const int64_t n = x.numel(), cols = x.size(1);
  constexpr int threads = 256;
  if (dim == 1 && !lo_in.has_value()) {
    const int64_t rows = x.size(0);
    fake_quantize_own_rows_kernel<<<blocks_for(rows * 32, threads), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), noise, rows, cols, static_cast<float>((1 << bits) - 1), out.data_ptr<float>(),
        with_mask ? mask.data_ptr<bool>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, mask};
  }
  const auto [lo, hi] = ranges_or_extrema(x, lo_in, hi_in, dim);
  const int64_t row_stride = dim == 1 ? 1 : 0, col_stride = dim == 0 ? 1 : 0;
  fake_quantize_kernel<<<blocks_for(n, threads), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), lo.data_ptr<float>(), hi.data_ptr<float>(), noise, n, cols, row_stride, col_stride,
      static_cast<float>((1 << bits) - 1), out.data_ptr<float>(), with_mask ? mask.data_ptr<bool>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, mask};
}

namespace {

// x's range per group of dim (x 2-D float32, contiguous), written through `out`: its min/max (no factors), or the
// MSE search over the shrink factors.  Per row: one launch; per column or per tensor: two for the min/max, then two
// for the search.
void launch_range_search(const at::Tensor& x, int64_t dim, const std::vector<float>& factors, float levels,
                         const RangeOut& out) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = x.size(0), cols = x.size(1);
  Shrink shrink{};
  shrink.count = static_cast<int>(factors.size());
  for (int k = 0; k < shrink.count; ++k) shrink.factor[k] = factors[k];
  if (dim == 1) {
    constexpr int threads = 256;
    if (factors.empty())
      extrema_rows_kernel<<<blocks_for(rows * 32, threads), threads, 0, stream>>>(x.data_ptr<float>(), rows, cols, out);
    else
      mse_rows_kernel<<<blocks_for(rows * 32, threads), threads, 0, stream>>>(x.data_ptr<float>(), rows, cols, shrink,
                                                                              levels, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const bool one_group = dim < 0;
  const int64_t groups = one_group ? 1 : cols;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  TORCH_CHECK_VALUE(chunks <= 65535, "x has too many rows for the range search (", rows, ")");
  const dim3 block(32, kRowLanes), tiles(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(chunks));
  const at::Tensor part = at::empty({2, chunks, cols}, x.options());  // each chunk's min, then its max
  float* part_lo = part.data_ptr<float>();
  float* part_hi = part_lo + chunks * cols;
  extrema_cols_partial_kernel<<<tiles, block, 0, stream>>>(x.data_ptr<float>(), rows, cols, part_lo, part_hi);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (factors.empty()) {
    extrema_cols_finish_kernel<<<static_cast<unsigned>(groups), 32, 0, stream>>>(part_lo, part_hi, chunks, cols,
                                                                                 one_group, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const at::Tensor extrema = at::empty({2, groups}, x.options());
  float* lo = extrema.data_ptr<float>();
  float* hi = lo + groups;
  extrema_cols_finish_kernel<<<static_cast<unsigned>(groups), 32, 0, stream>>>(part_lo, part_hi, chunks, cols,
                                                                               one_group, RangeOut{lo, hi});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor partial = at::empty({chunks, shrink.count, cols}, x.options().dtype(at::kDouble));
  mse_cols_partial_kernel<<<tiles, block, 0, stream>>>(x.data_ptr<float>(), rows, cols, lo, hi, one_group, shrink,
                                                      levels, partial.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  mse_cols_select_kernel<<<static_cast<unsigned>(groups), 32 * shrink.count, 0, stream>>>(
      partial.data_ptr<double>(), chunks, cols, lo, hi, one_group, shrink, levels, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mse_range_cuda(const at::Tensor& x_in, int64_t dim, int64_t bits,
                                                  at::ArrayRef<double> grid) {
  const std::vector<float> factors = check_mse_args(x_in, bits, dim, grid);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t groups = num_groups(x, dim);
  at::Tensor best_lo = at::empty({groups}, x.options()), best_hi = at::empty({groups}, x.options());
  launch_range_search(x, dim, factors, static_cast<float>((1 << bits) - 1),
                      RangeOut{best_lo.data_ptr<float>(), best_hi.data_ptr<float>()});
  return {best_lo, best_hi};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ema_range_cuda(const at::Tensor& x_in, const at::Tensor& stored_lo_in,
                                                              const at::Tensor& stored_hi_in, double momentum,
                                                              int64_t dim, at::ArrayRef<double> grid,
                                                              int64_t grid_bits) {
  check_ema_range_args(x_in, stored_lo_in, stored_hi_in, dim);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const std::vector<float> factors = grid.empty() ? std::vector<float>{} : check_mse_args(x, grid_bits, dim, grid);
  const at::Tensor stored_lo = stored_lo_in.contiguous(), stored_hi = stored_hi_in.contiguous();
  const int64_t groups = num_groups(x, dim);
  at::Tensor lo = at::empty({groups}, x.options()), hi = at::empty({groups}, x.options()),
             used_hi = at::empty({groups}, x.options());
  RangeOut out{lo.data_ptr<float>(), hi.data_ptr<float>()};
  out.stored_lo = stored_lo.data_ptr<float>();
  out.stored_hi = stored_hi.data_ptr<float>();
  out.momentum = static_cast<float>(momentum);  // the foreach step's float32 scalar
  out.used_hi = used_hi.data_ptr<float>();
  launch_range_search(x, dim, factors, grid.empty() ? 0.0f : static_cast<float>((1 << grid_bits) - 1), out);
  return {lo, hi, used_hi};
}

}  // namespace pyg_quant
