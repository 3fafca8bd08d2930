// mlp_weight_codes on the GPU: every row of a chain's weights in one launch (a warp a row), where the CPU's
// composition (csrc/mlp_weight_codes.h) runs a row quantizer and an unpack a weight: a traced graph makes a layer's
// weight codes at every call, and on a GPU each launch costs the host.
// The same float32 steps as quantize_pack_ranges (csrc/quantize_steps.h), so the same codes, ranges and sums.
#include "mlp_weight_codes_cuda.h"

#include "mlp_weight_codes_args.h"
#include "quantize_common.cuh"
#include "quantize_steps.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

namespace pyg_quant {
namespace {
using namespace pyg_quant::cuda;

constexpr int kWeightsPerLaunch = 8;  // a chain's layers (pyg_quant.nn.quant_linear.QUANT_MLP_MAX_LAYERS) in one launch
constexpr int kWarpsPerBlock = 8;

struct WeightRows {
  const float* w[kWeightsPerLaunch];
  uint8_t* codes[kWeightsPerLaunch];
  float* lo[kWeightsPerLaunch];
  float* scale[kWeightsPerLaunch];
  int64_t* sums[kWeightsPerLaunch];
  int64_t cols[kWeightsPerLaunch];
  int64_t row_end[kWeightsPerLaunch];  // the rows of weights 0..l together
  float max_code[kWeightsPerLaunch];
  int count;
};

// Row r of weight l (warp = row_end[l - 1] + r): its range (amin / amax, NaN when the row holds one), its codes and
// their sum.  A warp's lanes all take the same row, so the shuffles see the whole warp.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) weight_codes_kernel(WeightRows args) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= args.row_end[args.count - 1]) return;
  int l = 0;
  while (warp >= args.row_end[l]) ++l;
  const int64_t r = warp - (l > 0 ? args.row_end[l - 1] : 0), cols = args.cols[l];
  const float* row = args.w[l] + r * cols;
  float mn = INFINITY, mx = -INFINITY;
  bool has_nan = false;
  for (int64_t c = lane; c < cols; c += 32) {
    const float v = row[c];
    has_nan |= v != v;
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(kFullMask, mn, offset));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, offset));
    has_nan |= __shfl_xor_sync(kFullMask, static_cast<int>(has_nan), offset) != 0;
  }
  if (has_nan) mn = mx = NAN;  // amin/amax propagate NaN
  const float max_code = args.max_code[l];
  const Range range = range_of(mn, mx, max_code);
  uint8_t* codes = args.codes[l] + r * cols;
  long long sum = 0;
  for (int64_t c = lane; c < cols; c += 32) {
    const uint32_t q = code_of(row[c], range, 0.5f, max_code);
    codes[c] = static_cast<uint8_t>(q);
    sum += q;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullMask, sum, offset);
  if (lane == 0) {
    args.lo[l][r] = range.lo;
    args.scale[l][r] = range.scale;
    args.sums[l][r] = static_cast<int64_t>(sum);
  }
}

}  // namespace

std::vector<at::Tensor> mlp_weight_codes_cuda(at::TensorList weights, at::IntArrayRef bits) {
  check_mlp_weight_codes_args(weights, bits);
  if (weights.empty()) return {};
  const c10::cuda::CUDAGuard guard(weights[0].device());
  const auto options = weights[0].options();
  std::vector<at::Tensor> floats;
  floats.reserve(weights.size());
  for (const at::Tensor& w : weights) floats.push_back(w.to(at::kFloat).contiguous());
  // Each result its own allocation: a registered op's outputs may not share storage (torch.compile's rule).
  std::vector<at::Tensor> out;
  out.reserve(4 * weights.size());
  for (const at::Tensor& w : floats) {
    const int64_t rows = w.size(0);
    out.push_back(at::empty({rows, w.size(1)}, options.dtype(at::kByte)));
    out.push_back(at::empty({rows}, options.dtype(at::kFloat)));
    out.push_back(at::empty({rows}, options.dtype(at::kFloat)));
    out.push_back(at::empty({rows}, options.dtype(at::kLong)));
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < floats.size(); first += kWeightsPerLaunch) {
    WeightRows args{};
    int64_t rows = 0;
    args.count = static_cast<int>(std::min<size_t>(kWeightsPerLaunch, floats.size() - first));
    for (int l = 0; l < args.count; ++l) {
      const size_t i = first + l;
      const at::Tensor& w = floats[i];
      args.w[l] = w.data_ptr<float>();
      args.codes[l] = out[4 * i].data_ptr<uint8_t>();
      args.lo[l] = out[4 * i + 1].data_ptr<float>();
      args.scale[l] = out[4 * i + 2].data_ptr<float>();
      args.sums[l] = out[4 * i + 3].data_ptr<int64_t>();
      args.cols[l] = w.size(1);
      rows += w.size(0);
      args.row_end[l] = rows;
      args.max_code[l] = static_cast<float>((1 << bits[i]) - 1);
    }
    const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    TORCH_CHECK_VALUE(blocks <= 2147483647, "too many weight rows for one launch");
    weight_codes_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace pyg_quant
