// Quantize + pack, unpack and code sums on the GPU, in the layout of
// pyg_quant/layout.py.  Codes follow the float32 recipe written there with
// explicitly rounded intrinsics (no FMA contraction), so they equal the CPU's.
// Bits are gathered into words with warp ballots: lane k holds element 32w+k.
#include "quantize_cuda.h"

#include "quantize_ranges.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

namespace pyg_quant {
namespace {

constexpr int64_t kOuterAlign = 64;
constexpr int64_t kPackAlignWords = 8;
constexpr unsigned kFullMask = 0xffffffffu;

int64_t round_up(int64_t n, int64_t m) { return (std::max<int64_t>(n, 1) + m - 1) / m * m; }
int64_t packed_words(int64_t n) { return round_up(n, kPackAlignWords * 32) / 32; }
int64_t broadcast_stride(const at::Tensor& t, int64_t dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }
int64_t blocks_for(int64_t work, int64_t per_block) { return std::min<int64_t>((work + per_block - 1) / per_block, 65535 * 16); }

struct CodeArgs {
  const float* x;
  const float* lo;
  const float* inv;
  const float* noise;
  int64_t rows, cols, lo_rs, lo_cs, inv_rs, inv_cs;
  float max_code;
};

// Zero outside the logical shape, so padded words come out zero.
__device__ __forceinline__ uint32_t code_at(const CodeArgs& a, int64_t r, int64_t c) {
  if (r >= a.rows || c >= a.cols) return 0;
  const float v = __fmul_rn(__fsub_rn(a.x[r * a.cols + c], a.lo[r * a.lo_rs + c * a.lo_cs]), a.inv[r * a.inv_rs + c * a.inv_cs]);
  const float u = a.noise ? a.noise[r * a.cols + c] : 0.5f;
  const float t = floorf(__fadd_rn(v, u));
  return static_cast<uint32_t>(fminf(fmaxf(t, 0.0f), a.max_code));
}

// Row layout: one warp per (row, word); lane k quantizes column 32w+k (a
// coalesced 128-byte read) and lane p stores plane p's ballot.
__global__ void quantize_pack_rows_kernel(CodeArgs args, uint32_t* out, int64_t outer_pad, int64_t words, int bits,
                                          int64_t plane_stride) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; item < outer_pad * words;
       item += warps) {
    const int64_t r = item / words, w = item % words;
    const uint32_t q = code_at(args, r, w * 32 + lane);
    uint32_t mine = 0;
    for (int p = 0; p < bits; ++p) {
      const uint32_t ballot = __ballot_sync(kFullMask, (q >> p) & 1u);
      if (lane == p) mine = ballot;
    }
    if (lane < bits) out[lane * plane_stride + r * words + w] = mine;
  }
}

// Column layout: a block transposes a 32-row x 32-column tile through shared
// memory (coalesced reads along rows), then warp j ballots column j's 32 codes.
__global__ void quantize_pack_cols_kernel(CodeArgs args, uint32_t* out, int64_t words, int bits, int64_t plane_stride) {
  __shared__ uint8_t tile[32][33];
  const int64_t w = blockIdx.x;              // rows 32w..32w+31
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * 32;
  const int tx = threadIdx.x, ty = threadIdx.y;  // 32 x 8
  for (int i = ty; i < 32; i += 8) tile[i][tx] = static_cast<uint8_t>(code_at(args, w * 32 + i, c0 + tx));
  __syncthreads();
  for (int j = ty; j < 32; j += 8) {
    const uint32_t q = tile[tx][j];
    uint32_t mine = 0;
    for (int p = 0; p < bits; ++p) {
      const uint32_t ballot = __ballot_sync(kFullMask, (q >> p) & 1u);
      if (tx == p) mine = ballot;
    }
    if (tx < bits) out[tx * plane_stride + (c0 + j) * words + w] = mine;
  }
}

