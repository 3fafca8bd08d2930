#pragma once
// Hopper (sm_90a) pipeline primitives for the warp-specialised b1 GEMM
// (bitmm_wgmma_cuda.cu): shared-memory mbarriers, bulk tensor copies (TMA) that
// complete on them, optionally multicast to every CTA of a cluster, cluster
// barriers and register reallocation between warpgroups (PTX ISA: "Parallel
// Synchronization and Communication Instructions: mbarrier", "Data Movement:
// cp.async.bulk.tensor", "setmaxnreg").  Addresses are 32-bit shared-window
// offsets; a CTA's own offset is also a valid shared::cluster address of itself,
// and multicast copies land at the same offset in every destination CTA.
// Like wgmma.cuh, only the sm_90a pass emits them (PYG_QUANT_WGMMA); other passes
// compile the callers to a trap the host never launches.
#include <cstdint>

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; the header needs no libcuda)

#include "wgmma.cuh"

namespace pyg_quant {
namespace cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#ifdef PYG_QUANT_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes this thread's mbarrier.init visible to the other CTAs of the cluster
// (their multicast copies and remote arrives); a cluster barrier follows.
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Every thread of every CTA of the cluster; .aligned: each warp arrives converged.
__device__ __forceinline__ void cluster_sync() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t rank = 0;
#ifdef PYG_QUANT_WGMMA
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
  return rank;
}

// This thread's arrival, after raising the phase's expected transaction bytes by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef PYG_QUANT_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// This thread's arrival on a barrier of its own CTA.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#ifdef PYG_QUANT_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// Arrival on the barrier at offset `bar` of cluster CTA `rank` (this CTA included).  Default (CTA-scope)
// semantics, as in CUTLASS's cluster pipelines: the arrival publishes no data, it only says that reads which
// have already completed (wgmma.wait_group) are done; .release.cluster would put a MEMBAR.ALL.GPU before every
// arrival (seen in the SASS).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
#ifdef PYG_QUANT_WGMMA
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
#endif
}

// true once the phase of parity `parity` has completed (the phase before the
// current one counts as completed: parity 1 passes on a fresh barrier).
// Default (acquire.cta) semantics, for the same reason as mbar_arrive_cluster:
// .acquire.cluster adds an L1 invalidation (CCTL.IVALL) after every wait.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 1;
#ifdef PYG_QUANT_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
#endif
  return done != 0;
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
#ifdef PYG_QUANT_WGMMA
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// Box at coordinates (c0 innermost, c1, c2) of `map` into this CTA's shared memory at `dst`; the bytes count
// against the current phase of `bar`.  Elements outside the tensor are written as zeros (and counted).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
#ifdef PYG_QUANT_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
#endif
}

// The same box into every CTA of `cta_mask`, at offset `dst` of each, counted by the barrier at offset `bar` of each.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                      int c1, int c2, uint16_t cta_mask) {
#ifdef PYG_QUANT_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask)
      : "memory");
#endif
}

// The stage a side of a `stages`-deep pipeline is at, and the parity of its round there (producers and consumers
// walk the stages alike: a stage's `full` / `empty` barrier completes one phase a round).
struct StageCursor {
  int stages;
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Register reallocation between warpgroups (all threads of the warpgroup, converged).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#ifdef PYG_QUANT_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

}  // namespace cuda
}  // namespace pyg_quant
