#pragma once
// Per-device launch limits, queried once per (device, kernel) and cached: the queries cost microseconds of host
// time each, and the layers launch these kernels several times a batch.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace pyg_quant {
namespace cuda {

// cudaDeviceGetAttribute(attribute, device), read once.
inline int device_attribute(cudaDeviceAttr attribute, int device) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(static_cast<int>(attribute), device);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
    it = cache.emplace(key, value).first;
  }
  return it->second;
}

inline int sm_count(int device) { return device_attribute(cudaDevAttrMultiProcessorCount, device); }

// Blocks of `kernel` one SM holds at once (at least 1), for `threads` threads and `smem` bytes of dynamic shared
// memory a block.  The kernel's dynamic shared memory limit must already be set when `smem` needs it.
inline int resident_blocks_per_sm(const void* kernel, int threads, size_t smem, int device) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, threads, smem, device);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    it = cache.emplace(key, per_sm < 1 ? 1 : per_sm).first;
  }
  return it->second;
}

}  // namespace cuda
}  // namespace pyg_quant
