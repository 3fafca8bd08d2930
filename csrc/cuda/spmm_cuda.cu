// A·X on the block-sparse bit adjacency with 1-bit tensor cores.
//
// A warp owns one 16-row window and 32 features.  For each stored tile of the
// window (zero tiles are not stored, so never read) it loads the m16 x k256
// fragment of every adjacency plane once and multiplies it with the matching
// k256 x n8 fragments of every feature plane: the tile row's words line up with
// words 8c..8c+7 of the column-layout planes (pyg_quant/layout.py), so features
// are read in place.  The int32 fragments are then staged in shared memory,
// where each lane (one feature) adds the CSR residual's codes of its rows
// (coalesced 32-byte reads of a row-major code copy) before one coalesced store.
#include "spmm_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "bmma.cuh"
#include "quantize_cuda.h"

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

constexpr int kTileRows = 16, kTileWords = 8, kWarpFeatures = 32, kWarpsPerBlock = 4;

template <typename Acc>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    bit_spmm_kernel(const int64_t* __restrict__ window_ptr, const int32_t* __restrict__ tile_col,
                    const uint32_t* __restrict__ tile_bits, int64_t tile_plane, int a_bits,
                    const uint32_t* __restrict__ x, int64_t x_plane, int64_t x_words, int x_bits,
                    const int64_t* __restrict__ res_ptr, const int32_t* __restrict__ res_col,
                    const int32_t* __restrict__ res_val, const uint8_t* __restrict__ codes, int64_t num_windows,
                    int64_t rows, int64_t cols, Acc* __restrict__ out) {
  __shared__ Acc staged[kWarpsPerBlock][kTileRows][kWarpFeatures + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t window = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (window >= num_windows) return;  // whole warps only: no block-wide barrier below
  const int64_t d0 = static_cast<int64_t>(blockIdx.y) * kWarpFeatures;
  const int g = lane >> 2, tig = lane & 3;

  Acc acc[4][4] = {};
  for (int64_t tile = window_ptr[window]; tile < window_ptr[window + 1]; ++tile) {
    const int64_t col_word = static_cast<int64_t>(tile_col[tile]) * kTileWords;
    for (int pa = 0; pa < a_bits; ++pa) {
      const uint32_t* tb = tile_bits + pa * tile_plane + tile * kTileRows * kTileWords;
      const uint32_t af[4] = {tb[g * kTileWords + tig], tb[(g + 8) * kTileWords + tig], tb[g * kTileWords + tig + 4],
                              tb[(g + 8) * kTileWords + tig + 4]};
      for (int q = 0; q < x_bits; ++q) {
        const uint32_t* xb = x + q * x_plane + (d0 + g) * x_words + col_word;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const uint32_t bf[2] = {xb[nt * 8 * x_words + tig], xb[nt * 8 * x_words + tig + 4]};
          int32_t part[4] = {0, 0, 0, 0};
          bmma_and_popc(part, af, bf);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[nt][i] += static_cast<Acc>(part[i]) << (pa + q);
        }
      }
    }
  }

#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    staged[warp][g][nt * 8 + 2 * tig] = acc[nt][0];
    staged[warp][g][nt * 8 + 2 * tig + 1] = acc[nt][1];
    staged[warp][g + 8][nt * 8 + 2 * tig] = acc[nt][2];
    staged[warp][g + 8][nt * 8 + 2 * tig + 1] = acc[nt][3];
  }
  __syncwarp();
  const int64_t d = d0 + lane;
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t row = window * kTileRows + r;
    if (row >= rows) break;
    Acc sum = staged[warp][r][lane];
    for (int64_t e = res_ptr[row]; e < res_ptr[row + 1]; ++e) {
      const Acc weight = res_val ? res_val[e] : 1;
      if (d < cols) sum += weight * static_cast<Acc>(codes[static_cast<int64_t>(res_col[e]) * cols + d]);
    }
    if (d < cols) out[row * cols + d] = sum;
  }
}

}  // namespace

