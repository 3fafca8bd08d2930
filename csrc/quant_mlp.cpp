// Backend kernels of quant_mlp (a chain of QuantLinear bit layers in one op).  CUDA tensors run the composition of
// verified kernels (pyg_quant/ops/reference.py) until the CUDA kernel in dev/pending-gpu has run on a GPU.
#include <torch/library.h>

#include "cpu/quant_mlp_cpu.h"

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) { m.impl("quant_mlp", &pyg_quant::quant_mlp_cpu); }
