// quant_mlp on the GPU: the whole chain of QuantLinear bit layers in one launch.
//
// A block stages every layer's weight codes once in shared memory, packed 4 to a 32-bit word and stored [k][o] (word k
// of output o at k·out + o), so that the 32 lanes of a warp, which own consecutive output channels, read 32 consecutive
// words (no bank conflicts); the per-channel range, code sum and bias sit beside them (a layer whose input width is a
// multiple of 16 is staged 16 codes a load).  Then each warp owns kRows rows at a time (kRowsPerWarp = 4; grid-stride
// over groups of kRows rows).  The rows live in registers: lane j holds columns j, j+32, ... of each -- the same
// channels it computes as outputs, so a layer's output is already where the next layer's input must be.  Per layer and
// row: the row's min / max with order-preserving unsigned keys and one warp reduction each (__reduce_min/max_sync; a
// NaN makes both NaN, as amin / amax do), the range (lane i forms row i's, read back with shuffles) and codes with
// the float32 steps of quantize_steps.h (the row quantizer's), the codes as bytes in the row's shared buffer (so
// every lane can read the whole row 16 codes at a time), the code sum by one warp reduction, the exact int32
// product with __dp4a (u8 x u8 -> u32, at most 256·255·255 < 2^32), and bitmm's float64 epilogue (epilogue.h).
// The last layer's rows are stored coalesced, times their row_scale when one is given (GCN's D^-1/2 folded into
// its linear layer).
// Nothing but the output is allocated and nothing waits on the host.
//
// Why kRows rows a warp: the product is bound by shared-memory loads.  With one row a warp, a lane loads per row
// and layer words/4 × (1 LDS.128 of codes + 4·kChunks LDS.32 of weights), each weight word serving that one row:
// 4 × (1 + 8) = 36 for a 64 -> 64 layer, ~50 shared loads a row-layer with the epilogue's parameters (a GIN MLP
// 64 -> 64 -> 64 -> 64 over 32,000 rows: ~4.9M warp-level loads, ~37K per H100 SM; it took 49 µs).  With kRows
// rows each weight word (and each epilogue parameter) feeds kRows rows: words/4 × (kRows + 4·kChunks) per kRows
// rows, 12 a row-layer for 64 -> 64 at kRows = 4, ~18 with the parameters.  Each row keeps its own registers
// (h, acc), reductions and code buffer (kRows × codes_stride bytes a warp).  Rows past the end (the last group
// only) carry zeros and store nothing; a group's rows are the same on every lane, so every warp-wide intrinsic
// still runs on the full warp.  Registers (ptxas, sm_80 / sm_90a), kChunks 1, 2, 4, 8: 56 / 64, 64 / 64, 80 / 78,
// 126 / 126 at kRows = 4 (40, 40, 48, 48 at one row), no spills.
#include "quant_mlp_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "epilogue.h"
#include "quant_mlp_args.h"
#include "quantize_steps.h"
#include "cuda/device_limits.h"
#include "cuda/ordered_key.cuh"

