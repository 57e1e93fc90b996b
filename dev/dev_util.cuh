/*
 * dev_util.cuh -- what the experiments of dev/ share: checked CUDA calls, the mbarrier and bulk-copy
 * (TMA 1D) primitives, and exact host decoders of E2M1 and E4M3 for double references.
 * Not part of the library.
 */
#ifndef MEGAMOE_DEV_UTIL_CUH
#define MEGAMOE_DEV_UTIL_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmath>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);                    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(b)),
                 "r"(parity)
                 : "memory");
}
/* bytes (a multiple of 16) from global to shared memory; completion counted on the mbarrier. */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

static inline float e2m1(int code) {
    const float v[8] = {0, .5f, 1, 1.5f, 2, 3, 4, 6};
    return code & 8 ? -v[code & 7] : v[code & 7];
}
static inline float e4m3(int b) {
    const int e = (b >> 3) & 15, m = b & 7;
    return e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
}

#endif /* MEGAMOE_DEV_UTIL_CUH */
