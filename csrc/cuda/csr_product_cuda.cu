// csr_product's float32 product on the GPU: a group of lanes a row of A, each lane a few features, the row's entries
// summed in their CSR order (the same sum at every run).  One launch and no workspace, where cuSPARSE's SpMM takes
// three launches (a partition, a scaling of the output by beta = 0, the product) and a buffer per call.
#include "csr_product_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace pyg_quant {
namespace {

template <int kVec>
struct Vec;
template <>
struct Vec<1> {
  using type = float;
};
template <>
struct Vec<2> {
  using type = float2;
};
template <>
struct Vec<4> {
  using type = float4;
};

template <int kVec>
__device__ __forceinline__ void load(const float* p, float (&v)[kVec]) {
  const typename Vec<kVec>::type t = __ldg(reinterpret_cast<const typename Vec<kVec>::type*>(p));
  const float* f = reinterpret_cast<const float*>(&t);
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = f[k];
}

// Row r of out = Σ_e val[e] · y[col[e], :] over e in [crow[r], crow[r + 1]), by `group` lanes (a power of 2, at
// most 32), lane j holding features j·kVec + i·group·kVec .. + kVec - 1.
template <typename index_t, int kVec>
__global__ void csr_product_kernel(const index_t* __restrict__ crow, const index_t* __restrict__ col,
                                   const float* __restrict__ val, const float* __restrict__ y, int64_t rows,
                                   int64_t width, int group, float* __restrict__ out) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / group;
  const int64_t first = static_cast<int64_t>(threadIdx.x & (group - 1)) * kVec;
  for (int64_t r = thread / group; r < rows; r += stride) {
    const int64_t begin = crow[r], end = crow[r + 1];
    for (int64_t f = first; f < width; f += static_cast<int64_t>(group) * kVec) {
      float acc[kVec] = {};
#pragma unroll 4
      for (int64_t e = begin; e < end; ++e) {
        const float v = __ldg(val + e);
        float src[kVec];
        load<kVec>(y + static_cast<int64_t>(__ldg(col + e)) * width + f, src);
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[k] = __fmaf_rn(v, src[k], acc[k]);
      }
      if constexpr (kVec == 4) {
        *reinterpret_cast<float4*>(out + r * width + f) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      } else if constexpr (kVec == 2) {
        *reinterpret_cast<float2*>(out + r * width + f) = make_float2(acc[0], acc[1]);
      } else {
        out[r * width + f] = acc[0];
      }
    }
  }
}

template <typename index_t, int kVec>
void launch(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val, const at::Tensor& y,
            at::Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1);
  int group = 1;
  while (group < 32 && group * kVec < width) group *= 2;
  constexpr int threads = 256;
  const int64_t blocks = std::min<int64_t>((rows * group + threads - 1) / threads, int64_t{1} << 20);
  csr_product_kernel<index_t, kVec><<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      crow.data_ptr<index_t>(), col.data_ptr<index_t>(), val.data_ptr<float>(), y.data_ptr<float>(), rows, width,
      group, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename index_t>
void dispatch_width(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val, const at::Tensor& y,
                    at::Tensor& out) {
  // Whole float4 / float2 loads where every row of y and out starts on such a boundary.
  const auto aligned = [&](int bytes) {
    return (out.size(1) * 4) % bytes == 0 && reinterpret_cast<uintptr_t>(y.data_ptr()) % bytes == 0 &&
           reinterpret_cast<uintptr_t>(out.data_ptr()) % bytes == 0;
  };
  if (aligned(16))
    launch<index_t, 4>(crow, col, val, y, out);
  else if (aligned(8))
    launch<index_t, 2>(crow, col, val, y, out);
  else
    launch<index_t, 1>(crow, col, val, y, out);
}

}  // namespace

at::Tensor csr_product_cuda(const at::Tensor& y_in, const at::Tensor& adj) {
  const c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = y_in.contiguous();
  const at::Tensor crow = adj.crow_indices().contiguous(), col = adj.col_indices().contiguous(),
                   val = adj.values().contiguous();
  at::Tensor out = at::empty({adj.size(0), y.size(1)}, y.options());
  if (out.numel() == 0) return out;
  if (crow.scalar_type() == at::kInt)
    dispatch_width<int32_t>(crow, col, val, y, out);
  else
    dispatch_width<int64_t>(crow, col, val, y, out);
  return out;
}

}  // namespace pyg_quant
