/*
 * ptx/barrier.cuh -- named block barriers (bar.sync / bar.red over a subset of a block's threads, by
 * barrier id 1..15; id 0 is __syncthreads) and the warpgroups' register reallocation (setmaxnreg).
 */
#ifndef MEGAMOE_PTX_BARRIER_CUH
#define MEGAMOE_PTX_BARRIER_CUH

/* Barrier ID over `count` threads (a multiple of 32), every thread of each participating warp. */
template <int ID>
__device__ __forceinline__ void mm_bar_sync(int count) {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "r"(count) : "memory");
}
template <int ID, int COUNT>
__device__ __forceinline__ void mm_bar_sync() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(COUNT) : "memory");
}
/* Barrier ID over `count` threads; returns whether pred is nonzero in all of them. */
template <int ID>
__device__ __forceinline__ int mm_bar_and(int count, int pred) {
    int r;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.s32 p, %1, 0;\nbar.red.and.pred q, %3, %2, p;\nselp.s32 %0, 1, "
                 "0, q;\n}\n"
                 : "=r"(r)
                 : "r"(pred), "r"(count), "n"(ID)
                 : "memory");
    return r;
}

/* A warpgroup's registers per thread lowered / raised to N (the warp-specialized kernel's roles). */
template <int N>
__device__ __forceinline__ void mm_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void mm_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#endif /* MEGAMOE_PTX_BARRIER_CUH */
