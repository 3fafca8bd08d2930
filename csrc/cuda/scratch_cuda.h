#pragma once
// Device memory for the steps of one composed op (csrc/conv_eval.h), taken from a single allocation.  A quantized
// layer's eager forward on a GPU is bound by host time, and every caching-allocator call costs about as much host
// time as a kernel launch; while a ScratchScope is open on a thread, the package's CUDA kernels take their outputs
// from its block (cuda_empty) instead.  Tensors taken from it share one storage, which lives while any of them
// does, so a composed op opens the scope only around the tensors it does not hand back.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <initializer_list>

namespace pyg_quant {

// Piece alignment within a block: the caching allocator's own, so a piece is as aligned as a fresh allocation
// (vector loads, TMA descriptors).
constexpr int64_t kScratchAlignBytes = 512;

// Bytes a block needs for pieces of these sizes (bytes each).
inline int64_t scratch_bytes(std::initializer_list<int64_t> pieces) {
  int64_t total = 0;
  for (const int64_t bytes : pieces) total += (bytes + kScratchAlignBytes - 1) / kScratchAlignBytes * kScratchAlignBytes;
  return total;
}

class ScratchScope {
 public:
  // One block of `bytes` on options' device (none when bytes is 0); pieces that do not fit are allocated apart.
  ScratchScope(int64_t bytes, const c10::TensorOptions& options);
  ~ScratchScope();
  ScratchScope(const ScratchScope&) = delete;
  ScratchScope& operator=(const ScratchScope&) = delete;

  // A contiguous tensor from the block; an undefined tensor when it does not fit (or the block is on another device).
  at::Tensor take(at::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device);

 private:
  at::Tensor block_;
  int64_t used_ = 0;
  ScratchScope* outer_;
};

// at::empty(sizes, options) on a CUDA device, from the innermost open ScratchScope of this thread where it fits.
at::Tensor cuda_empty(at::IntArrayRef sizes, const c10::TensorOptions& options);

}  // namespace pyg_quant
