// Backend kernels of fake_quantize and mse_range (pyg_quant.qat's quantizers and range search).
#include <torch/library.h>

#include "cpu/fake_quantize_cpu.h"
#ifdef WITH_CUDA
#include "cuda/fake_quantize_cuda.h"
#endif

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  m.impl("fake_quantize", &pyg_quant::fake_quantize_cpu);
  m.impl("mse_range", &pyg_quant::mse_range_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("fake_quantize", &pyg_quant::fake_quantize_cuda);
  m.impl("mse_range", &pyg_quant::mse_range_cuda);
}
#endif