__global__ void unpack_rows_kernel(const uint32_t* planes, uint8_t* codes, int64_t rows, int64_t cols, int64_t words,
                                   int bits, int64_t plane_stride) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols; i += stride) {
    const int64_t r = i / cols, c = i % cols;
    const uint32_t* word = planes + r * words + (c >> 5);
    uint32_t q = 0;
    for (int p = 0; p < bits; ++p) q |= ((word[p * plane_stride] >> (c & 31)) & 1u) << p;
    codes[i] = static_cast<uint8_t>(q);
  }
}

// Column layout: word (c, w) holds rows 32w..32w+31 of column c; a block
// decodes 32 rows x 32 columns and writes the codes row-major (coalesced).
__global__ void unpack_cols_kernel(const uint32_t* planes, uint8_t* codes, int64_t rows, int64_t cols, int64_t words,
                                   int bits, int64_t plane_stride) {
  __shared__ uint8_t tile[32][33];
  const int64_t w = blockIdx.x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * 32;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int j = ty; j < 32; j += 8) {
    uint32_t q = 0;
    if (c0 + j < cols) {
      const uint32_t* word = planes + (c0 + j) * words + w;
      for (int p = 0; p < bits; ++p) q |= ((word[p * plane_stride] >> tx) & 1u) << p;
    }
    tile[tx][j] = static_cast<uint8_t>(q);
  }
  __syncthreads();
  for (int i = ty; i < 32; i += 8) {
    const int64_t r = w * 32 + i, c = c0 + tx;
    if (r < rows && c < cols) codes[r * cols + c] = tile[i][tx];
  }
}

__global__ void code_sums_kernel(const uint32_t* planes, int64_t* sums, int64_t outer, int64_t words, int bits) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t o = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; o < outer; o += warps) {
    int64_t total = 0;
    for (int p = 0; p < bits; ++p) {
      const uint32_t* row = planes + (p * outer + o) * words;
      int count = 0;
      for (int64_t w = lane; w < words; w += 32) count += __popc(row[w]);
      for (int off = 16; off > 0; off >>= 1) count += __shfl_xor_sync(kFullMask, count, off);
      total += static_cast<int64_t>(count) << p;
    }
    if (lane == 0) sums[o] = total;
  }
}

// Per-row ranges, quantize and pack (row layout): a warp owns a row.  It takes the row's min and max (coalesced
// reads, shuffle reductions) and computes the range with the float32 steps of to_bit; then lane w builds word w of
// every plane in registers from the 32 codes of columns 32w..32w+31 (no ballots; Bits is a template parameter so
// the plane words stay in registers) and the lanes store consecutive words of each plane.  Code sums come from the
// same codes.  Rows past the logical shape are written as zeros, so every word is written once.
template <int Bits>
__global__ void quantize_pack_row_ranges_kernel(const float* __restrict__ x, const float* __restrict__ noise,
                                                int64_t rows, int64_t cols, int64_t outer_pad, int64_t words,
                                                uint32_t* __restrict__ out, int64_t plane_stride,
                                                float* __restrict__ lo_out, float* __restrict__ scale_out,
                                                int64_t* __restrict__ sums_out) {
  constexpr float kMaxCode = static_cast<float>((1 << Bits) - 1);
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < outer_pad; r += warps) {
    if (r >= rows) {
      for (int64_t w = lane; w < words; w += 32) {
#pragma unroll
        for (int p = 0; p < Bits; ++p) out[p * plane_stride + r * words + w] = 0;
      }
      if (lane == 0) sums_out[r] = 0;
      continue;
    }
    const float* row = x + r * cols;
    float mn = INFINITY, mx = -INFINITY;
    bool has_nan = false;
    for (int64_t c = lane; c < cols; c += 32) {
      const float v = row[c];
      has_nan |= v != v;
      mn = fminf(mn, v);
      mx = fmaxf(mx, v);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      mn = fminf(mn, __shfl_xor_sync(kFullMask, mn, offset));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, offset));
    }
    if (__any_sync(kFullMask, has_nan)) mn = mx = NAN;  // amin/amax propagate NaN
    const float scale = __fdiv_rn(__fsub_rn(mx, mn), kMaxCode);
    const float inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
    if (lane == 0) {
      lo_out[r] = mn;
      scale_out[r] = scale;
    }
    const float* row_noise = noise ? noise + r * cols : nullptr;
    int64_t sum = 0;
    for (int64_t w = lane; w < words; w += 32) {
      uint32_t plane[Bits];
#pragma unroll
      for (int p = 0; p < Bits; ++p) plane[p] = 0;
      const int64_t c0 = w * 32;
      if (c0 < cols) {
        const int valid = static_cast<int>(min(cols - c0, int64_t{32}));
#pragma unroll
        for (int k = 0; k < 32; ++k) {
          if (k < valid) {
            const float v = __fmul_rn(__fsub_rn(row[c0 + k], mn), inv);
            const float t = floorf(__fadd_rn(v, row_noise ? row_noise[c0 + k] : 0.5f));
            const uint32_t q = static_cast<uint32_t>(fminf(fmaxf(t, 0.0f), kMaxCode));
            sum += q;
#pragma unroll
            for (int p = 0; p < Bits; ++p) plane[p] |= ((q >> p) & 1u) << k;
          }
        }
      }
#pragma unroll
      for (int p = 0; p < Bits; ++p) out[p * plane_stride + r * words + w] = plane[p];
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullMask, sum, offset);
    if (lane == 0) sums_out[r] = sum;
  }
}

}  // namespace

