// Quantize + pack, unpack and code sums on the CPU, in the layout of
// pyg_quant/layout.py.  Codes follow the float32 recipe written there step by
// step (no FMA contraction: setup.py passes -ffp-contract=off) so that every
// backend produces the same codes.
#include "quantize_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "popcount.h"

namespace pyg_quant {
namespace {

constexpr int64_t kOuterAlign = 64;
constexpr int64_t kPackAlignWords = 8;

int64_t round_up(int64_t n, int64_t m) { return (std::max<int64_t>(n, 1) + m - 1) / m * m; }
int64_t packed_words(int64_t n) { return round_up(n, kPackAlignWords * 32) / 32; }

// Reads x, lo, inv_scale and noise (lo/inv_scale broadcast to x's shape through
// zero strides) and returns codes in [0, max_code].
struct CodeReader {
  const float* x;
  const float* lo;
  const float* inv;
  const float* noise;
  int64_t cols, lo_rs, lo_cs, inv_rs, inv_cs;
  float max_code;

  inline uint32_t operator()(int64_t r, int64_t c) const {
    const float v = (x[r * cols + c] - lo[r * lo_rs + c * lo_cs]) * inv[r * inv_rs + c * inv_cs];
    const float u = noise ? noise[r * cols + c] : 0.5f;
    const float t = std::floor(v + u);
    return static_cast<uint32_t>(std::min(std::max(t, 0.0f), max_code));
  }
};

int64_t broadcast_stride(const at::Tensor& t, int64_t dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

}  // namespace

at::Tensor quantize_pack_cpu(const at::Tensor& x_in, const at::Tensor& lo_in, const at::Tensor& inv_in,
                             int64_t bits, bool col_layout, const std::optional<at::Tensor>& noise_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 8, "bits must be in 1..8, got ", bits);
  TORCH_CHECK_VALUE(lo_in.dim() == 2 && inv_in.dim() == 2, "lo and inv_scale must be 2-D (broadcastable to x)");
  const auto x = x_in.contiguous();
  const auto lo = lo_in.to(at::kFloat);
  const auto inv = inv_in.to(at::kFloat);
  const int64_t rows = x.size(0), cols = x.size(1);
  for (const auto* t : {&lo, &inv}) {
    TORCH_CHECK_VALUE((t->size(0) == 1 || t->size(0) == rows) && (t->size(1) == 1 || t->size(1) == cols),
                      "lo and inv_scale must broadcast to x's shape");
  }
  at::Tensor noise;
  if (noise_in.has_value()) {
    noise = noise_in->contiguous();
    TORCH_CHECK_VALUE(noise.sizes() == x.sizes() && noise.scalar_type() == at::kFloat,
                      "noise must be float32 with x's shape");
  }
  const CodeReader code{x.data_ptr<float>(), lo.data_ptr<float>(), inv.data_ptr<float>(),
                        noise.defined() ? noise.data_ptr<float>() : nullptr,
                        cols, broadcast_stride(lo, 0), broadcast_stride(lo, 1),
                        broadcast_stride(inv, 0), broadcast_stride(inv, 1),
                        static_cast<float>((1 << bits) - 1)};

  const int64_t outer = col_layout ? cols : rows;
  const int64_t packed = col_layout ? rows : cols;
  const int64_t words = packed_words(packed);
  auto planes = at::zeros({bits, round_up(outer, kOuterAlign), words}, x.options().dtype(at::kInt));
  uint32_t* out = reinterpret_cast<uint32_t*>(planes.data_ptr<int32_t>());
  const int64_t plane_stride = planes.stride(0);

  if (!col_layout) {
    // One row at a time: its codes become one bit vector per plane.
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t w = 0; w * 32 < cols; ++w) {
          uint32_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          const int64_t n = std::min<int64_t>(32, cols - w * 32);
          for (int64_t k = 0; k < n; ++k) {
            const uint32_t q = code(r, w * 32 + k);
            for (int64_t p = 0; p < bits; ++p) acc[p] |= ((q >> p) & 1u) << k;
          }
          for (int64_t p = 0; p < bits; ++p) out[p * plane_stride + r * words + w] = acc[p];
        }
      }
    });
  } else {
    // 32 rows at a time (one word of every column), reading x row-major.
    at::parallel_for(0, (rows + 31) / 32, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint32_t> acc(bits * cols);
      for (int64_t w = begin; w < end; ++w) {
        std::fill(acc.begin(), acc.end(), 0u);
        const int64_t n = std::min<int64_t>(32, rows - w * 32);
        for (int64_t k = 0; k < n; ++k) {
          for (int64_t c = 0; c < cols; ++c) {
            const uint32_t q = code(w * 32 + k, c);
            for (int64_t p = 0; p < bits; ++p) acc[p * cols + c] |= ((q >> p) & 1u) << k;
          }
        }
        for (int64_t p = 0; p < bits; ++p)
          for (int64_t c = 0; c < cols; ++c) out[p * plane_stride + c * words + w] = acc[p * cols + c];
      }
    });
  }
  return planes;
}

at::Tensor unpack_codes_cpu(const at::Tensor& planes_in, int64_t rows, int64_t cols, bool col_layout) {
  TORCH_CHECK_VALUE(planes_in.dim() == 3 && planes_in.scalar_type() == at::kInt, "planes must be int32[bits, outer, words]");
  const auto planes = planes_in.contiguous();
  const int64_t bits = planes.size(0), words = planes.size(2);
  TORCH_CHECK_VALUE(planes.size(1) >= (col_layout ? cols : rows) && words * 32 >= (col_layout ? rows : cols),
                    "rows/cols exceed the planes' padded shape");
  auto codes = at::empty({rows, cols}, planes.options().dtype(at::kByte));
  const uint32_t* in = reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>());
  uint8_t* out = codes.data_ptr<uint8_t>();
  const int64_t plane_stride = planes.stride(0);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t o = col_layout ? c : r, e = col_layout ? r : c;
        const uint32_t* word = in + o * words + (e >> 5);
        uint32_t q = 0;
        for (int64_t p = 0; p < bits; ++p) q |= ((word[p * plane_stride] >> (e & 31)) & 1u) << p;
        out[r * cols + c] = static_cast<uint8_t>(q);
      }
    }
  });
  return codes;
}

at::Tensor packed_code_sums_cpu(const at::Tensor& planes_in) {
  TORCH_CHECK_VALUE(planes_in.dim() == 3 && planes_in.scalar_type() == at::kInt, "planes must be int32[bits, outer, words]");
  TORCH_CHECK_VALUE(planes_in.size(2) % 2 == 0, "planes must have an even number of words");
  const auto planes = planes_in.contiguous();
  const int64_t bits = planes.size(0), outer = planes.size(1), words64 = planes.size(2) / 2;
  auto sums = at::empty({outer}, planes.options().dtype(at::kLong));
  const int32_t* in = planes.data_ptr<int32_t>();
  int64_t* out = sums.data_ptr<int64_t>();
  at::parallel_for(0, outer, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      int64_t total = 0;
      for (int64_t p = 0; p < bits; ++p) {
        const uint64_t* v = as_u64(in + (p * outer + o) * words64 * 2);
        int64_t count = 0;
        for (int64_t w = 0; w < words64; ++w) count += popcount64(v[w]);
        total += count << p;
      }
      out[o] = total;
    }
  });
  return sums;
}

}  // namespace pyg_quant