namespace pyg_quant {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Rows a warp carries at a time: each weight word loaded from shared memory feeds this many rows' __dp4a.
constexpr int kRowsPerWarp = 4;

// Rows per warp of the instantiation with `chunks` values per lane (the kernel's kRows; the host sizes the code
// buffers and the grid with it).  kRowsPerWarp for every width: even kChunks = 8 does not spill at 4 rows.
constexpr int rows_per_warp(int /*chunks*/) { return kRowsPerWarp; }

struct MlpLayer {
  const uint8_t* w;  // [out, in] codes in global memory
  const float* lo;
  const float* scale;
  const int64_t* sums;
  const float* bias;  // nullptr: none
  int in, out;
  int words;          // 32-bit words of a weight row in shared memory: ceil(in / 4) rounded up to a multiple of 4
  int w_offset;       // byte offsets into the dynamic shared memory: weight words, then
  int param_offset;   // lo[out], scale[out], bias[out] (float32), then
  int sums_offset;    // code sums[out] as float64 (exact)
  float max_code;
  int relu;
  int aligned;  // 1: in % 4 == 0 and w 4-byte aligned (a weight row is whole 32-bit words); 2: the same for 16 bytes
};

struct MlpArgs {
  MlpLayer layer[kQuantMlpMaxLayers];
  int layers;
  int codes_offset;  // per-warp code buffers, codes_stride bytes each
  int codes_stride;
  const float* x;
  float* out;
  const float* row_scale;  // nullptr: none
  int64_t rows;
};

// kChunks: values per lane (every width <= 32·kChunks); kRows: rows a warp carries at a time.
template <int kChunks, int kRows>
__global__ void __launch_bounds__(kThreads) quant_mlp_kernel(const __grid_constant__ MlpArgs args) {
  static_assert(kRows <= 32, "lane i forms row i's range");
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ MlpLayer layers[kQuantMlpMaxLayers];
  if (threadIdx.x < args.layers) layers[threadIdx.x] = args.layer[threadIdx.x];
  for (int l = 0; l < args.layers; ++l) {
    const MlpLayer& L = args.layer[l];
    uint32_t* ws = reinterpret_cast<uint32_t*>(smem + L.w_offset);
    if (L.aligned == 2) {
      // Whole 16-code groups (in % 16 == 0, so words = in / 4: no padding): thread i loads group k4 of output o
      // with one 16-byte load and stores its 4 words at (4·k4 + b)·out + o -- consecutive threads, consecutive
      // outputs: no bank conflicts, and a warp's load touches ~half as many cache lines as lanes for in = 64
      // (the word-at-a-time loop below touches one line per lane and word).
      for (int i = threadIdx.x; i < L.words / 4 * L.out; i += kThreads) {
        const int k4 = i / L.out, o = i - k4 * L.out;
        const uint4 v = *reinterpret_cast<const uint4*>(L.w + static_cast<int64_t>(o) * L.in + 16 * k4);
        uint32_t* dst = ws + 4 * k4 * L.out + o;
        dst[0] = v.x;
        dst[L.out] = v.y;
        dst[2 * L.out] = v.z;
        dst[3 * L.out] = v.w;
      }
    } else {
      for (int i = threadIdx.x; i < L.words * L.out; i += kThreads) {
        const int k = i / L.out, o = i - k * L.out;
        const uint8_t* row = L.w + static_cast<int64_t>(o) * L.in;
        uint32_t word = 0;
        if (L.aligned && 4 * k < L.in) {  // whole 4-byte words in global memory: one load
          word = *reinterpret_cast<const uint32_t*>(row + 4 * k);
        } else {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int c = 4 * k + b;
            if (c < L.in) word |= static_cast<uint32_t>(row[c]) << (8 * b);
          }
        }
        ws[i] = word;  // zero past the row: stale activation codes there multiply by 0
      }
    }
    float* params = reinterpret_cast<float*>(smem + L.param_offset);
    double* sums = reinterpret_cast<double*>(smem + L.sums_offset);
    for (int o = threadIdx.x; o < L.out; o += kThreads) {
      params[o] = L.lo[o];
      params[L.out + o] = L.scale[o];
      params[2 * L.out + o] = L.bias ? L.bias[o] : 0.0f;
      sums[o] = static_cast<double>(L.sums[o]);
    }
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The warp's kRows code buffers, codes_stride bytes apart (a multiple of 16: uint4 reads).
  uint8_t* codes = smem + args.codes_offset + warp * kRows * args.codes_stride;
  const int stride = args.codes_stride;
  const int in0 = layers[0].in, out_cols = layers[args.layers - 1].out;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * kRows;
  // r0 is the same on every lane, so is every row's validity: the warp-wide intrinsics below run on the full warp
  // whatever the rows.  Rows past args.rows (the last group only) carry zeros through every layer and store nothing.
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kRows; r0 < args.rows; r0 += step) {
    float h[kRows][kChunks];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const bool valid = r0 + i < args.rows;
      const float* x_row = args.x + (valid ? r0 + i : 0) * in0;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int c = lane + 32 * j;
        h[i][j] = valid && c < in0 ? x_row[c] : 0.0f;
      }
    }
    for (int l = 0; l < args.layers; ++l) {
      const MlpLayer& L = layers[l];
      const int in = L.in, out = L.out;
      const float max_code = L.max_code;
      // Each row's extrema as ordered keys, one warp reduction each.  A NaN makes both NaN, as amin / amax do: a
      // positive NaN keys above +inf and a negative one below -inf, so the reduced keys tell whether a row holds one.
      // Lane i < kRows then forms row i's range (the two IEEE divisions run once for all the rows, not once a row)
      // and every lane reads the rows' ranges back with shuffles.
      float mn = 0.0f, mx = 0.0f;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        unsigned key_min = 0xffffffffu, key_max = 0u;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          if (lane + 32 * j < in) {
            const unsigned key = cuda::ordered_key(h[i][j]);
            key_min = min(key_min, key);
            key_max = max(key_max, key);
          }
        }
        key_min = __reduce_min_sync(kFullMask, key_min);
        key_max = __reduce_max_sync(kFullMask, key_max);
        if (lane == i) {
          const bool nan = key_max > cuda::ordered_key(INFINITY) || key_min < cuda::ordered_key(-INFINITY);
          mn = nan ? __int_as_float(0x7fffffff) : cuda::from_ordered_key(key_min);
          mx = nan ? __int_as_float(0x7fffffff) : cuda::from_ordered_key(key_max);
        }
      }
      const Range own = range_of(mn, mx, max_code);
      // Then each row's codes into its buffer, and their sum.
      float row_lo[kRows], row_scale[kRows];
      unsigned sum[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const Range range{__shfl_sync(kFullMask, own.lo, i), __shfl_sync(kFullMask, own.scale, i),
                          __shfl_sync(kFullMask, own.inv, i)};
        row_lo[i] = range.lo;
        row_scale[i] = range.scale;
        unsigned s = 0;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const int c = lane + 32 * j;
          if (c < in) {
            const uint32_t q = code_of(h[i][j], range, 0.5f, max_code);
            codes[i * stride + c] = static_cast<uint8_t>(q);
            s += q;
          }
        }
        sum[i] = __reduce_add_sync(kFullMask, s);
      }
      __syncwarp();
      // The exact code products of output channels lane, lane + 32, ...: each weight word loaded feeds kRows rows.
      const uint32_t* ws = reinterpret_cast<const uint32_t*>(smem + L.w_offset);
      unsigned acc[kRows][kChunks];
      int o_safe[kChunks];
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        o_safe[j] = min(lane + 32 * j, out - 1);
#pragma unroll
        for (int i = 0; i < kRows; ++i) acc[i][j] = 0;
      }
      for (int k4 = 0; k4 < L.words / 4; ++k4) {
        uint4 a[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) a[i] = reinterpret_cast<const uint4*>(codes + i * stride)[k4];
        const uint32_t* wk = ws + 4 * k4 * out;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          if (32 * j < out) {
            const uint32_t w0 = wk[o_safe[j]], w1 = wk[out + o_safe[j]], w2 = wk[2 * out + o_safe[j]],
                           w3 = wk[3 * out + o_safe[j]];
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
              acc[i][j] = __dp4a(a[i].x, w0, acc[i][j]);
              acc[i][j] = __dp4a(a[i].y, w1, acc[i][j]);
              acc[i][j] = __dp4a(a[i].z, w2, acc[i][j]);
              acc[i][j] = __dp4a(a[i].w, w3, acc[i][j]);
            }
          }
        }
      }
      // bitmm's epilogue; the results stay in registers as the next layer's inputs.
      const float* lo_w = reinterpret_cast<const float*>(smem + L.param_offset);
      const double* sums = reinterpret_cast<const double*>(smem + L.sums_offset);
      const double k = static_cast<double>(in);
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int o = lane + 32 * j;
        if (o < out) {
          const double col_sum = sums[o];
          const float w_lo = lo_w[o], w_scale = lo_w[out + o], bias = lo_w[2 * out + o];
#pragma unroll
          for (int i = 0; i < kRows; ++i) {
            h[i][j] = bitmm_affine_epilogue(static_cast<double>(acc[i][j]), static_cast<double>(sum[i]), col_sum,
                                            row_lo[i], row_scale[i], w_lo, w_scale, k, bias, L.relu != 0);
          }
        } else {
#pragma unroll
          for (int i = 0; i < kRows; ++i) h[i][j] = 0.0f;
        }
      }
      __syncwarp();  // every lane is done reading the codes before the next layer writes them
    }
    // Lane i < kRows reads row i's scale; x · 1 is x for every float32 (NaNs stay NaNs).
    const float own_scale =
        args.row_scale && lane < kRows && r0 + lane < args.rows ? __ldg(args.row_scale + r0 + lane) : 1.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float scale = __shfl_sync(kFullMask, own_scale, i);
      if (r0 + i < args.rows) {
        float* out_row = args.out + (r0 + i) * out_cols;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const int c = lane + 32 * j;
          if (c < out_cols) out_row[c] = __fmul_rn(h[i][j], scale);
        }
      }
    }
  }
}

