// Backend kernels of quantize_pack, quantize_pack_ranges, unpack_codes, dequantize, packed_code_sums,
// pack_row_codes and planes_from_row_codes.
#include <torch/library.h>

#include "cpu/quantize_cpu.h"
#ifdef WITH_CUDA
#include "cuda/quantize_cuda.h"
#endif

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) {
  m.impl("quantize_pack", &pyg_quant::quantize_pack_cpu);
  m.impl("unpack_codes", &pyg_quant::unpack_codes_cpu);
  m.impl("dequantize", &pyg_quant::dequantize_cpu);
  m.impl("packed_code_sums", &pyg_quant::packed_code_sums_cpu);
  m.impl("pack_row_codes", &pyg_quant::pack_row_codes_cpu);
  m.impl("planes_from_row_codes", &pyg_quant::planes_from_row_codes_cpu);
  m.impl("quantize_pack_ranges", &pyg_quant::quantize_pack_ranges_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_quant, CUDA, m) {
  m.impl("quantize_pack", &pyg_quant::quantize_pack_cuda);
  m.impl("unpack_codes", &pyg_quant::unpack_codes_cuda);
  m.impl("dequantize", &pyg_quant::dequantize_cuda);
  m.impl("packed_code_sums", &pyg_quant::packed_code_sums_cuda);
  m.impl("pack_row_codes", &pyg_quant::pack_row_codes_cuda);
  m.impl("planes_from_row_codes", &pyg_quant::planes_from_row_codes_cuda);
  m.impl("quantize_pack_ranges", &pyg_quant::quantize_pack_ranges_cuda);
}
#endif
