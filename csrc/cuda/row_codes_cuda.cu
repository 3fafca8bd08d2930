// The packed row codes of bit planes (pack_row_codes) and the column-layout planes of packed row codes
// (planes_from_row_codes) on the GPU: the format of csrc/row_codes.h, which the CSR gather of bit_spmm reads.
#include "quantize_cuda.h"

#include "layout.h"
#include "row_codes.h"
#include "device_limits.h"
#include "quantize_common.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

// Row layout: one thread per (node, 32-bit word of its packed row), nodes fastest.
__global__ void pack_row_codes_rows_kernel(const uint32_t* __restrict__ planes, uint32_t* __restrict__ out,
                                           int64_t nodes, int64_t cols, int64_t row_words, int64_t words, int bits,
                                           int64_t plane_stride) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t j = blockIdx.y;
  if (r >= nodes) return;
  const int container = container_bits(bits), per_word = 32 / container;
  uint32_t packed = 0;
  for (int k = 0; k < per_word; ++k) {
    const int64_t c = j * per_word + k;
    if (c >= cols) break;
    const uint32_t* word = planes + r * words + (c >> 5);
    uint32_t q = 0;
    for (int p = 0; p < bits; ++p) q |= ((__ldg(word + p * plane_stride) >> (c & 31)) & 1u) << p;
    packed |= q << (k * container);
  }
  out[r * row_words + j] = packed;
}

// Column layout: a block owns 256 nodes (8 plane words) and 32 columns.  It first copies the bits x 32 x 8 plane
// words it needs into shared memory, 8 consecutive threads reading one column's 8 words (a whole 32-byte sector),
// then thread n assembles node n's codes of those columns, container(bits) words, from words that every lane of its
// warp reads at once (a broadcast), instead of each thread reading every plane word once per code from global
// memory, which was issue- and latency-bound.
constexpr int kPackNodes = 256, kPackNodeWords = kPackNodes / 32, kPackCols = 32;

template <int kBits>
__global__ void __launch_bounds__(kPackNodes) pack_row_codes_cols_kernel(const uint32_t* __restrict__ planes,
                                                                         uint32_t* __restrict__ out, int64_t cols,
                                                                         int64_t row_words, int64_t words,
                                                                         int64_t plane_stride) {
  constexpr int kContainer = container_bits(kBits), kPerWord = 32 / kContainer;
  constexpr int kOutWords = kPackCols / kPerWord;  // words of a node's row this block writes
  __shared__ uint32_t tile[kBits][kPackCols][kPackNodeWords];
  const int t = threadIdx.x;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kPackNodeWords;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kPackCols;
  stage_plane_words<kPackCols, kPackNodeWords, kPackNodes>(planes, tile, kBits, c0, w0, cols, words, plane_stride);
  __syncthreads();
  const int64_t node = w0 * 32 + t;
  if (w0 + t / 32 >= words) return;
  const int k = t / 32, shift = t % 32;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kOutWords;
#pragma unroll
  for (int jj = 0; jj < kOutWords; ++jj) {
    uint32_t packed = 0;
#pragma unroll
    for (int e = 0; e < kPerWord; ++e) {
      const int c = jj * kPerWord + e;
      uint32_t q = 0;
#pragma unroll
      for (int p = 0; p < kBits; ++p) q |= ((tile[p][c][k] >> shift) & 1u) << p;
      packed |= q << (e * kContainer);
    }
    if (j0 + jj < row_words) out[node * row_words + j0 + jj] = packed;
  }
}

// planes_from_row_codes: the column-layout planes (layout.py) of packed row codes.  A block takes octets of 32-row
// groups (256 rows: one 32-byte sector of every plane row, so that the planes are written in whole sectors rather
// than one 4-byte store per word, which made the kernel as slow as the dynamic quantizer).
// The octet's rows are contiguous: the block copies them into shared memory at an odd word pitch, then warp w takes
// group w % 8 and every fourth column from w / 8 (a lane a row, 32 banks) and forms each plane's word of a column
// with one ballot (kBits of them, unrolled: independent); the words gather in shared memory in the planes' own order
// (a plane row's 8 words consecutive, a plane's rows an odd pitch apart) and go out 8 consecutive words per plane
// row.  Columns past `cols` (to outer_pad) are zero words.
constexpr int kPlanesWarps = 32;
constexpr int kPlanesThreads = kPlanesWarps * 32;
constexpr unsigned kPlanesFullMask = 0xffffffffu;
static_assert(kPackAlignWords % 8 == 0, "the planes' node words are whole octets");

// The shared memory of planes_from_row_codes_kernel: the octet's rows at an odd word pitch, then the words it forms,
// a plane's rows an odd pitch apart.
__host__ __device__ inline int planes_in_pitch(const PlanesFromRowCodesShape& shape) { return shape.row_words | 1; }
__host__ __device__ inline int planes_out_pitch(const PlanesFromRowCodesShape& shape) { return shape.cols * 8 + 1; }
inline int planes_smem_bytes(const PlanesFromRowCodesShape& shape) {
  return (256 * planes_in_pitch(shape) + shape.bits * planes_out_pitch(shape)) * 4;
}

