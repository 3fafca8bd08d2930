// Backend kernels of bitmm_int and bitmm_affine.
#include <torch/library.h>

#include "cpu/bitmm_cpu.h"
#ifdef WITH_CUDA
#include "cuda/bitmm_cuda.h"
#endif

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  m.impl("bitmm_int", &pyg_quant::bitmm_int_cpu);
  m.impl("bitmm_affine", &pyg_quant::bitmm_affine_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("bitmm_int", &pyg_quant::bitmm_int_cuda);
  m.impl("bitmm_affine", &pyg_quant::bitmm_affine_cuda);
}
#endif
