/*
 * gemm/splitk.cuh -- split-K across the blocks of one workspace entry (the mma.sync and wgmma
 * kernels): the partial sums out, a count, and the last block adds them in split order, so y does
 * not depend on which block came last. (The streaming kernel splits per warp: sm90_expert_stream.cu.)
 */
#ifndef MEGAMOE_GEMM_SPLITK_CUH
#define MEGAMOE_GEMM_SPLITK_CUH

#include "fragments.cuh"
#include "../ptx/sync.cuh"

/* Split-K across the blocks of one (row block, tile) workspace entry, for a block of THREADS threads
 * holding acc[q][n-tile * 4 + j] (8 n-tiles of 8 tokens, as the mma.sync and wgmma kernels do): the
 * block's values out (value v of thread tid at v * THREADS + tid: coalesced; only the n-tiles that
 * hold tokens), a fence, and a count on the entry's counter (self-reset). Every block but the last
 * of the entry returns false; the last adds all splits into acc in split order (deterministic) and
 * returns true. */
template <int THREADS>
__device__ __forceinline__ bool splitk_block_reduce(float (&acc)[GROUPS_PER_WARP][32], float *ws,
                                                    int *counters, size_t entry, int splits, int split,
                                                    int ntiles_n, int tid) {
    __shared__ int is_last;
    constexpr size_t per_split = (size_t)GROUPS_PER_WARP * 32 * THREADS;
    float *mine = ws + (entry * splits + split) * per_split + tid;
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < ntiles_n)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    __stcg(mine + (size_t)((q * 8 + i) * 4 + j) * THREADS, acc[q][i * 4 + j]);
    __syncthreads(); /* the block's partial sums before thread 0's release */
    if (tid == 0) {
        mm_fence_acq_rel_gpu(); /* release: the partial sums before the count */
        int *counter = counters + entry;
        is_last = atomicAdd(counter, 1) == splits - 1;
        if (is_last) {
            *counter = 0;           /* ready for the next forward */
            mm_fence_acq_rel_gpu(); /* acquire: the other splits' partial sums after the count */
        }
    }
    __syncthreads();
    if (!is_last) return false;
    const float *all = ws + entry * splits * per_split + tid;
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < ntiles_n)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const size_t v = (size_t)((q * 8 + i) * 4 + j) * THREADS;
                    float sum = __ldcg(all + v); /* split 0 first: no 0 + (-0) */
                    for (int sp = 1; sp < splits; sp++)
                        sum += __ldcg(all + sp * per_split + v);
                    acc[q][i * 4 + j] = sum;
                }
    return true;
}

#endif /* MEGAMOE_GEMM_SPLITK_CUH */
