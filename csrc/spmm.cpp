// Backend kernels of bit_spmm_int.
#include <torch/library.h>

#include "cpu/spmm_cpu.h"
#ifdef WITH_CUDA
#include "cuda/spmm_cuda.h"
#endif

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) { m.impl("bit_spmm_int", &pyg_quant::bit_spmm_int_cpu); }

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) { m.impl("bit_spmm_int", &pyg_quant::bit_spmm_int_cuda); }
#endif
