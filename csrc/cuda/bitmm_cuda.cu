// Any-bitwidth GEMM on 1-bit tensor cores (mma.sync m16n8k256 .and.popc): sm_80/86/89,
// and int64 (wide) results everywhere; sm_90 takes bitmm_wgmma_cuda.cu for int32 results.
//
// A: row-layout planes [s, M_pad, W]; B: col-layout planes [t, N_pad, W] (both
// run their bits along K; pyg_quant/layout.py).  A block computes a 64 x 64
// output tile with 4 warps of 32 x 32.  K is walked in chunks of kChunkSteps
// k256 steps; every plane of A and B for a chunk is copied to shared memory with
// cp.async, kStages chunks in flight, so the copies of later chunks overlap the
// MMAs of the current one.  Each warp loads A_p's fragments once per chunk and
// reuses them against every plane B_q, counting popc(A_p AND B_q) in a
// chunk-local accumulator that is shifted by p+q and added to the result once
// per chunk (the shift-add is amortised over the chunk's MMAs).  Planes' rows
// are padded to 64 and K to 256 bits, so no copy needs a bounds check.
#include "bitmm_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "bitmm_args.h"
#include "bmma.cuh"
#include "device_limits.h"
#include "epilogue.h"
#include "layout.h"

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

constexpr int kBlockM = 64, kBlockN = 64, kThreads = 128;
static_assert(kOuterAlign % kBlockM == 0 && kOuterAlign % kBlockN == 0, "padded planes are whole blocks");

template <int kChunkSteps>
struct Chunk {
  static constexpr int kWords = kChunkSteps * 8;
  static constexpr int kRowStride = kWords + 4;  // +4 words: ldmatrix's 8 rows hit distinct banks
};

template <typename Acc, int kChunkSteps, int kStages>
__global__ void __launch_bounds__(kThreads) bitmm_kernel(const uint32_t* __restrict__ a, const uint32_t* __restrict__ b,
                                                         int s, int t, int64_t a_plane, int64_t b_plane, int64_t words,
                                                         int64_t rows, int64_t cols, Acc* __restrict__ out) {
  using C = Chunk<kChunkSteps>;
  extern __shared__ uint4 smem_raw[];
  const int stage_words = (s + t) * kBlockM * C::kRowStride;  // [s][64][stride] A planes, then [t][64][stride] B
  uint32_t* smem = reinterpret_cast<uint32_t*>(smem_raw);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBlockN;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_m = (warp >> 1) * 32, warp_n = (warp & 1) * 32;
  // ldmatrix lane addresses: A fragment = rows 0-7/8-15 x words 0-3/4-7;
  // B x4 = two n8 tiles, each words 0-3 then 4-7.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_word = (lane >> 4) * 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_word = ((lane >> 3) & 1) * 4;
  const int64_t num_chunks = (words + C::kWords - 1) / C::kWords;

  auto load_chunk = [&](int64_t chunk) {
    if (chunk < num_chunks) {
      uint32_t* stage = smem + (chunk % kStages) * stage_words;
      const int64_t k0 = chunk * C::kWords;
      const int slots = (s + t) * kBlockM * (C::kWords / 4);
      for (int i = threadIdx.x; i < slots; i += kThreads) {
        const int plane_row = i / (C::kWords / 4), quad = i % (C::kWords / 4);
        const uint32_t* src;
        if (plane_row < s * kBlockM) {
          src = a + (plane_row / kBlockM) * a_plane + (m0 + plane_row % kBlockM) * words;
        } else {
          const int r = plane_row - s * kBlockM;
          src = b + (r / kBlockN) * b_plane + (n0 + r % kBlockN) * words;
        }
        const int64_t k = k0 + quad * 4;
        // past K (a partial last chunk): zero-fill from a valid address
        cp_async_16(stage + plane_row * C::kRowStride + quad * 4, src + (k < words ? k : 0), k < words ? 16 : 0);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };

  Acc acc[2][4][4] = {};
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) load_chunk(st);
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk's copies are visible, and every warp is done with the stage refilled next
    load_chunk(chunk + kStages - 1);
    const uint32_t* a_smem = smem + (chunk % kStages) * stage_words;
    const uint32_t* b_smem = a_smem + s * kBlockM * C::kRowStride;
    const int64_t remaining_steps = (words - chunk * C::kWords) / 8;
    const int steps = remaining_steps < kChunkSteps ? static_cast<int>(remaining_steps) : kChunkSteps;
    for (int p = 0; p < s; ++p) {
      uint32_t af[kChunkSteps][2][4];
#pragma unroll
      for (int k = 0; k < kChunkSteps; ++k) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          if (k < steps) {
            ldmatrix_x4(af[k][mt], a_smem + (p * kBlockM + warp_m + mt * 16 + a_row) * C::kRowStride + k * 8 + a_word);
          }
        }
      }
      for (int q = 0; q < t; ++q) {
        int32_t part[2][4][4] = {};
#pragma unroll
        for (int k = 0; k < kChunkSteps; ++k) {
          if (k < steps) {
#pragma unroll
            for (int np = 0; np < 2; ++np) {
              uint32_t bf[4];
              ldmatrix_x4(bf, b_smem + (q * kBlockN + warp_n + np * 16 + b_row) * C::kRowStride + k * 8 + b_word);
              const uint32_t b_lo[2] = {bf[0], bf[1]}, b_hi[2] = {bf[2], bf[3]};
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
                bmma_and_popc(part[mt][2 * np], af[k][mt], b_lo);
                bmma_and_popc(part[mt][2 * np + 1], af[k][mt], b_hi);
              }
            }
          }
        }
        const int shift = p + q;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] += static_cast<Acc>(part[mt][nt][i]) << shift;
      }
    }
  }
  cp_async_wait<0>();

  const int g = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int64_t col = n0 + warp_n + nt * 8 + 2 * tig;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = m0 + warp_m + mt * 16 + g + half * 8;
        if (row >= rows) continue;
        if (col < cols) out[row * cols + col] = acc[mt][nt][2 * half];
        if (col + 1 < cols) out[row * cols + col + 1] = acc[mt][nt][2 * half + 1];
      }
    }
  }
}