at::Tensor quantize_pack_cuda(const at::Tensor& x_in, const at::Tensor& lo_in, const at::Tensor& inv_in, int64_t bits,
                              bool col_layout, const std::optional<at::Tensor>& noise_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 8, "bits must be in 1..8, got ", bits);
  TORCH_CHECK_VALUE(lo_in.dim() == 2 && inv_in.dim() == 2, "lo and inv_scale must be 2-D (broadcastable to x)");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto lo = lo_in.to(at::kFloat);
  const auto inv = inv_in.to(at::kFloat);
  const int64_t rows = x.size(0), cols = x.size(1);
  for (const auto* t : {&lo, &inv}) {
    TORCH_CHECK_VALUE(t->device() == x.device(), "lo and inv_scale must be on x's device");
    TORCH_CHECK_VALUE((t->size(0) == 1 || t->size(0) == rows) && (t->size(1) == 1 || t->size(1) == cols),
                      "lo and inv_scale must broadcast to x's shape");
  }
  at::Tensor noise;
  if (noise_in.has_value()) {
    noise = noise_in->contiguous();
    TORCH_CHECK_VALUE(noise.sizes() == x.sizes() && noise.scalar_type() == at::kFloat && noise.device() == x.device(),
                      "noise must be float32 with x's shape and device");
  }
  const CodeArgs args{x.data_ptr<float>(), lo.data_ptr<float>(), inv.data_ptr<float>(),
                      noise.defined() ? noise.data_ptr<float>() : nullptr, rows, cols,
                      broadcast_stride(lo, 0), broadcast_stride(lo, 1), broadcast_stride(inv, 0), broadcast_stride(inv, 1),
                      static_cast<float>((1 << bits) - 1)};
  const int64_t outer = col_layout ? cols : rows, packed = col_layout ? rows : cols;
  const int64_t outer_pad = round_up(outer, kOuterAlign), words = packed_words(packed);
  // Every word, padding included, is written by the kernels: no memset.
  auto planes = at::empty({bits, outer_pad, words}, x.options().dtype(at::kInt));
  uint32_t* out = reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (!col_layout) {
    quantize_pack_rows_kernel<<<blocks_for(outer_pad * words * 32, 256), 256, 0, stream>>>(args, out, outer_pad, words,
                                                                                          bits, outer_pad * words);
  } else {
    const dim3 grid(words, outer_pad / 32);
    quantize_pack_cols_kernel<<<grid, dim3(32, 8), 0, stream>>>(args, out, words, bits, outer_pad * words);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return planes;
}

