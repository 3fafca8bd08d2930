#pragma once
#include <cstdint>

namespace pyg_quant {

// Bits of a packed operand, read two 32-bit layout words at a time (see
// pyg_quant/layout.py: bit k of word w is element 32w+k, so a little-endian
// uint64 keeps element order).
inline int popcount64(uint64_t v) { return __builtin_popcountll(v); }

inline const uint64_t* as_u64(const int32_t* words) {
  return reinterpret_cast<const uint64_t*>(words);
}

}  // namespace pyg_quant
