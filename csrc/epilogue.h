#pragma once
// The float epilogues of the bit kernels, written once for the CPU and the GPU.
//
// They run in float32: the integer products and code sums are exact, each is converted to float32 (to nearest), and
// the affine terms are multiplied and added in the order written here.  Each output is then within
//   8 · 2^-24 · (the sum of the magnitudes of the terms it adds)
// of the exact value (at most six float32 roundings lie on any term's way to the result), which
// tests/test_epilogue_bound.py checks against float64.  Both compilers run with contraction off
// (-ffp-contract=off, -fmad=false) and pyg_quant/ops/reference.py makes the same operations in torch, so the CPU,
// the GPU and the reference give the same bits.
#include "macros.h"

namespace pyg_quant {

// relu?( row_scale · (lo·row_sum + scale·product + self_weight·x_self) + bias ), where
// x_self = lo + scale·self_code is formed exactly as to_val forms it, so that an empty A
// with self loops returns to_val(x) itself.  product and row_sum are the exact integers
// converted to float32; a missing row scale is 1 (v·1 is v).
PYG_QUANT_HOST_DEVICE float affine_epilogue(float product, float lo, float scale, float row_sum,
                                                   float self_weight, float self_code, float row_scale, float bias,
                                                   bool relu) {
  float v = lo * row_sum + scale * product;
  const float self_value = lo + scale * self_code;
  v = v + self_weight * self_value;
  v = v * row_scale + bias;
  return relu && v <= 0.0f ? 0.0f : v;  // a NaN passes, as torch.relu lets it
}

// bitmm's affine correction of the code product P_ij (A scaled per row by la, ra; B per column by lb, rb):
//   K·la·lb + la·rb·colsum_j + ra·lb·rowsum_i + ra·rb·P_ij  =  la·c_j + ra·(lb·rowsum_i + rb·P_ij)
// with the column's term c_j = K·lb + rb·colsum_j (bitmm_col_term, made once a column), then + bias.
PYG_QUANT_HOST_DEVICE float bitmm_col_term(float k, float b_lo, float b_scale, float col_sum) {
  return k * b_lo + b_scale * col_sum;
}

PYG_QUANT_HOST_DEVICE float bitmm_affine_epilogue(float product, float row_sum, float col_term, float a_lo,
                                                         float a_scale, float b_lo, float b_scale, float bias,
                                                         bool relu) {
  const float v = a_lo * col_term + a_scale * (b_lo * row_sum + b_scale * product);
  const float f = v + bias;
  return relu && f <= 0.0f ? 0.0f : f;  // a NaN passes, as torch.relu lets it
}

}  // namespace pyg_quant
