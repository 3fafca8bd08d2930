#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "spmm_gather.cuh"

namespace pyg_quant {
namespace cuda {

// bit_spmm on the wgmma tensor cores (spmm_wgmma_cuda.cu): runs it with `args` (its tile and residual pointers,
// epilogue and out_float filled in as for the other kernels) and returns true, or returns false (nothing launched)
// where it does not apply: not sm_90 with the sm_90a image, a multi-bit adjacency, no tiles, no
// cuTensorMapEncodeTiled, operands off 16-byte boundaries or past the tensor maps' int32 coordinates.  int32 sums
// only (the caller checked that they cannot overflow).
bool bit_spmm_wgmma(const at::Tensor& tile_bits, const at::Tensor& x_planes, const SpmmArgs& args, int32_t* out_int);

}  // namespace cuda
}  // namespace pyg_quant
