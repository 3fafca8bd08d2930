#pragma once
// The float epilogue of bit_spmm_affine, written once for the CPU and the GPU.
// Everything is in float64 and rounded to float32 once at the end, so the result
// is the exact value up to float32 rounding (the int64/int32 product and the
// codes are exact in float64 below 2^53).  Both compilers run with contraction
// off (-ffp-contract=off, -fmad=false), so the two backends agree bit for bit.
#include <cmath>

#include "macros.h"

namespace pyg_quant {

// relu?( row_scale · (lo·row_sum + scale·product + self_weight·x_self) + bias ), where
// x_self = lo + scale·self_code is formed in float32 exactly as to_val forms it, so
// that an empty A with self loops returns to_val(x) itself.
PYG_QUANT_HOST_DEVICE float affine_epilogue(double product, float lo, float scale, double row_sum,
                                            double self_weight, float self_code, double row_scale, double bias,
                                            bool relu) {
  double v = static_cast<double>(lo) * row_sum + static_cast<double>(scale) * product;
  const float self_value = lo + scale * self_code;
  v = v + self_weight * static_cast<double>(self_value);
  v = v * row_scale + bias;
  const float f = static_cast<float>(v);
  return relu && f <= 0.0f ? 0.0f : f;  // a NaN passes, as torch.relu lets it
}

// bitmm's affine correction of the code product P_ij (A scaled per row, B per column):
//   K·la·lb + la·rb·colsum_j + ra·lb·rowsum_i + (ra·rb)·P_ij
// in float64, in exactly this order (pyg_quant/ops/reference.py evaluates the same
// expression), rounded to float32 once; the bias is then added in float32, as an
// unfused `out + bias` would.
PYG_QUANT_HOST_DEVICE float bitmm_affine_epilogue(double product, double row_sum, double col_sum, float a_lo,
                                                  float a_scale, float b_lo, float b_scale, double k, float bias,
                                                  bool relu) {
  const double la = a_lo, ra = a_scale, lb = b_lo, rb = b_scale;
  const double v = k * la * lb + la * rb * col_sum + ra * lb * row_sum + (ra * rb) * product;
  const float f = static_cast<float>(v) + bias;
  return relu && f <= 0.0f ? 0.0f : f;  // a NaN passes, as torch.relu lets it
}

}  // namespace pyg_quant
