/*
 * sm90_route.cu -- the dispatch bookkeeping: for each rank and local expert, the slots (home rank,
 * token, slot) routed to it, in (home rank, token, slot) order, read from every rank's staged ids
 * through the peer table; then the token tiles the expert GEMMs run over. All counts stay on the
 * device, so a forward needs no host synchronization.
 *   count: one block per (local expert, rank); tiles: one thread per rank; fill: like count.
 */
#include "common.cuh"

/* Calls f(code, match) for every staged slot of every home rank, blockDim.x at a time, in order;
 * all threads of the block take part in every call. */
template <typename F>
__device__ void for_each_slot(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers, int expert,
                              F f) {
    for (int src = 0; src < sh.R; src++) {
        const uint8_t *b = peers[src];
        const int n = *(const int32_t *)(b + L.num_tokens) * sh.K;
        const int32_t *ids = (const int32_t *)(b + L.topk_ids);
        const uint8_t *state = b + L.token_state;
        for (int j0 = 0; j0 < n; j0 += blockDim.x) {
            const int j = j0 + threadIdx.x;
            const bool match = j < n && ids[j] == expert && state[j / sh.K] == MM_TOKEN_LIVE;
            f((src * sh.T_max) * sh.K + j, match);
        }
    }
}

__global__ void sm90_route_count_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    const int e = blockIdx.x, r = blockIdx.y, expert = r * sh.E_r + e;
    int count = 0;
    for_each_slot(sh, L, peers, expert, [&](int, bool match) { count += __syncthreads_count(match); });
    if (threadIdx.x == 0) ((int32_t *)(peers[r] + L.expert_count))[e] = count;
}

__global__ void sm90_route_tiles_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    const int r = blockIdx.x;
    if (threadIdx.x != 0) return;
    uint8_t *b = peers[r];
    const int32_t *count = (const int32_t *)(b + L.expert_count);
    int32_t *offset = (int32_t *)(b + L.expert_offset);
    int32_t *tile_expert = (int32_t *)(b + L.tile_expert), *tile_start = (int32_t *)(b + L.tile_start);
    int total = 0, tiles = 0;
    for (int e = 0; e < sh.E_r; e++) {
        offset[e] = total;
        for (int s = 0; s < count[e]; s += MM_TILE_TOKENS) {
            tile_expert[tiles] = e;
            tile_start[tiles] = s;
            tiles++;
        }
        total += count[e];
    }
    offset[sh.E_r] = total;
    *(int32_t *)(b + L.num_tiles) = tiles;
}

__global__ void sm90_route_fill_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    __shared__ int warp_counts[32];
    const int e = blockIdx.x, r = blockIdx.y, expert = r * sh.E_r + e;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int32_t *slots = (int32_t *)(peers[r] + L.slots) + ((const int32_t *)(peers[r] + L.expert_offset))[e];
    int pos = 0;
    for_each_slot(sh, L, peers, expert, [&](int code, bool match) {
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, match);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
            before += w < warp ? warp_counts[w] : 0;
            total += warp_counts[w];
        }
        if (match) slots[pos + before + __popc(ballot & ((1u << lane) - 1u))] = code;
        pos += total;
        __syncthreads();
    });
}

megamoe_status sm90_route_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                 cudaStream_t s) {
    const dim3 grid(sh.E_r, sh.R);
    sm90_route_count_kernel<<<grid, 256, 0, s>>>(sh, L, peers);
    MM_CUDA_TRY(cudaGetLastError());
    sm90_route_tiles_kernel<<<sh.R, 32, 0, s>>>(sh, L, peers);
    MM_CUDA_TRY(cudaGetLastError());
    sm90_route_fill_kernel<<<grid, 256, 0, s>>>(sh, L, peers);
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
