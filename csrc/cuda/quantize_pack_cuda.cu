// Quantize + pack, unpack (unpack_codes, dequantize) and code sums of bit planes on the GPU, in the layout of
// pyg_quant/layout.py.  Codes follow the float32 recipe written there (csrc/quantize_steps.h, shared with the CPU:
// explicitly rounded intrinsics, no FMA contraction), so they equal the CPU's.
// Bits are gathered into words with warp ballots: lane k holds element 32w+k.
#include "quantize_cuda.h"

#include "layout.h"
#include "quantize_args.h"
#include "quantize_steps.h"
#include "quantize_common.cuh"
#include "scratch_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

int64_t broadcast_stride(const at::Tensor& t, int64_t dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

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
  return code_of(a.x[r * a.cols + c], a.lo[r * a.lo_rs + c * a.lo_cs], a.inv[r * a.inv_rs + c * a.inv_cs],
                 a.noise ? a.noise[r * a.cols + c] : 0.5f, a.max_code);
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

// What the unpack kernels write for code q at (r, c): the code (unpack_codes), or its value (dequantize).
struct CodeStore {
  uint8_t* out;
  int64_t ld;
  __device__ __forceinline__ void operator()(int64_t r, int64_t c, uint32_t q) const {
    out[r * ld + c] = static_cast<uint8_t>(q);
  }
};

struct ValueStore {
  float* out;
  int64_t ld;
  const float* __restrict__ lo;
  const float* __restrict__ scale;
  int dim;  // -1 per tensor, 0 per column, 1 per row
  __device__ __forceinline__ void operator()(int64_t r, int64_t c, uint32_t q) const {
    const int64_t g = dim < 0 ? 0 : (dim == 0 ? c : r);
    out[r * ld + c] = value_of(q, __ldg(lo + g), __ldg(scale + g));
  }
};

// Row layout: word (r, w) holds columns 32w..32w+31 of row r.  A group of `lanes` lanes (the power of two that
// covers cols, at most 32) owns a row at a time, lane l of it columns l, l + lanes, ...: a plane word is read by
// all of a group at once, and every store covers consecutive outputs: no 64-bit division per element, and no
// half-idle warp on narrow rows (see benchmarks/RESULTS.md, Layers and kernels, dequantize).
template <typename Store>
__global__ void unpack_rows_kernel(const uint32_t* __restrict__ planes, Store store, int64_t rows, int64_t cols,
                                   int64_t words, int bits, int64_t plane_stride, int lanes) {
  const int lane = threadIdx.x % lanes;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * (blockDim.x / lanes);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / lanes) + threadIdx.x / lanes; r < rows;
       r += groups) {
    const uint32_t* row = planes + r * words;
    for (int64_t c = lane; c < cols; c += lanes) {
      const uint32_t* word = row + (c >> 5);
      uint32_t q = 0;
#pragma unroll
      for (int p = 0; p < 8; ++p) {
        if (p < bits) q |= ((__ldg(word + p * plane_stride) >> (c & 31)) & 1u) << p;
      }
      store(r, c, q);
    }
  }
}

// Column layout: word (c, w) holds rows 32w..32w+31 of column c.  A block owns 32 columns and kUnpackWords words
// (256 rows).  It first copies the bits x 32 x kUnpackWords plane words into shared memory, kUnpackWords consecutive
// threads reading one column's words (a whole 32-byte sector: the planes are read once, every byte used); then warp
// ty writes rows ty, ty + 8, ... with lane = column, so every store is a row's 32 consecutive outputs.  Columns
// cols..ld-1 of the output get code 0.  Reading one word per column instead (a 32-byte sector for 4 bytes used)
// made the kernel several times slower than its stores.
constexpr int kUnpackWords = 8, kUnpackCols = 32, kUnpackThreads = 256;

template <typename Store>
__global__ void __launch_bounds__(kUnpackThreads) unpack_cols_kernel(const uint32_t* __restrict__ planes, Store store,
                                                                     int64_t rows, int64_t cols, int64_t ld,
                                                                     int64_t words, int bits, int64_t plane_stride) {
  __shared__ uint32_t tile[8][kUnpackCols][kUnpackWords + 1];  // [plane (at most 8)][column][word]; + 1: the lanes
                                                                // (columns) read distinct banks
  const int t = threadIdx.x;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kUnpackWords;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kUnpackCols;
  stage_plane_words<kUnpackCols, kUnpackWords, kUnpackThreads>(planes, tile, bits, c0, w0, cols, words, plane_stride);
  __syncthreads();
  const int lane = t % 32, warp = t / 32;
  const int64_t c = c0 + lane;
  if (c >= ld) return;  // no block-wide barrier below
  for (int i = warp; i < kUnpackWords * 32; i += kUnpackThreads / 32) {
    const int64_t r = w0 * 32 + i;
    if (r >= rows) break;
    const int k = i / 32, shift = i % 32;
    uint32_t q = 0;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      if (p < bits) q |= ((tile[p][lane][k] >> shift) & 1u) << p;
    }
    store(r, c, q);
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

}  // namespace

