#pragma once
// Runtime choice of the CPU kernels' instruction set.  The package is built for generic x86-64 (no -march), so
// kernels that use AVX-512 or AVX2 are compiled with target attributes and only called when the running CPU has those
// features; every path computes the same exact integers, so the choice never changes a result.
// PYG_QUANT_CPU_ISA=generic forces the portable kernels, PYG_QUANT_CPU_ISA=avx2 the AVX2 ones where the CPU has
// AVX-512 (to test them there).
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PYG_QUANT_X86_DISPATCH 1
#include <immintrin.h>
#if !defined(__clang__)
// GCC 12 reports its own AVX-512 intrinsics (their _mm512_undefined_* idiom, in the reductions among others) as
// (maybe-)uninitialized where they are inlined: a false positive, silenced in the files that use them.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
// The AVX-512 subset our vector kernels use: byte/word ops (BW), 512-bit VNNI (vpdpbusd) and the 256-bit forms (VL).
#define PYG_QUANT_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
// AVX2 (with SSSE3's vpmaddubsw): the int8 products and the bit-plane unpacking on CPUs without AVX-512.
#define PYG_QUANT_TARGET_AVX2 __attribute__((target("avx2")))
// ... and DQ, for int64 -> float32 conversions.
#define PYG_QUANT_TARGET_AVX512_DQ __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))
#endif

namespace pyg_quant {

inline bool isa_forced_generic() {
  const char* isa = std::getenv("PYG_QUANT_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, "generic") == 0;
}

// PYG_QUANT_CPU_ISA=avx2 keeps the AVX-512 kernels off (to test the AVX2 ones on a machine that has AVX-512).
inline bool isa_capped_avx2() {
  const char* isa = std::getenv("PYG_QUANT_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, "avx2") == 0;
}

// Whether the AVX-512 kernels may run: F, BW, VL and VNNI present, and not forced off.
inline bool cpu_has_avx512_vnni() {
#if defined(PYG_QUANT_X86_DISPATCH)
  static const bool has = !isa_forced_generic() && !isa_capped_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

// Whether the AVX2 kernels may run: AVX2 present, and not forced off.
inline bool cpu_has_avx2() {
#if defined(PYG_QUANT_X86_DISPATCH)
  static const bool has = !isa_forced_generic() && __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

// Whether the AVX-512 popcount kernels may run (VPOPCNTDQ).
inline bool cpu_has_avx512_popcnt() {
#if defined(PYG_QUANT_X86_DISPATCH)
  static const bool has = !isa_forced_generic() && !isa_capped_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vpopcntdq");
  return has;
#else
  return false;
#endif
}

// Whether the kernels that also need AVX-512 DQ may run.
inline bool cpu_has_avx512_dq() {
#if defined(PYG_QUANT_X86_DISPATCH)
  static const bool has = cpu_has_avx512_vnni() && __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

#if defined(PYG_QUANT_X86_DISPATCH)
// Lane j of the result is the sum of the 16 int32 lanes of acc[j] (wrapping, as int32 adds do): a transpose-add
// tree of 45 instructions instead of 16 separate horizontal reductions.
PYG_QUANT_TARGET_AVX512 inline __m512i sum_lanes_16(const __m512i acc[16]) {
  __m512i pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for a = acc[2i], b = acc[2i+1].
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * i], acc[2 * i + 1]),
                                _mm512_unpackhi_epi32(acc[2 * i], acc[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    // Per 128-bit lane: element j is that lane's partial sum of acc[4i + j].
    quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
  }
  // Adding 128-bit lanes (0+1, 2+3) of two quads at once, twice, leaves quad i's four totals in lane i.
  const __m512i h0 = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], 0x88),
                                      _mm512_shuffle_i32x4(quads[0], quads[1], 0xDD));
  const __m512i h1 = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_i32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(h0, h1, 0x88), _mm512_shuffle_i32x4(h0, h1, 0xDD));
}
#endif

}  // namespace pyg_quant
