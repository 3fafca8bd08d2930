// Tensor maps (TMA descriptors) of bit planes, encoded through the driver entry point the runtime already loaded.
#include "tensor_map.h"

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pyg_quant {
namespace cuda {
namespace {

// cuTensorMapEncodeTiled from the driver the runtime already loaded (no link against libcuda); null when the
// driver lacks it.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &entry, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky; keep it from surfacing at the next check
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiledFn>(entry)
                                                                      : nullptr;
  }();
  return fn;
}

}  // namespace

bool encode_planes(CUtensorMap* map, const at::Tensor& planes, int box_words, int box_rows, int box_planes) {
  const EncodeTiledFn encode = encode_tiled();
  // The TMA reads from a 16-byte aligned base only (a view one element into its storage is not).
  if (encode == nullptr || reinterpret_cast<uintptr_t>(planes.data_ptr()) % 16 != 0) return false;
  const cuuint64_t words = planes.size(2), outer = planes.size(1);
  const cuuint64_t dims[3] = {words, outer, static_cast<cuuint64_t>(planes.size(0))};
  const cuuint64_t strides[2] = {words * 4, outer * words * 4};  // bytes, of dims 1 and 2
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_words), static_cast<cuuint32_t>(box_rows),
                            static_cast<cuuint32_t>(box_planes)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapSwizzle swizzle = box_words == 32   ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : box_words == 16 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                       : CU_TENSOR_MAP_SWIZZLE_32B;
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_INT32, 3, planes.data_ptr(), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;  // FILL_NONE: zeros outside the tensor
}

}  // namespace cuda
}  // namespace pyg_quant
