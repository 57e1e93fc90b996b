/*
 * ptx/mbarrier.cuh -- shared-memory mbarriers at CTA scope: init, arrive (with an expected
 * transaction count for asynchronous copies), and the parity and phase-state waits. An arrive
 * releases and a wait acquires (PTX defaults).
 */
#ifndef MEGAMOE_PTX_MBARRIER_CUH
#define MEGAMOE_PTX_MBARRIER_CUH

#include <stdint.h>

__device__ __forceinline__ uint32_t mm_smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mm_mbar_init(uint64_t *b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mm_smem_u32(b)), "r"(count));
}
/* After the initializing thread's inits, before the block barrier that publishes them. */
__device__ __forceinline__ void mm_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* Arrives, expecting `bytes` more of asynchronous copies before the phase can complete. */
__device__ __forceinline__ void mm_mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mm_smem_u32(b)), "r"(bytes)
                 : "memory");
}
/* Expects `bytes` more of asynchronous copies without arriving (the arrive comes later, e.g. once
 * what the copies' consumers need besides them is written). */
__device__ __forceinline__ void mm_mbar_add_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(mm_smem_u32(b)),
                 "r"(bytes)
                 : "memory");
}
/* The arrive and the parity wait also take the barrier's shared address (b = mm_smem_u32(barrier)). */
__device__ __forceinline__ void mm_mbar_arrive(uint32_t b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(b) : "memory");
}
__device__ __forceinline__ void mm_mbar_arrive(uint64_t *b) { mm_mbar_arrive(mm_smem_u32(b)); }
/* Waits until the phase of the given parity has completed. */
__device__ __forceinline__ void mm_mbar_wait_parity(uint32_t b, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}\n" ::"r"(b),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void mm_mbar_wait_parity(uint64_t *b, uint32_t parity) {
    mm_mbar_wait_parity(mm_smem_u32(b), parity);
}
/* Arrives and returns the phase state, then waits for that phase (the cuda::barrier way). */
__device__ __forceinline__ uint64_t mm_mbar_arrive_state(uint64_t *b) {
    uint64_t state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n"
                 : "=l"(state)
                 : "r"(mm_smem_u32(b))
                 : "memory");
    return state;
}
__device__ __forceinline__ void mm_mbar_wait_state(uint64_t *b, uint64_t state) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}\n" ::"r"(mm_smem_u32(b)),
                 "l"(state)
                 : "memory");
}
#endif /* MEGAMOE_PTX_MBARRIER_CUH */