at::Tensor unpack_codes_cuda(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout) {
  TORCH_CHECK_VALUE(planes_in.dim() == 3 && planes_in.scalar_type() == at::kInt, "planes must be int32[bits, outer, words]");
  const auto planes = planes_in.contiguous();
  const int64_t bits = planes.size(0), outer = planes.size(1), words = planes.size(2);
  TORCH_CHECK_VALUE(outer >= (col_layout ? cols : rows) && words * 32 >= (col_layout ? rows : cols),
                    "rows/cols exceed the planes' padded shape");
  const c10::cuda::CUDAGuard guard(planes.device());
  auto codes = at::empty({rows, cols}, planes.options().dtype(at::kByte));
  if (rows * cols == 0) return codes;
  const uint32_t* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (!col_layout) {
    unpack_rows_kernel<<<blocks_for(rows * cols, 256), 256, 0, stream>>>(in, codes.data_ptr<uint8_t>(), rows, cols, words,
                                                                         bits, outer * words);
  } else {
    const dim3 grid((rows + 31) / 32, (cols + 31) / 32);
    unpack_cols_kernel<<<grid, dim3(32, 8), 0, stream>>>(in, codes.data_ptr<uint8_t>(), rows, cols, words, bits,
                                                         outer * words);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return codes;
}

at::Tensor packed_code_sums_cuda(const at::Tensor& planes_in) {
  TORCH_CHECK_VALUE(planes_in.dim() == 3 && planes_in.scalar_type() == at::kInt, "planes must be int32[bits, outer, words]");
  const auto planes = planes_in.contiguous();
  const int64_t bits = planes.size(0), outer = planes.size(1), words = planes.size(2);
  const c10::cuda::CUDAGuard guard(planes.device());
  auto sums = at::empty({outer}, planes.options().dtype(at::kLong));
  if (outer == 0) return sums;
  code_sums_kernel<<<blocks_for(outer * 32, 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>()), sums.data_ptr<int64_t>(), outer, words, bits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return sums;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_pack_ranges_cuda(
    const at::Tensor& x_in, int64_t bits, int64_t dim, bool col_layout, const std::optional<at::Tensor>& noise_in) {
  if (dim != 1 || col_layout) {
    return quantize_pack_ranges_composed(x_in, bits, dim, col_layout, noise_in, quantize_pack_cuda,
                                         packed_code_sums_cuda);
  }
  check_quantize_ranges_args(x_in, bits, dim, noise_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto noise = noise_in ? noise_in->contiguous() : at::Tensor();
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t outer_pad = round_up(rows, kOuterAlign), words = packed_words(cols);
  auto planes = at::empty({bits, outer_pad, words}, x.options().dtype(at::kInt));
  auto lo = at::empty({rows}, x.options()), scale = at::empty({rows}, x.options());
  auto sums = at::empty({outer_pad}, x.options().dtype(at::kLong));
  const auto launch = [&](auto kernel) {
    kernel<<<blocks_for(outer_pad * 32, 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), noise.defined() ? noise.data_ptr<float>() : nullptr, rows, cols, outer_pad, words,
        reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>()), outer_pad * words, lo.data_ptr<float>(),
        scale.data_ptr<float>(), sums.data_ptr<int64_t>());
  };
  switch (bits) {
    case 1: launch(quantize_pack_row_ranges_kernel<1>); break;
    case 2: launch(quantize_pack_row_ranges_kernel<2>); break;
    case 3: launch(quantize_pack_row_ranges_kernel<3>); break;
    case 4: launch(quantize_pack_row_ranges_kernel<4>); break;
    case 5: launch(quantize_pack_row_ranges_kernel<5>); break;
    case 6: launch(quantize_pack_row_ranges_kernel<6>); break;
    case 7: launch(quantize_pack_row_ranges_kernel<7>); break;
    default: launch(quantize_pack_row_ranges_kernel<8>); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {planes, lo, scale, sums};
}

}  // namespace pyg_quant
