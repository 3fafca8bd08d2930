// Backend kernels of quant_mlp (a chain of QuantLinear bit layers in one op).
#include <torch/library.h>

#include "cpu/quant_mlp_cpu.h"
#ifdef WITH_CUDA
#include "cuda/quant_mlp_cuda.h"
#endif

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  m.impl("quant_mlp", &pyg_quant::quant_mlp_cpu);
  m.impl("quant_mlp_planes", &pyg_quant::quant_mlp_planes_cpu);
  m.impl("quant_mlp_row_codes", &pyg_quant::quant_mlp_row_codes_cpu);
  m.impl("quant_mlp_planes_row_codes", &pyg_quant::quant_mlp_planes_row_codes_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("quant_mlp", &pyg_quant::quant_mlp_cuda);
  m.impl("quant_mlp_planes", &pyg_quant::quant_mlp_planes_cuda);
  m.impl("quant_mlp_row_codes", &pyg_quant::quant_mlp_row_codes_cuda);
  m.impl("quant_mlp_planes_row_codes", &pyg_quant::quant_mlp_planes_row_codes_cuda);
}
#endif
