/*
 * ptx/sync.cuh -- ordering between kernels and between proxies: programmatic dependent launch
 * (griddepcontrol), the GPU-scope acquire/release fence of the split-K and arrival counters, and the
 * generic-to-async-proxy fence that makes shared-memory writes visible to wgmma and bulk copies.
 */
#ifndef MEGAMOE_PTX_SYNC_CUH
#define MEGAMOE_PTX_SYNC_CUH

/* Programmatic dependent launch: every kernel of a forward is launched so that it may be scheduled
 * while the kernel before it drains (its launch latency hidden), and its first act is to wait for
 * that kernel to finish and its writes to be visible. Completion chains, so waiting for the kernel
 * just before waits for all earlier ones. Without a programmatic predecessor the wait returns at once. */
__device__ __forceinline__ void mm_wait_previous() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
/* Lets the next kernel's blocks be scheduled now (they still wait in mm_wait_previous for this
 * kernel's end). Most kernels do not: letting the next kernel in right after every kernel's wait is
 * slower; the streaming kernels trigger once a block's copies are issued, sm90_act_f16 right after
 * its wait (DECISIONS 41). */
__device__ __forceinline__ void mm_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
/* A release / acquire fence at GPU scope, issued by one thread for its group (a warp or a block)
 * after the group's barrier: bar.sync and bar.warp.sync order the group's memory accesses before
 * the barrier, and the fence's release is cumulative over them -- the pattern of CUTLASS's split-K
 * semaphores (a relaxed atomic after the fence publishes; the fence after the atomic acquires).
 * Not __threadfence() in every thread: that is fence.sc.gpu (MEMBAR.SC.GPU), stronger than the
 * hand-off needs. */
__device__ __forceinline__ void mm_fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
/* This thread's generic-proxy writes to shared memory, visible to the async proxy (wgmma operands,
 * bulk stores). */
__device__ __forceinline__ void mm_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#endif /* MEGAMOE_PTX_SYNC_CUH */
