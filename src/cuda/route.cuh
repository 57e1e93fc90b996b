/*
 * route.cuh -- the routing tables' device building blocks: the block scan and the per-expert offsets
 * and tile list the routing kernels write (route_write_tiles), and the routing that runs inside the
 * stage kernel (sm90_stage.cu) so that a one-token forward of one rank has no routing kernel: one
 * warp over the token's ids (route_one_warp). Same tables, same slot order as the routing kernels
 * of sm90_route.cu.
 */
#pragma once
#include "common.cuh"
#include "gemm_plan.h"

/* Exclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024); *total gets the sum. */
__device__ __forceinline__ int block_exclusive_scan(int v, int *total) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < nwarps; w++) {
        before += w < warp ? warp_sums[w] : 0;
        sum += warp_sums[w];
    }
    *total = sum;
    return before + incl - v;
}

/* A rank's tile table (tile_expert, tile_start, tile_rows in buffer b), which every routing fills
 * the same way: its one writer. Tile t holds expert e's tokens from `start` of the expert's, their
 * slot rows from `first`, ncols of them. */
struct route_tile_table {
    int32_t *expert, *start;
    int2 *rows;
    __device__ __forceinline__ route_tile_table(const mm_buffer_layout &L, uint8_t *b)
        : expert((int32_t *)(b + L.tile_expert)), start((int32_t *)(b + L.tile_start)),
          rows((int2 *)(b + L.tile_rows)) {}
    __device__ __forceinline__ void store(int t, int e, int start_, int first, int ncols) const {
        expert[t] = e;
        start[t] = start_;
        rows[t] = make_int2(first, ncols);
    }
};

/* One rank's expert offsets and tile list, in expert order, by one block (experts in chunks of
 * blockDim.x with a block-wide scan), from the counts count_of(e); on_expert(e, count, offset) sees
 * each expert's. Writes expert_offset[0..E_r], tile_expert, tile_start, tile_rows and num_tiles of
 * buffer b. */
template <typename CountOf, typename OnExpert>
__device__ __forceinline__ void route_write_tiles(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                                  uint8_t *b, CountOf count_of, OnExpert on_expert) {
    int32_t *offset = (int32_t *)(b + L.expert_offset);
    const route_tile_table table(L, b);
    int slot_base = 0, tile_base = 0;
    for (int e0 = 0; e0 < sh.E_r; e0 += blockDim.x) {
        const int e = e0 + threadIdx.x;
        const int n = e < sh.E_r ? count_of(e) : 0, tiles = (n + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS;
        int slot_total, tile_total;
        const int slot_off = block_exclusive_scan(n, &slot_total);
        const int tile_off = block_exclusive_scan(tiles, &tile_total);
        if (e < sh.E_r) {
            offset[e] = slot_base + slot_off;
            on_expert(e, n, slot_base + slot_off);
            for (int i = 0; i < tiles; i++)
                table.store(tile_base + tile_off + i, e, i * MM_TILE_TOKENS,
                            slot_base + slot_off + i * MM_TILE_TOKENS,
                            min(MM_TILE_TOKENS, n - i * MM_TILE_TOKENS));
        }
        slot_base += slot_total;
        tile_base += tile_total;
    }
    if (threadIdx.x == 0) {
        offset[sh.E_r] = slot_base;
        *(int32_t *)(b + L.num_tiles) = tile_base;
    }
}

/* The routing tables of a one-token forward of one rank (R = 1), built by one warp from the token's
 * ids while the rest of the stage block quantizes it (sm90_stage_kernel): the same tables and slot
 * order as the routing kernels. ids: lane k < K holds slot k's id, -1 where the token is not routed
 * (padding, non-finite) or the id is out of range. With one token every expert has at most K <= 32
 * slots, so one tile; an expert's values are counts over the K ids. MM_ROUTE_WARP_EXPERTS (gemm_plan.h)
 * bounds the experts it walks (32 per pass). */
__device__ inline void route_one_warp(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *b, int id,
                                      float scale) {
    __shared__ int s_id[32], s_first[32];
    const int lane = threadIdx.x & 31, K = sh.K, E = sh.E_r;
    const bool valid = lane < K && id >= 0 && id < E;
    const int e_k = valid ? id : -1;
    /* slot k is its expert's first (of the K): it opens a tile */
    int before = 0, first = valid;
    for (int j = 0; j < K; j++) {
        const int e_j = __shfl_sync(0xFFFFFFFFu, e_k, j);
        if (j < lane && e_j == e_k) before++, first = 0;
    }
    s_id[lane] = e_k;
    s_first[lane] = first;
    __syncwarp();
    int32_t *count = (int32_t *)(b + L.expert_count), *offset = (int32_t *)(b + L.expert_offset);
    const route_tile_table table(L, b);
    for (int e = lane; e < E; e += 32) {
        int c = 0, less = 0, tiles_less = 0;
        for (int j = 0; j < K; j++) {
            const int x = s_id[j];
            c += x == e;
            less += x >= 0 && x < e;
            tiles_less += s_first[j] && x >= 0 && x < e;
        }
        count[e] = c;
        offset[e] = less;
        if (c > 0) table.store(tiles_less, e, 0, less, c); /* c <= K <= 32: one tile */
    }
    /* Slot k at its expert's first slot plus the earlier slots of that expert; its code is k (home
     * rank 0, token 0). The totals by lane 0. */
    int less_k = 0, n = 0, tiles = 0;
    for (int j = 0; j < K; j++) {
        const int x = s_id[j];
        less_k += x >= 0 && x < e_k;
        n += x >= 0;
        tiles += s_first[j];
    }
    if (valid) {
        ((int32_t *)(b + L.slots))[less_k + before] = lane;
        ((float *)(b + L.slot_scale))[less_k + before] = scale;
    }
    if (lane == 0) {
        offset[E] = n;
        *(int32_t *)(b + L.num_tiles) = tiles;
    }
}