template <typename Acc, int kChunkSteps, int kStages>
void launch_bitmm_config(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, at::Tensor& out,
                         size_t smem) {
  const int s = a.size(0), t = b.size(0);
  const int64_t words = a.size(2);
  auto kernel = bitmm_kernel<Acc, kChunkSteps, kStages>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid((rows + kBlockM - 1) / kBlockM, (cols + kBlockN - 1) / kBlockN);
  kernel<<<grid, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(a.data_ptr<int32_t>()), reinterpret_cast<const uint32_t*>(b.data_ptr<int32_t>()),
      s, t, a.size(1) * words, b.size(1) * words, words, rows, cols, out.data_ptr<Acc>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Chunk length: as long as K allows and the planes fit (more planes, shorter
// chunks); then as many stages as the device's shared memory holds (2 or 3).
template <typename Acc>
void launch_bitmm(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t cols, at::Tensor& out) {
  const int planes = a.size(0) + b.size(0);
  const int64_t k_steps = a.size(2) / 8;
  int chunk_steps = planes <= 4 ? 4 : (planes <= 8 ? 2 : 1);
  while (chunk_steps > 1 && chunk_steps / 2 >= k_steps) chunk_steps /= 2;
  const int smem_optin = cuda::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, a.device().index());
  const size_t smem_limit = static_cast<size_t>(smem_optin);
  const size_t stage_bytes = static_cast<size_t>(planes) * kBlockM * (chunk_steps * 8 + 4) * sizeof(uint32_t);
  const bool three = 3 * stage_bytes <= smem_limit && k_steps > chunk_steps;
  TORCH_CHECK(2 * stage_bytes <= smem_limit, "bitmm_int: ", planes, " bit planes need ", 2 * stage_bytes,
              " bytes of shared memory, the device has ", smem_limit);
#define PYG_QUANT_BITMM_CASE(STEPS)                                                   \
  case STEPS:                                                                         \
    if (three) {                                                                      \
      launch_bitmm_config<Acc, STEPS, 3>(a, b, rows, cols, out, 3 * stage_bytes);     \
    } else {                                                                          \
      launch_bitmm_config<Acc, STEPS, 2>(a, b, rows, cols, out, 2 * stage_bytes);     \
    }                                                                                 \
    break;
  switch (chunk_steps) {
    PYG_QUANT_BITMM_CASE(1)
    PYG_QUANT_BITMM_CASE(2)
    PYG_QUANT_BITMM_CASE(4)
  }
#undef PYG_QUANT_BITMM_CASE
}

}  // namespace

at::Tensor bitmm_int_cuda(const at::Tensor& a_in, const at::Tensor& b_in, int64_t rows, int64_t cols, bool wide) {
  check_bitmm_int_args(a_in, b_in, rows, cols, /*word_multiple=*/kPackAlignWords);  // whole k256 steps
  TORCH_CHECK_VALUE(a_in.size(1) % kBlockM == 0 && b_in.size(1) % kBlockN == 0,
                    "planes' outer dimension must be padded to 64");
  TORCH_CHECK_VALUE((cols + kBlockN - 1) / kBlockN <= 65535, "too many output columns for one launch");
  const c10::cuda::CUDAGuard guard(a_in.device());
  // Both kernels copy 16-byte pieces of the planes (cp.async, TMA): a view that starts off a 16-byte boundary
  // (a storage offset, not what to_bit makes) is copied first.
  auto aligned = [](const at::Tensor& x) {
    const auto c = x.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
  };
  const auto a = aligned(a_in);
  const auto b = aligned(b_in);
  auto out = at::empty({rows, cols}, a.options().dtype(wide ? at::kLong : at::kInt));
  if (rows == 0 || cols == 0) return out;
  if (wide) {
    launch_bitmm<int64_t>(a, b, rows, cols, out);
  } else if (!bitmm_int_wgmma(a, b, rows, cols, out)) {
    launch_bitmm<int32_t>(a, b, rows, cols, out);
  }
  return out;
}

