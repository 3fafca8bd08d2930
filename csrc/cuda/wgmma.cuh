#pragma once
// Hopper (sm_90a) warpgroup primitives for the b1 GEMM: shared-memory matrix
// descriptors and wgmma.mma_async m64nNk256 .s32.b1.b1.and.popc with both
// operands in shared memory (PTX ISA, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate").  Only the sm_90a pass of the build emits them
// (PYG_QUANT_WGMMA); other passes compile the callers to a trap that the host
// never launches (bitmm_wgmma_cuda.cu checks the device first).
//
// Operand layouts in shared memory (K-major, PTX "matrix descriptor"):
// - no swizzle: core matrices of 8 rows x 16 bytes stored as 128 contiguous
//   bytes; `lead_bytes` = distance between the two K halves of a k256 step,
//   `stride_bytes` = distance between consecutive 8-row groups.
// - W-byte swizzle (W = 32, 64, 128): each row's W bytes (W/32 k256 steps) are
//   contiguous at a pitch of W bytes, with its 16-byte chunk j stored at chunk
//   j ^ ((byte offset >> 7) & (W/16 - 1)) (swizzle_offset below); an 8-row group
//   spans 8W bytes (`stride_bytes`), the k-th step of a row starts 32k bytes
//   into it, and the region is 8W-byte aligned.  This is the layout a TMA box of
//   W bytes x rows writes with the tensor map's W-byte swizzle (bitmm_wgmma_cuda.cu),
//   and the one 16-byte stores would write at swizzle_offset (8 consecutive ones hit
//   distinct banks).
// A 16-byte chunk of a plane row is 4 words of pyg_quant/layout.py, so planes
// are copied in verbatim.
//
// Accumulator fragment (per warpgroup, m64 x N int32, N/2 registers a thread):
// register i of lane l in warp w (of the warpgroup) holds row 16w + l/4 + 8*((i/2)%2)
// and column 8*(i/4) + 2*(l%4) + i%2.
#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PYG_QUANT_WGMMA 1
#endif

namespace pyg_quant {
namespace cuda {

enum class SmemSwizzle : uint64_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// `addr`: a 32-bit shared-window offset (what __cvta_generic_to_shared gives).
__device__ __forceinline__ uint64_t smem_descriptor_at(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes,
                                                       SmemSwizzle swizzle = SmemSwizzle::kNone) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>((lead_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) | (static_cast<uint64_t>(swizzle) << 62);
}

__device__ __forceinline__ uint64_t smem_descriptor(const void* smem, uint32_t lead_bytes, uint32_t stride_bytes,
                                                    SmemSwizzle swizzle = SmemSwizzle::kNone) {
  return smem_descriptor_at(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), lead_bytes, stride_bytes, swizzle);
}

// Where byte `offset` (from an 8W-aligned base) of a W-byte-swizzled region lives.
template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzle_offset(uint32_t offset) {
  static_assert(kRowBytes == 32 || kRowBytes == 64 || kRowBytes == 128, "wgmma swizzles 32, 64 or 128-byte rows");
  return offset ^ (((offset >> 7) & (kRowBytes / 16 - 1)) << 4);
}

template <int kRowBytes>
constexpr SmemSwizzle swizzle_for_row_bytes() {
  return kRowBytes == 128 ? SmemSwizzle::k128B : (kRowBytes == 64 ? SmemSwizzle::k64B : SmemSwizzle::k32B);
}

// Orders this thread's earlier register/shared accesses before the warpgroup's next wgmma.
__device__ __forceinline__ void wgmma_fence() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most kPending committed wgmma groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Shared memory written through the generic proxy (cp.async, st.shared) and read
// next by wgmma (the async proxy) needs this fence in every writing thread.
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving reads/writes of an accumulator across the
// asynchronous wgmma that owns it until wgmma_wait says it is done.
template <int kRegs>
__device__ __forceinline__ void fence_registers(int32_t (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// A product of kStack stacked B planes of kTileN columns each, folded in place into plane 0's columns shifted by
// their plane: column c of plane q is column q·kTileN + c of the product, held by the same thread (accumulator
// 4j + i holds column 8j + 2 (lane % 4) + i % 2, see above), so no data moves between threads.
template <int kTileN, int kStack, int kRegs>
__device__ __forceinline__ void fold_stacked_planes(int32_t (&acc)[kRegs]) {
  static_assert(kRegs == kTileN / 2 * kStack, "the accumulator spans every slot");
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
    for (int q = 1; q < kStack; ++q) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[4 * j + i] += acc[4 * (j + q * kTileN / 8) + i] << q;
    }
  }
}

// d (+)= popc(A AND B) over one k256 step: A 64 x 256 bits, B N x 256 bits
// (both K-major), d += only when `accumulate` != 0.
template <int N>
__device__ __forceinline__ void wgmma_b1(int32_t (&d)[N / 2], uint64_t a_desc, uint64_t b_desc, int accumulate);

// The three instantiations differ only in the accumulator count; written out
// because inline PTX needs every register named.
template <>
__device__ __forceinline__ void wgmma_b1<64>(int32_t (&d)[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
#ifdef PYG_QUANT_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k256.s32.b1.b1.and.popc {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
#else
  __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_b1<128>(int32_t (&d)[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
#ifdef PYG_QUANT_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k256.s32.b1.b1.and.popc {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
        "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
        "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
        "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
        "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
#else
  __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_b1<256>(int32_t (&d)[128], uint64_t a_desc, uint64_t b_desc, int accumulate) {
#ifdef PYG_QUANT_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k256.s32.b1.b1.and.popc {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
        "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
        "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
        "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
        "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]),
        "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]),
        "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]),
        "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]),
        "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]),
        "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]),
        "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]),
        "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]),
        "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
#else
  __trap();
#endif
}

}  // namespace cuda
}  // namespace pyg_quant
