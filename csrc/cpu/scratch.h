#pragma once
// Scratch memory for one kernel call on the CPU, carved in 64-byte aligned pieces.  Up to kKeptScratchBytes it is kept
// by the calling thread between calls: a fresh allocation of a few MB a call is fresh pages from the kernel, whose
// first touch costs as much as a small batch's whole product.  Larger requests, and a Scratch made while another is
// alive on the same thread, get memory of their own for the call.
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace pyg_quant {

constexpr int64_t kKeptScratchBytes = int64_t{16} << 20;

class Scratch {
 public:
  explicit Scratch(int64_t bytes) : size_(bytes) {
    if (bytes <= kKeptScratchBytes && !kept_in_use()) {
      std::vector<uint8_t>& kept = kept_buffer();
      if (static_cast<int64_t>(kept.size()) < bytes) kept.resize(bytes);
      base_ = kept.data();
      kept_in_use() = holds_kept_ = true;
    } else {
      own_.resize(bytes);
      base_ = own_.data();
    }
  }
  ~Scratch() {
    if (holds_kept_) kept_in_use() = false;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // `count` values of T, 64-byte aligned from the buffer's start.
  template <typename T>
  T* take(int64_t count) {
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += (count * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
    TORCH_INTERNAL_ASSERT(used_ <= size_, "Scratch: ", used_, " bytes taken of ", size_);
    return p;
  }

 private:
  static std::vector<uint8_t>& kept_buffer() {
    thread_local std::vector<uint8_t> buffer;
    return buffer;
  }
  static bool& kept_in_use() {
    thread_local bool in_use = false;
    return in_use;
  }

  uint8_t* base_ = nullptr;
  int64_t size_ = 0, used_ = 0;
  bool holds_kept_ = false;
  std::vector<uint8_t> own_;
};

}  // namespace pyg_quant
