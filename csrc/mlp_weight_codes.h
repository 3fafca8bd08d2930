#pragma once
// mlp_weight_codes: the weight operands quant_mlp takes for a chain of linear layers, in one op.  Each weight
// W [out, in] is quantized per output row over its own range, rounded to nearest (to_bit's float32 steps,
// csrc/quantize_steps.h), and its codes given as bytes: the same codes, ranges and sums as
// pyg_quant.nn.quant_linear.fused_codes of the packed weight, for one dispatch instead of three ops a layer (what a
// traced graph re-runs at every call).  The CPU composes quantize_pack_ranges and unpack_codes (mlp_weight_codes
// below, registered in library.cpp); CUDA has a kernel of its own (cuda/mlp_weight_codes_cuda.cu).
#include <ATen/core/Tensor.h>

#include <vector>

#include "conv_eval.h"  // RangesKernel
#include "mlp_weight_codes_args.h"

namespace pyg_quant {

using UnpackKernel = at::Tensor (*)(const at::Tensor&, int64_t, int64_t, bool);

// [codes uint8 [out, in], lo float32 [out], scale float32 [out], code sums int64 [out]] for each weight in turn.
template <RangesKernel Ranges, UnpackKernel Unpack>
std::vector<at::Tensor> mlp_weight_codes(at::TensorList weights, at::IntArrayRef bits) {
  check_mlp_weight_codes_args(weights, bits);
  std::vector<at::Tensor> out;
  out.reserve(4 * weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const int64_t rows = w.size(0), cols = w.size(1);
    auto [planes, lo, scale, sums, row_codes] =
        Ranges(w.to(at::kFloat).contiguous(), bits[i], /*dim=*/1, /*col_layout=*/false, std::nullopt,
               /*row_codes=*/false, std::nullopt, /*code_sums=*/true);
    out.push_back(Unpack(planes, rows, cols, false));
    out.push_back(lo.contiguous());
    out.push_back(scale.contiguous());
    out.push_back(sums.narrow(0, 0, rows).contiguous());
  }
  return out;
}

}  // namespace pyg_quant
