/*
 * sm90_route_few.cuh -- the routing tables of a forward with few slots, built by one block: the same
 * tables and slot order as the route kernels (sm90_route.cu), for one process (every home rank's
 * staged tokens are local). The stage kernel's last block to finish runs it, so such a forward has
 * no routing kernel at all (sm90_stage.cu).
 */
#pragma once
#include "common.cuh"
#include "trace.cuh"

#define ROUTE_FEW_SLOTS 64      /* slots of a forward routed by the stage kernel's last block (256 was
                                 * measured slower than the routing kernel: Qwen3 T=32 +3.5%) */
#define ROUTE_FEW_EXPERTS 8192  /* experts per rank it counts in shared memory (32 KB) */

/* hist: E_r ints of shared memory. Reads the staged ids through L2: other blocks wrote them. */
__device__ inline void route_few_block(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                       int *hist) {
    __shared__ int code_of[ROUTE_FEW_SLOTS], expert_of[ROUTE_FEW_SLOTS];
    __shared__ float scale_of[ROUTE_FEW_SLOTS];
    /* Every staged slot in (home rank, token, slot) order: its code, its expert (-1: not routed) and
     * its token's activation scale (read beside the id: no latency of its own). */
    int n = 0;
    for (int src = 0; src < sh.R; src++) {
        const uint8_t *b = peers[src];
        const int ns = __ldcg((const int32_t *)(b + L.num_tokens)) * sh.K;
        for (int j = threadIdx.x; j < ns && n + j < ROUTE_FEW_SLOTS; j += blockDim.x) {
            const int id = __ldcg((const int32_t *)(b + L.topk_ids) + j);
            const bool live = __ldcg(b + L.token_state + j / sh.K) == MM_TOKEN_LIVE;
            code_of[n + j] = src * sh.T_max * sh.K + j;
            expert_of[n + j] = live && id >= 0 && id < sh.E ? id : -1;
            scale_of[n + j] = sh.nvfp4 ? __ldcg((const float *)(b + L.x_scale) + j / sh.K) : 1.0f;
        }
        n += ns;
    }
    __syncthreads();
    MM_KSTAMP(MM_K_STAGE, MM_KT_R_READ);
    for (int r = 0; r < sh.local_ranks; r++) {
        uint8_t *b = peers[sh.first_rank + r];
        const int lo = (sh.first_rank + r) * sh.E_r;
        for (int e = threadIdx.x; e < sh.E_r; e += blockDim.x) hist[e] = 0;
        __syncthreads();
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int local = expert_of[j] - lo;
            if (expert_of[j] >= 0 && local >= 0 && local < sh.E_r) atomicAdd(&hist[local], 1);
        }
        __syncthreads();
        if (r == 0) MM_KSTAMP(MM_K_STAGE, MM_KT_R_COUNTED);
        /* Counts, offsets and tiles in expert order; hist[e] becomes the expert's first slot. */
        int32_t *count = (int32_t *)(b + L.expert_count);
        route_write_tiles(sh, L, b, [&](int e) { return hist[e]; }, [&](int e, int c, int off) {
            count[e] = c;
            hist[e] = off;
        });
        __syncthreads();
        if (r == 0) MM_KSTAMP(MM_K_STAGE, MM_KT_R_TILES);
        /* Each slot at its expert's first slot plus the earlier slots of that expert. */
        int32_t *slots = (int32_t *)(b + L.slots);
        float *slot_scale = (float *)(b + L.slot_scale);
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int x = expert_of[j], local = x - lo;
            if (x < 0 || local < 0 || local >= sh.E_r) continue;
            int before = 0;
            for (int i = 0; i < j; i++) before += expert_of[i] == x;
            slots[hist[local] + before] = code_of[j];
            slot_scale[hist[local] + before] = scale_of[j];
        }
        __syncthreads();
    }
}
