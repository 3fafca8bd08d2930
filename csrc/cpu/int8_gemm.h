#pragma once
// The int32 product of two operands' codes held one a byte, the step the CPU kernels' int8 paths share (bitmm_int's
// unpacked planes, quant_mlp's rows against a layer's weight codes).
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pyg_quant {

// out[i, j] = Σ_k a[i, k] · w[j, k] in int32 (wrapping as int32 adds do), a: n rows of `k` bytes (`lda` apart), w:
// `cols` rows of `k` bytes (`ldw` apart), out: int32 [n, cols] contiguous.  An operand's codes of up to 7 bits are
// its bytes as they are (0 .. 2^bits − 1); 8-bit codes come less 128 (int8), as torch's int8 GEMM takes them.
void int8_gemm(const at::Tensor& out, const int8_t* a, int64_t lda, int64_t n, int64_t a_bits, const int8_t* w,
               int64_t ldw, int64_t cols, int64_t w_bits, int64_t k);

// Whether int8_gemm runs its own AVX2 kernel here (a CPU with AVX2 and without AVX-512 VNNI, where torch's int8 GEMM
// is a scalar loop); elsewhere it is torch's (oneDNN).
bool int8_gemm_own_kernel();

}  // namespace pyg_quant
