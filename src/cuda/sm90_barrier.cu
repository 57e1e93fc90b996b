/*
 * sm90_barrier.cu -- a barrier across the ranks of an NCCL group, on flags in the symmetric buffers
 * reached through LSA peer pointers. NCCL 2.28's LSA barrier has no timeout (SPEC §5), so the
 * library owns this wait: past timeout_ms it records a timeout and returns instead of hanging.
 * Each rank keeps an epoch counter in its own buffer; every barrier raises it by one, writes it into
 * every peer's flag slot for this rank, and waits until its own slots of all peers reach it.
 * One warp; ranks are spread over the lanes.
 */
#include "launch.h"

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

__global__ void sm90_barrier_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers, uint64_t timeout_ns) {
    mm_wait_previous();
    const int me = sh.first_rank, lane = threadIdx.x;
    uint8_t *mine = peers[me];
    volatile uint64_t *epoch_p = (volatile uint64_t *)(mine + L.barrier);
    const uint64_t epoch = *epoch_p + 1; /* every lane reads the same value before lane 0 raises it */
    __syncwarp();
    if (lane == 0) *epoch_p = epoch;
    __threadfence_system(); /* this rank's writes before the arrival */
    for (int p = lane; p < sh.R; p += 32) {
        volatile uint64_t *slot = (volatile uint64_t *)(peers[p] + L.barrier + 8 * (1 + me));
        *slot = epoch;
    }
    const uint64_t start = global_ns();
    bool timed_out = false;
    for (int q = lane; q < sh.R && !timed_out; q += 32) {
        volatile uint64_t *slot = (volatile uint64_t *)(mine + L.barrier + 8 * (1 + q));
        while (*slot < epoch) {
            if (global_ns() - start > timeout_ns) {
                timed_out = true;
                /* rank that did not arrive, + 1 (0 = no timeout) */
                atomicCAS((unsigned int *)(mine + L.error + 12), 0u, (unsigned int)(q + 1));
                break;
            }
        }
    }
    __threadfence_system(); /* the peers' writes before the arrival are visible after it */
}

megamoe_status sm90_barrier_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                   int timeout_ms, cudaStream_t s) {
    MM_CUDA_TRY(mm_launch(sm90_barrier_kernel, 1, 32, 0, s, sh, L, peers, (uint64_t)timeout_ms * 1000000ull));
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
