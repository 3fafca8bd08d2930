// Backend kernels of expand_tiles and expand_csr (CompactAdjacency -> BitAdjacency tensors).
#include <torch/library.h>

#include "cpu/expand_cpu.h"
#ifdef WITH_CUDA
#include "cuda/expand_cuda.h"
#endif

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  m.impl("expand_tiles", &pyg_quant::expand_tiles_cpu);
  m.impl("expand_csr", &pyg_quant::expand_csr_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("expand_tiles", &pyg_quant::expand_tiles_cuda);
  m.impl("expand_csr", &pyg_quant::expand_csr_cuda);
}
#endif