at::Tensor bit_spmm_int_cuda(const at::Tensor& window_ptr_in, const at::Tensor& tile_col_in,
                             const at::Tensor& tile_bits_in, const at::Tensor& res_ptr_in, const at::Tensor& res_col_in,
                             const std::optional<at::Tensor>& res_val_in, const at::Tensor& x_in, int64_t rows,
                             int64_t cols, bool wide) {
  TORCH_CHECK_VALUE(window_ptr_in.dim() == 1 && window_ptr_in.scalar_type() == at::kLong, "window_ptr must be int64[num_windows + 1]");
  TORCH_CHECK_VALUE(tile_col_in.dim() == 1 && tile_col_in.scalar_type() == at::kInt, "tile_col must be int32[num_tiles]");
  TORCH_CHECK_VALUE(tile_bits_in.dim() == 4 && tile_bits_in.scalar_type() == at::kInt &&
                        tile_bits_in.size(1) == tile_col_in.size(0) && tile_bits_in.size(2) == kTileRows &&
                        tile_bits_in.size(3) == kTileWords,
                    "tile_bits must be int32[bits, num_tiles, 16, 8]");
  TORCH_CHECK_VALUE(x_in.dim() == 3 && x_in.scalar_type() == at::kInt && x_in.size(2) % kTileWords == 0 &&
                        x_in.size(1) % 64 == 0,
                    "x_planes must be column-layout int32[bits, outer (padded to 64), words]");
  TORCH_CHECK_VALUE(tile_bits_in.size(0) <= 8 && x_in.size(0) <= 8, "at most 8 bit planes per operand");
  TORCH_CHECK_VALUE(cols <= x_in.size(1), "cols exceeds x_planes' padded feature count");
  TORCH_CHECK_VALUE(res_ptr_in.dim() == 1 && res_ptr_in.scalar_type() == at::kLong && res_ptr_in.size(0) == rows + 1,
                    "res_ptr must be int64[rows + 1]");
  TORCH_CHECK_VALUE(res_col_in.dim() == 1 && res_col_in.scalar_type() == at::kInt, "res_col must be int32[res_nnz]");
  if (res_val_in.has_value()) {
    TORCH_CHECK_VALUE(res_val_in->scalar_type() == at::kInt && res_val_in->sizes() == res_col_in.sizes(),
                      "res_val must be int32 with res_col's shape");
  }
  const int64_t num_windows = window_ptr_in.size(0) - 1;
  TORCH_CHECK_VALUE(num_windows * kTileRows >= rows, "rows exceeds the adjacency's row windows");
  for (const auto* t : {&window_ptr_in, &tile_col_in, &tile_bits_in, &res_ptr_in, &res_col_in}) {
    TORCH_CHECK_VALUE(t->device() == x_in.device(), "the adjacency and x_planes must be on one device");
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto window_ptr = window_ptr_in.contiguous();
  const auto tile_col = tile_col_in.contiguous();
  const auto tile_bits = tile_bits_in.contiguous();
  const auto res_ptr = res_ptr_in.contiguous();
  const auto res_col = res_col_in.contiguous();
  const auto res_val = res_val_in.has_value() ? res_val_in->contiguous() : at::Tensor();
  const auto x = x_in.contiguous();
  // Index bounds are the format's invariants (BitAdjacency builds them); they are
  // not re-checked here because that would need a device-to-host copy.
  at::Tensor codes;
  if (res_col.numel() > 0) codes = unpack_codes_cuda(x, x.size(2) * 32, cols, /*col_layout=*/true);

  auto out = at::empty({rows, cols}, x.options().dtype(wide ? at::kLong : at::kInt));
  if (rows == 0 || cols == 0) return out;
  const dim3 grid((num_windows + kWarpsPerBlock - 1) / kWarpsPerBlock, (cols + kWarpFeatures - 1) / kWarpFeatures);
  TORCH_CHECK_VALUE(grid.y <= 65535, "too many feature columns for one launch");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto* out_ptr) {
    using Acc = std::remove_pointer_t<decltype(out_ptr)>;
    bit_spmm_kernel<Acc><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        window_ptr.data_ptr<int64_t>(), tile_col.data_ptr<int32_t>(),
        reinterpret_cast<const uint32_t*>(tile_bits.data_ptr<int32_t>()), tile_bits.size(1) * kTileRows * kTileWords,
        static_cast<int>(tile_bits.size(0)), reinterpret_cast<const uint32_t*>(x.data_ptr<int32_t>()),
        x.size(1) * x.size(2), x.size(2), static_cast<int>(x.size(0)), res_ptr.data_ptr<int64_t>(),
        res_col.data_ptr<int32_t>(), res_val.defined() ? res_val.data_ptr<int32_t>() : nullptr,
        codes.defined() ? codes.data_ptr<uint8_t>() : nullptr, num_windows, rows, cols, out_ptr);
  };
  if (wide) {
    launch(out.data_ptr<int64_t>());
  } else {
    launch(out.data_ptr<int32_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace pyg_quant
