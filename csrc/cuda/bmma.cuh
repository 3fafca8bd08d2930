#pragma once
// 1-bit tensor-core primitives shared by the CUDA kernels (sm_80 / sm_90).
// Fragments follow the PTX ISA for mma.m16n8k256 .b1 (row.col):
//   A (16 x 256 bits): a0 = (row g, word t), a1 = (row g+8, word t), a2 = (row g, word t+4), a3 = (row g+8, word t+4)
//   B (256 x 8 bits):  b0 = (col g, word t), b1 = (col g, word t+4)
//   C (16 x 8 int32):  c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
// with g = lane / 4 and t = lane % 4.  Word w of a row holds K elements
// 32w..32w+31, exactly the 32-bit words of pyg_quant/layout.py, so tiles and
// planes feed the tensor cores with no repacking.
#include <cstdint>

namespace pyg_quant {
namespace cuda {

// D = popc(A AND B) + C.  AND only: XOR is emulated on sm_90 (several times slower).
__device__ __forceinline__ void bmma_and_popc(int32_t (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // the host side never launches these kernels below sm_80
#endif
}

// Four 8x8 b16 matrices from shared memory = one A fragment, or the B
// fragments of two n8 tiles (see the lane-address mapping at the call sites).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  __trap();
#endif
}

// 16-byte global -> shared copy that bypasses the registers (and L1); with
// src_bytes == 0 the destination is zero-filled and the source is not read.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

}  // namespace cuda
}  // namespace pyg_quant