int align_up(int n, int m) { return (n + m - 1) / m * m; }

}  // namespace

at::Tensor quant_mlp_cuda(const at::Tensor& x_in, at::TensorList weight_codes, at::TensorList weight_lo,
                          at::TensorList weight_scale, at::TensorList weight_sums,
                          const c10::List<std::optional<at::Tensor>>& bias, at::IntArrayRef act_bits,
                          at::IntArrayRef weight_bits, const c10::List<bool>& relu,
                          const std::optional<at::Tensor>& row_scale) {
  const std::vector<int64_t> widths = check_quant_mlp_args(x_in, weight_codes, weight_lo, weight_scale, weight_sums,
                                                           bias, act_bits, weight_bits, relu, row_scale);
  const int64_t layers = static_cast<int64_t>(weight_codes.size());
  TORCH_CHECK_VALUE(layers <= kQuantMlpMaxLayers, "weight_codes: the CUDA kernel takes at most ",
                    kQuantMlpMaxLayers, " layers, got ", layers);
  for (int64_t l = 0; l <= layers; ++l) {
    TORCH_CHECK_VALUE(widths[l] <= kQuantMlpMaxWidth, l == 0 ? "x" : "weight_codes", l == 0 ? "" : "[",
                      l == 0 ? "" : std::to_string(l - 1), l == 0 ? "" : "]", ": the CUDA kernel takes widths up to ",
                      kQuantMlpMaxWidth, ", got ", widths[l]);
  }
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, widths.back()}, x.options());

  std::vector<at::Tensor> keep;  // no-ops for contiguous inputs (what the callers pass)
  MlpArgs args{};
  args.layers = static_cast<int>(layers);
  int offset = 0, max_width = 0;
  for (int64_t l = 0; l < layers; ++l) {
    MlpLayer& L = args.layer[l];
    keep.push_back(weight_codes[l].contiguous());
    L.w = keep.back().data_ptr<uint8_t>();
    keep.push_back(weight_lo[l].contiguous());
    L.lo = keep.back().data_ptr<float>();
    keep.push_back(weight_scale[l].contiguous());
    L.scale = keep.back().data_ptr<float>();
    keep.push_back(weight_sums[l].contiguous());
    L.sums = keep.back().data_ptr<int64_t>();
    const std::optional<at::Tensor> b = bias.get(l);
    if (b.has_value()) {
      keep.push_back(b->contiguous());
      L.bias = keep.back().data_ptr<float>();
    }
    L.in = static_cast<int>(widths[l]);
    L.out = static_cast<int>(widths[l + 1]);
    L.words = align_up((L.in + 3) / 4, 4);
    const uintptr_t w_address = reinterpret_cast<uintptr_t>(L.w);
    L.aligned = L.in % 16 == 0 && w_address % 16 == 0 ? 2 : L.in % 4 == 0 && w_address % 4 == 0 ? 1 : 0;
    L.max_code = static_cast<float>((1 << act_bits[l]) - 1);
    L.relu = relu.get(l) ? 1 : 0;
    L.w_offset = offset;
    offset += L.words * L.out * 4;
    L.param_offset = offset;
    offset = align_up(offset + 3 * L.out * 4, 8);
    L.sums_offset = offset;
    offset += L.out * 8;
    max_width = std::max(max_width, std::max(L.in, L.out));
  }
  // The kernel's instantiation: values per lane, and rows per warp (kRows code buffers per warp).
  const int chunks = max_width <= 32 ? 1 : max_width <= 64 ? 2 : max_width <= 128 ? 4 : 8;
  const int rows_per = rows_per_warp(chunks);
  args.codes_offset = align_up(offset, 16);
  args.codes_stride = align_up(max_width, 16);
  const int smem = args.codes_offset + kWarps * rows_per * args.codes_stride;
  args.x = x.data_ptr<float>();
  args.out = out.data_ptr<float>();
  if (row_scale.has_value()) {
    keep.push_back(row_scale->contiguous());
    args.row_scale = keep.back().data_ptr<float>();
  }
  args.rows = rows;
  if (rows == 0) return out;

  const int device = x.device().index();
  const int smem_optin = cuda::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  TORCH_CHECK_VALUE(smem + static_cast<int>(sizeof(MlpLayer)) * kQuantMlpMaxLayers <= smem_optin,
                    "weight_codes: the layers' codes need ", smem, " bytes of shared memory, more than the ",
                    smem_optin, " this GPU gives a block");
  const auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    const int64_t resident = static_cast<int64_t>(cuda::sm_count(device)) *
                             cuda::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem, device);
    const int64_t rows_per_block = static_cast<int64_t>(kWarps) * rows_per;
    const int64_t blocks = std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, resident);
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (chunks == 1) {
    launch(quant_mlp_kernel<1, rows_per_warp(1)>);
  } else if (chunks == 2) {
    launch(quant_mlp_kernel<2, rows_per_warp(2)>);
  } else if (chunks == 4) {
    launch(quant_mlp_kernel<4, rows_per_warp(4)>);
  } else {
    launch(quant_mlp_kernel<8, rows_per_warp(8)>);
  }
  return out;
}

}  // namespace pyg_quant
