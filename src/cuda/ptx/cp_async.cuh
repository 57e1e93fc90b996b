/*
 * ptx/cp_async.cuh -- Ampere-style asynchronous copies (cp.async) from global to shared memory, per
 * thread, counted in commit groups.
 */
#ifndef MEGAMOE_PTX_CP_ASYNC_CUH
#define MEGAMOE_PTX_CP_ASYNC_CUH

#include <stdint.h>

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    asm volatile(
        "cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
        "l"(gmem));
}
__device__ __forceinline__ void cp_async8(void *smem, const void *gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
                 "l"(gmem));
}
/* 16 bytes to shared address dst; src_bytes 0 fills zeros (src must still be a valid address). */
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/* Waits until at most N of this thread's commit groups are pending. */
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

#endif /* MEGAMOE_PTX_CP_ASYNC_CUH */