template <int kBits>
__global__ void __launch_bounds__(kPlanesThreads) planes_from_row_codes_kernel(const uint32_t* __restrict__ row_codes,
                                                                               uint32_t* __restrict__ planes,
                                                                               const PlanesFromRowCodesShape shape) {
  extern __shared__ uint32_t planes_smem[];
  const int in_pitch = planes_in_pitch(shape), out_pitch = planes_out_pitch(shape), row_words = shape.row_words;
  uint32_t* in = planes_smem;
  uint32_t* out = planes_smem + 256 * in_pitch;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp & 7, slice = warp >> 3;
  constexpr int container = container_bits(kBits);
  const uint32_t mask = (1u << container) - 1u;
  const int64_t octets = shape.words / 8;
  for (int64_t octet = blockIdx.x; octet < octets; octet += gridDim.x) {
    const uint32_t* source = row_codes + octet * 256 * row_words;
    for (int i = threadIdx.x; i < 256 * row_words; i += kPlanesThreads) {
      const int r = i / row_words;
      in[r * in_pitch + (i - r * row_words)] = __ldg(source + i);
    }
    __syncthreads();
    const uint32_t* row = in + (group * 32 + lane) * in_pitch;
#pragma unroll 2
    for (int c = slice; c < shape.cols; c += kPlanesWarps / 8) {
      const int bit = c * container;
      const uint32_t q = (row[bit >> 5] >> (bit & 31)) & mask;
      uint32_t mine = 0;
#pragma unroll
      for (int p = 0; p < kBits; ++p) {
        const uint32_t word = __ballot_sync(kPlanesFullMask, (q >> p) & 1u);
        mine = lane == p ? word : mine;
      }
      if (lane < kBits) out[lane * out_pitch + c * 8 + group] = mine;
    }
    __syncthreads();
    const int plane_words = shape.outer_pad * 8;
    for (int i = threadIdx.x; i < kBits * plane_words; i += kPlanesThreads) {
      const int p = i / plane_words, rest = i - p * plane_words, c = rest >> 3, g = rest & 7;
      const uint32_t word = c < shape.cols ? out[p * out_pitch + rest] : 0u;
      planes[(static_cast<int64_t>(p) * shape.outer_pad + c) * shape.words + octet * 8 + g] = word;
    }
    __syncthreads();  // the buffers are read before the next octet overwrites them
  }
}

}  // namespace

at::Tensor pack_row_codes_cuda(const at::Tensor& planes_in, int64_t cols, bool col_layout) {
  const RowCodesShape shape = row_codes_shape(planes_in, cols, col_layout);
  const c10::cuda::CUDAGuard guard(planes_in.device());
  const auto planes = planes_in.contiguous();
  const int64_t bits = shape.bits, outer = shape.outer, words = shape.words, nodes = shape.nodes;
  const int64_t row_bytes = shape.row_bytes;
  auto codes = at::empty({nodes, row_bytes}, planes.options().dtype(at::kByte));
  if (nodes == 0) return codes;
  const auto* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  auto* out = reinterpret_cast<uint32_t*>(codes.data_ptr<uint8_t>());
  const int64_t row_words = row_bytes / 4;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (col_layout) {
    const int64_t per_block = kPackCols * container_bits(bits) / 32;  // row words a block writes
    const dim3 grid(static_cast<unsigned>((words + kPackNodeWords - 1) / kPackNodeWords),
                    static_cast<unsigned>((row_words + per_block - 1) / per_block));
    TORCH_CHECK_VALUE(grid.y <= 65535 && grid.x <= 2147483647u, "too many nodes or columns for one launch");
    dispatch_bits(bits, [&](auto bits_tag) {
      pack_row_codes_cols_kernel<decltype(bits_tag)::value><<<grid, kPackNodes, 0, stream>>>(in, out, cols, row_words,
                                                                                              words, outer * words);
    });
  } else {
    constexpr int kThreads = 128;
    const dim3 grid(static_cast<unsigned>((nodes + kThreads - 1) / kThreads), static_cast<unsigned>(row_words));
    TORCH_CHECK_VALUE(grid.y <= 65535, "too many columns for one launch");
    pack_row_codes_rows_kernel<<<grid, kThreads, 0, stream>>>(in, out, nodes, cols, row_words, words,
                                                              static_cast<int>(bits), outer * words);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return codes;
}

at::Tensor planes_from_row_codes_cuda(const at::Tensor& row_codes, int64_t rows, int64_t cols, int64_t bits) {
  const PlanesFromRowCodesShape shape = planes_from_row_codes_shape(row_codes, rows, cols, bits);
  const c10::cuda::CUDAGuard guard(row_codes.device());
  auto planes = at::empty({bits, shape.outer_pad, shape.words}, row_codes.options().dtype(at::kInt));
  const int smem = planes_smem_bytes(shape);
  const int device = row_codes.device().index();
  TORCH_CHECK_VALUE(smem <= cuda::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cols: ", cols,
                    " columns of ", bits, "-bit codes need more shared memory than this GPU gives a block");
  const auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    const int64_t resident = static_cast<int64_t>(cuda::sm_count(device)) *
                             cuda::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kPlanesThreads, smem,
                                                          device);
    kernel<<<static_cast<unsigned>(std::min(shape.words / 8, resident)), kPlanesThreads, smem,
             c10::cuda::getCurrentCUDAStream()>>>(reinterpret_cast<const uint32_t*>(row_codes.data_ptr<uint8_t>()),
                                                  reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>()), shape);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  dispatch_bits(bits, [&](auto bits_tag) { launch(planes_from_row_codes_kernel<decltype(bits_tag)::value>); });
  return planes;
}

}  // namespace pyg_quant
