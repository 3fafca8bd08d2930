#pragma once
#include <ATen/core/Tensor.h>
#include <cuda.h>  // CUtensorMap (the header needs no libcuda)

namespace pyg_quant {
namespace cuda {

// planes [count, outer, words] int32 (contiguous, words a multiple of 4) as a 3-D tensor map (words
// innermost), boxes of box_words x box_rows x box_planes (a box lands plane after plane, row after row), swizzled
// across the box's row (box_words * 4 = 32, 64 or 128 bytes); elements outside the tensor are read as zeros.  false
// when the driver has no cuTensorMapEncodeTiled, the planes do not start on a 16-byte boundary or the driver
// rejects the shape (callers then run a kernel without the TMA).
bool encode_planes(CUtensorMap* map, const at::Tensor& planes, int box_words, int box_rows, int box_planes = 1);

}  // namespace cuda
}  // namespace pyg_quant
