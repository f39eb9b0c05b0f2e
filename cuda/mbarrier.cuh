// mbarrier.cuh: sm_90's shared-memory transaction barriers and 1-D bulk copies, the
// producer/consumer handshake of the kernels that feed shared memory by the copy engine
// (attention_hopper_ws.cu's TMA tiles, norm_backward_ring.cu's rows).
// A "full" barrier is armed by the producer (mbar_expect_tx: one arrival plus the bytes
// to come) and completes when the copies addressed to it have landed; an "empty" barrier
// counts the consumers' arrivals. Waits are on a phase's parity: the k-th use (from 0) of
// a barrier completes phase k, so its waiters pass parity k & 1.
// Initialisation (mbar_init by one thread) must be followed by mbar_init_fence() and a
// block barrier before any copy or wait uses the barrier.
// Before sm_90 these compile to traps; callers dispatch on the device first.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace mhar::cuda {

// As attention_mma.cuh's helpers: device code for an older target traps; the host pass
// and sm_90 see the instructions.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MHAR_MBAR_OLD_ARCH 1
#endif

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#ifdef MHAR_MBAR_OLD_ARCH
  __trap();
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
#endif
}
// Makes the initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_init_fence() {
#ifdef MHAR_MBAR_OLD_ARCH
  __trap();
#else
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// The producer's arrival: the barrier completes once `bytes` more have been written to it.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef MHAR_MBAR_OLD_ARCH
  __trap();
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef MHAR_MBAR_OLD_ARCH
  __trap();
#else
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// Waits for the completion of the barrier's phase with this parity.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef MHAR_MBAR_OLD_ARCH
  __trap();
#else
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
#endif
}
// `bytes` (a multiple of 16; dst and src 16-byte aligned) from global src into this
// block's shared dst by the copy engine, completing on `bar` (which the caller armed for
// them with mbar_expect_tx).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
#ifdef MHAR_MBAR_OLD_ARCH
  __trap();
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}

// Orders this thread's ordinary accesses to shared memory (stores, cp.async, loads) before
// the async proxy's (wgmma's reads, the copy engine's writes) that a following barrier
// lets start: each accessing thread fences, then the barrier.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef MHAR_MBAR_OLD_ARCH
  __trap();
#else
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#undef MHAR_MBAR_OLD_ARCH

}  // namespace mhar::cuda
