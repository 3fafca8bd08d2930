// Backend kernels of bit_spmm_int and bit_spmm_affine.
#include <torch/library.h>

#include "cpu/spmm_cpu.h"
#ifdef WITH_CUDA
#include "cuda/spmm_cuda.h"
#endif

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  m.impl("bit_spmm_int", &pyg_quant::bit_spmm_int_cpu);
  m.impl("bit_spmm_affine", &pyg_quant::bit_spmm_affine_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("bit_spmm_int", &pyg_quant::bit_spmm_int_cuda);
  m.impl("bit_spmm_affine", &pyg_quant::bit_spmm_affine_cuda);
}
#endif
