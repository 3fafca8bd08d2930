#pragma once
// Helpers of the quantize ops' kernel files (quantize_pack_cuda.cu, quantize_ranges_cuda.cu, row_codes_cuda.cu).
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pyg_quant {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// Blocks of a grid-stride kernel over `work` items: at most 65535 · 16, the kernels loop over the rest.
inline int64_t blocks_for(int64_t work, int64_t per_block) {
  return std::min<int64_t>((work + per_block - 1) / per_block, 65535 * 16);
}

// Copies the plane words of columns c0 .. c0 + kCols - 1 and words w0 .. w0 + kWords - 1 of `bits` planes into
// tile[p][c][k], kWords consecutive threads reading one column's words (a whole 32-byte sector at kWords = 8); words
// past cols or words are zeros.  The caller synchronizes the block before reading the tile.
template <int kCols, int kWords, int kThreads, int kStride>
__device__ __forceinline__ void stage_plane_words(const uint32_t* __restrict__ planes, uint32_t (*tile)[kCols][kStride],
                                                  int bits, int64_t c0, int64_t w0, int64_t cols, int64_t words,
                                                  int64_t plane_stride) {
  for (int i = threadIdx.x; i < bits * kCols * kWords; i += kThreads) {
    const int k = i % kWords, c = (i / kWords) % kCols, p = i / (kWords * kCols);
    const bool live = c0 + c < cols && w0 + k < words;
    tile[p][c][k] = live ? __ldg(planes + p * plane_stride + (c0 + c) * words + w0 + k) : 0u;
  }
}

// f(std::integral_constant<int, bits>()) for bits in 1..8: the kernels above take the width as a template argument.
template <typename F>
void dispatch_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

}  // namespace cuda
}  // namespace pyg_quant