at::Tensor quantize_pack_cuda(const at::Tensor& x_in, const at::Tensor& lo_in, const at::Tensor& inv_in, int64_t bits,
                              bool col_layout, const std::optional<at::Tensor>& noise_in) {
  check_quantize_pack_args(x_in, lo_in, inv_in, bits, noise_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto lo = lo_in.to(at::kFloat);
  const auto inv = inv_in.to(at::kFloat);
  const int64_t rows = x.size(0), cols = x.size(1);
  const at::Tensor noise = noise_in.has_value() ? noise_in->contiguous() : at::Tensor();
  const CodeArgs args{x.data_ptr<float>(), lo.data_ptr<float>(), inv.data_ptr<float>(),
                      noise.defined() ? noise.data_ptr<float>() : nullptr, rows, cols,
                      broadcast_stride(lo, 0), broadcast_stride(lo, 1), broadcast_stride(inv, 0), broadcast_stride(inv, 1),
                      static_cast<float>((1 << bits) - 1)};
  const int64_t outer = col_layout ? cols : rows, packed = col_layout ? rows : cols;
  const int64_t outer_pad = padded_outer(outer), words = packed_words(packed);
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

// The unpack kernel of the planes' layout, writing through `store` (planes contiguous, shape checked).
template <typename Store>
void launch_unpack(const at::Tensor& planes, int64_t rows, int64_t cols, bool col_layout, Store store) {
  if (rows * cols == 0) return;
  const int64_t bits = planes.size(0), outer = planes.size(1), words = planes.size(2);
  const uint32_t* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (!col_layout) {
    int lanes = 1;
    while (lanes < 32 && lanes < cols) lanes *= 2;
    unpack_rows_kernel<<<blocks_for(rows * lanes, 256), 256, 0, stream>>>(in, store, rows, cols, words,
                                                                            static_cast<int>(bits), outer * words,
                                                                            lanes);
  } else {
    const dim3 grid(static_cast<unsigned>((rows + 32 * kUnpackWords - 1) / (32 * kUnpackWords)),
                    static_cast<unsigned>((cols + kUnpackCols - 1) / kUnpackCols));
    TORCH_CHECK_VALUE(grid.y <= 65535, "too many columns for one launch");
    unpack_cols_kernel<<<grid, kUnpackThreads, 0, stream>>>(in, store, rows, cols, cols, words, static_cast<int>(bits),
                                                            outer * words);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor unpack_codes_cuda(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout) {
  check_unpack_shape(planes_in, rows, cols, col_layout);
  const c10::cuda::CUDAGuard guard(planes_in.device());
  const auto planes = planes_in.contiguous();
  auto codes = at::empty({rows, cols}, planes.options().dtype(at::kByte));
  launch_unpack(planes, rows, cols, col_layout, CodeStore{codes.data_ptr<uint8_t>(), cols});
  return codes;
}

at::Tensor dequantize_cuda(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout,
                           const at::Tensor& lo_in, const at::Tensor& scale_in, int64_t dim) {
  check_unpack_shape(planes_in, rows, cols, col_layout);
  check_dequantize_ranges(planes_in, lo_in, scale_in, rows, cols, dim);
  const c10::cuda::CUDAGuard guard(planes_in.device());
  const auto planes = planes_in.contiguous();
  const auto lo = lo_in.contiguous(), scale = scale_in.contiguous();
  auto values = cuda_empty({rows, cols}, planes.options().dtype(at::kFloat));
  launch_unpack(planes, rows, cols, col_layout,
                ValueStore{values.data_ptr<float>(), cols, lo.data_ptr<float>(), scale.data_ptr<float>(),
                           static_cast<int>(dim)});
  return values;
}

at::Tensor packed_code_sums_cuda(const at::Tensor& planes_in) {
  check_code_sums_planes(planes_in);
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

}  // namespace pyg_quant
