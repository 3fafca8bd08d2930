#include "scratch_cuda.h"

#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>

#include <utility>

namespace pyg_quant {

namespace {

ScratchScope*& open_scope() {
  thread_local ScratchScope* scope = nullptr;
  return scope;
}

}  // namespace

ScratchScope::ScratchScope(int64_t bytes, const c10::TensorOptions& options) : outer_(open_scope()) {
  if (bytes > 0) block_ = at::empty({bytes}, options.dtype(at::kByte));
  open_scope() = this;
}

ScratchScope::~ScratchScope() { open_scope() = outer_; }

at::Tensor ScratchScope::take(at::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) {
  if (!block_.defined() || block_.device() != device) return at::Tensor();
  int64_t numel = 1;
  for (const int64_t size : sizes) numel *= size;
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t bytes = (numel * item + kScratchAlignBytes - 1) / kScratchAlignBytes * kScratchAlignBytes;
  if (used_ + bytes > block_.numel()) return at::Tensor();
  // A tensor of the block's storage at this offset: what a view is, without the dispatcher's view machinery.
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(block_.storage()),
                                                   c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_storage_offset(used_ / item);
  impl->set_sizes_contiguous(sizes);
  used_ += bytes;
  return at::Tensor(std::move(impl));
}

at::Tensor cuda_empty(at::IntArrayRef sizes, const c10::TensorOptions& options) {
  if (ScratchScope* scope = open_scope()) {
    at::Tensor piece = scope->take(sizes, c10::typeMetaToScalarType(options.dtype()), options.device());
    if (piece.defined()) return piece;
  }
  return at::empty(sizes, options);
}

}  // namespace pyg_quant