namespace {

// Threads run along a row's columns (coalesced product reads and output writes), warps down the rows.  A thread
// keeps its column's terms (column sum, b's range, bias) in registers for the kAffineRowsPerThread rows it visits,
// so that an element costs its own loads, conversions and arithmetic only: one element per thread spent most of
// its instructions on that setup.
constexpr int kAffineCols = 32, kAffineRows = 8, kAffineRowsPerThread = 16;

template <typename P>
__global__ void bitmm_affine_kernel(const P* __restrict__ product, const int64_t* __restrict__ row_sums,
                                    const int64_t* __restrict__ col_sums, const float* __restrict__ a_lo,
                                    const float* __restrict__ a_scale, const float* __restrict__ b_lo,
                                    const float* __restrict__ b_scale, const float* __restrict__ bias, float k,
                                    bool relu, int64_t rows, int64_t cols, float* __restrict__ out) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kAffineCols + threadIdx.x; j < cols;
       j += static_cast<int64_t>(gridDim.x) * kAffineCols) {
    const float lb = b_lo[j], rb = b_scale[j], column_bias = bias ? bias[j] : 0.0f;
    const float col_term = bitmm_col_term(k, lb, rb, static_cast<float>(col_sums[j]));
    constexpr int64_t kAffineTileRows = kAffineRows * kAffineRowsPerThread;
    for (int64_t tile = static_cast<int64_t>(blockIdx.y) * kAffineTileRows; tile < rows;
         tile += gridDim.y * kAffineTileRows) {
#pragma unroll 4
      for (int t = 0; t < kAffineRowsPerThread; ++t) {
        const int64_t i = tile + threadIdx.y + static_cast<int64_t>(t) * kAffineRows;
        if (i >= rows) break;
        out[i * cols + j] = bitmm_affine_epilogue(static_cast<float>(product[i * cols + j]),
                                                  static_cast<float>(row_sums[i]), col_term, a_lo[i], a_scale[i], lb,
                                                  rb, column_bias, relu);
      }
    }
  }
}

}  // namespace

at::Tensor bitmm_affine_cuda(const at::Tensor& product_in, const at::Tensor& row_sums, const at::Tensor& col_sums,
                             const at::Tensor& a_lo, const at::Tensor& a_scale, const at::Tensor& b_lo,
                             const at::Tensor& b_scale, int64_t k, const std::optional<at::Tensor>& bias_in,
                             bool relu) {
  check_bitmm_affine_args(product_in, row_sums, col_sums, a_lo, a_scale, b_lo, b_scale, k, bias_in);
  const c10::cuda::CUDAGuard guard(product_in.device());
  const int64_t rows = product_in.size(0), cols = product_in.size(1);
  const auto product = product_in.contiguous();
  const auto rs = row_sums.contiguous(), cs = col_sums.contiguous();
  const auto la = a_lo.contiguous(), ra = a_scale.contiguous(), lb = b_lo.contiguous(), rb = b_scale.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  auto out = at::empty({rows, cols}, la.options());
  const int64_t total = rows * cols;
  if (total == 0) return out;
  const dim3 threads(kAffineCols, kAffineRows);
  const dim3 blocks(static_cast<unsigned>(std::min<int64_t>((cols + kAffineCols - 1) / kAffineCols, 64)),
                    static_cast<unsigned>(std::min<int64_t>(
                        (rows + kAffineRows * kAffineRowsPerThread - 1) / (kAffineRows * kAffineRowsPerThread), 65535)));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (product.scalar_type() == at::kLong) {
    bitmm_affine_kernel<int64_t><<<blocks, threads, 0, stream>>>(
        product.data_ptr<int64_t>(), rs.data_ptr<int64_t>(), cs.data_ptr<int64_t>(), la.data_ptr<float>(),
        ra.data_ptr<float>(), lb.data_ptr<float>(), rb.data_ptr<float>(), bp, static_cast<float>(k), relu, rows,
        cols, out.data_ptr<float>());
  } else {
    bitmm_affine_kernel<int32_t><<<blocks, threads, 0, stream>>>(
        product.data_ptr<int32_t>(), rs.data_ptr<int64_t>(), cs.data_ptr<int64_t>(), la.data_ptr<float>(),
        ra.data_ptr<float>(), lb.data_ptr<float>(), rb.data_ptr<float>(), bp, static_cast<float>(k), relu, rows,
        cols, out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace pyg_quant
