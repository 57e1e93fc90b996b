/*
 * ptx/barrier.cuh -- named block barriers (over a subset of a block's threads, by barrier id 1..15;
 * id 0 is __syncthreads) and the warpgroups' register reallocation (setmaxnreg).
 * NOTE: the barriers are the non-.aligned forms (barrier.sync, barrier.red), not bar.sync /
 * bar.red, which are barrier.sync.aligned / barrier.red.aligned: .aligned requires every thread of a
 * warp to execute the same barrier instruction, convergently, and inline assembly gives the compiler
 * no reason to reconverge a warp before it (a lane-dependent branch just before, or one barrier
 * inlined at several call sites, leaves the warp diverged there: compute-sanitizer's synccheck
 * reports "Divergent thread(s) in block", and the hardware's behaviour is undefined). The non-aligned
 * forms count each arriving thread on its own; the barriers' participants and counts are unchanged.
 */
#ifndef MEGAMOE_PTX_BARRIER_CUH
#define MEGAMOE_PTX_BARRIER_CUH

/* Barrier ID over `count` threads (a multiple of 32), every thread of each participating warp. */
template <int ID> __device__ __forceinline__ void mm_bar_sync(int count) {
    asm volatile("barrier.sync %0, %1;\n" ::"n"(ID), "r"(count) : "memory");
}
template <int ID, int COUNT> __device__ __forceinline__ void mm_bar_sync() {
    asm volatile("barrier.sync %0, %1;\n" ::"n"(ID), "n"(COUNT) : "memory");
}
/* Barrier ID over `count` threads; returns whether pred is nonzero in all of them. */
template <int ID> __device__ __forceinline__ int mm_bar_and(int count, int pred) {
    int r;
    asm volatile(
        "{\n.reg .pred p, q;\nsetp.ne.s32 p, %1, 0;\nbarrier.red.and.pred q, %3, %2, p;\nselp.s32 %0, 1, "
        "0, q;\n}\n"
        : "=r"(r)
        : "r"(pred), "r"(count), "n"(ID)
        : "memory");
    return r;
}

/* A warpgroup's registers per thread lowered / raised to N (the warp-specialized kernel's roles). */
template <int N> __device__ __forceinline__ void mm_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void mm_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#endif /* MEGAMOE_PTX_BARRIER_CUH */
