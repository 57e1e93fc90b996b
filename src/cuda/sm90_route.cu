/*
 * sm90_route.cu -- the dispatch bookkeeping: for each rank and local expert, the slots (home rank,
 * token, slot) routed to it, in (home rank, token, slot) order, read from every rank's staged ids
 * through the peer table; then the token tiles the expert GEMMs run over. All counts stay on the
 * device, so a forward needs no host synchronization.
 *   count: one block per (local expert, rank); tiles: one block per rank; fill: like count;
 *   small: all three in one kernel for forwards of few slots in one process.
 * The forwards that gather then run sm90_gather.cu.
 */
#include "gemm_plan.h"
#include "launch.h"
#include "route.cuh"

/* Calls f(code, match, scale) for every staged slot of every home rank, blockDim.x at a time, in
 * order; all threads of the block take part in every call. SCALE: scale is a matching slot's
 * token's NVFP4 activation scale, else 1. */
template <bool SCALE = false, typename F>
__device__ void for_each_slot(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                              int expert, F f) {
    for (int src = 0; src < sh.R; src++) {
        const uint8_t *b = peers[src];
        const int n = *(const int32_t *)(b + L.num_tokens) * sh.K;
        const int32_t *ids = (const int32_t *)(b + L.topk_ids);
        const uint8_t *state = b + L.token_state;
        for (int j0 = 0; j0 < n; j0 += blockDim.x) {
            const int j = j0 + threadIdx.x;
            const bool match = j < n && ids[j] == expert && state[j / sh.K] == MM_TOKEN_LIVE;
            /* Only a live token has a scale (the stage kernel writes none for padding or non-finite
             * tokens): read it for the matching slots only. */
            const float scale =
                SCALE && sh.nvfp4 && match ? ((const float *)(b + L.x_scale))[j / sh.K] : 1.0f;
            f((src * sh.T_max) * sh.K + j, match, scale);
        }
    }
}

__global__ void sm90_route_count_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    mm_wait_previous();
    const int e = blockIdx.x, r = sh.first_rank + blockIdx.y, expert = r * sh.E_r + e;
    int count = 0;
    for_each_slot(sh, L, peers, expert, [&](int, bool match, float) { count += __syncthreads_count(match); });
    if (threadIdx.x == 0) ((int32_t *)(peers[r] + L.expert_count))[e] = count;
}

/* Expert offsets and the tile list, in expert order: one block per rank, experts in chunks of
 * blockDim.x with a block-wide scan (a single thread walking 256 experts cost ~0.1 ms). */
__global__ void sm90_route_tiles_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    mm_wait_previous();
    uint8_t *b = peers[sh.first_rank + blockIdx.x];
    const int32_t *count = (const int32_t *)(b + L.expert_count);
    route_write_tiles(
        sh, L, b, [&](int e) { return count[e]; }, [](int, int, int) {});
}

/* Writes the slot codes routed to global expert `expert`, in order, from slots[0] on, and their
 * tokens' activation scales from scales[0] on (NVFP4; 1 for BF16). */
__device__ void fill_expert(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                            int expert, int32_t *slots, float *scales) {
    __shared__ int warp_counts[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int pos = 0;
    for_each_slot<true>(sh, L, peers, expert, [&](int code, bool match, float scale) {
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, match);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
            before += w < warp ? warp_counts[w] : 0;
            total += warp_counts[w];
        }
        if (match) {
            const int at = pos + before + __popc(ballot & ((1u << lane) - 1u));
            slots[at] = code;
            scales[at] = scale;
        }
        pos += total;
        __syncthreads();
    });
}

__global__ void sm90_route_fill_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    mm_wait_previous();
    const int e = blockIdx.x, r = sh.first_rank + blockIdx.y;
    const int off = ((const int32_t *)(peers[r] + L.expert_offset))[e];
    fill_expert(sh, L, peers, r * sh.E_r + e, (int32_t *)(peers[r] + L.slots) + off,
                (float *)(peers[r] + L.slot_scale) + off);
}

/* Many slots (E_r <= MM_ROUTE_CHUNK_EXPERTS): three kernels over chunks of MM_ROUTE_CHUNK slots of
 * one home rank, a block per (chunk, local rank), ROUTE_CHUNK_WARPS warps of 64 slots each. count:
 * each chunk's slots per local expert, into route_chunks; scan: per expert the counts over the
 * chunks, the expert offsets and tiles, and each chunk's first row per expert in place of its
 * count; fill: each warp places its slots from its chunk's first rows plus the slots of the warps
 * before it, in slot order. Same tables, same slot order as count / tiles / fill, with each slot
 * read twice instead of once per expert (those scans cost ~0.33 ms at Qwen3-like T = 8192: 128
 * blocks reading all 65536 slots, a block barrier every 256). */
#define ROUTE_CHUNK_WARPS 8
#define ROUTE_WARP_SLOTS (MM_ROUTE_CHUNK / ROUTE_CHUNK_WARPS) /* 64: 2 per lane */
static_assert(ROUTE_WARP_SLOTS % 32 == 0, "a warp's slots are whole rounds of 32");
static_assert(MM_ROUTE_CHUNK_EXPERTS % (ROUTE_CHUNK_WARPS * 32) == 0, "whole experts per thread");

/* Chunk blockIdx.x of every home rank's slots: its home rank, first slot and slot count (0: past
 * the rank's slots). */
struct route_chunk {
    int src, j0, n;
};
/* Home rank src's slots this forward (its live tokens times K). */
__device__ __forceinline__ int route_src_slots(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                               uint8_t *const *peers, int src) {
    return *(const int32_t *)(peers[src] + L.num_tokens) * sh.K;
}
__device__ __forceinline__ route_chunk route_chunk_of(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                                      uint8_t *const *peers) {
    route_chunk c;
    c.src = blockIdx.x / L.route_chunks_per_src;
    c.j0 = (blockIdx.x % L.route_chunks_per_src) * MM_ROUTE_CHUNK;
    c.n = min(max(route_src_slots(sh, L, peers, c.src) - c.j0, 0), MM_ROUTE_CHUNK);
    return c;
}

/* The local expert (of rank r) of each of this warp's slots in chunk c, -1 where the slot is not
 * routed there (a -1 id, another rank's expert, a token not live, past the chunk); round u holds slot
 * c.j0 + warp * ROUTE_WARP_SLOTS + 32 * u + lane. Every load is issued before any is used. */
__device__ __forceinline__ void route_warp_experts(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                                   uint8_t *const *peers, const route_chunk &c, int r,
                                                   int (&e)[ROUTE_WARP_SLOTS / 32]) {
    const uint8_t *b = peers[c.src];
    const int32_t *ids = (const int32_t *)(b + L.topk_ids) + c.j0;
    const uint8_t *state = b + L.token_state;
    const int lane = threadIdx.x & 31, w0 = (threadIdx.x >> 5) * ROUTE_WARP_SLOTS;
    uint8_t st[ROUTE_WARP_SLOTS / 32];
#pragma unroll
    for (int u = 0; u < ROUTE_WARP_SLOTS / 32; u++) {
        const int i = w0 + 32 * u + lane;
        e[u] = i < c.n ? ids[i] : -1;
        st[u] = i < c.n ? state[(c.j0 + i) / sh.K] : MM_TOKEN_PADDING;
    }
#pragma unroll
    for (int u = 0; u < ROUTE_WARP_SLOTS / 32; u++) {
        const int local = e[u] - r * sh.E_r;
        e[u] = st[u] == MM_TOKEN_LIVE && e[u] >= 0 && local >= 0 && local < sh.E_r ? local : -1;
    }
}

/* Zeroes counts[0, n) and adds this thread's slots e[] to into[] (a count per local expert), with
 * the block barriers around: the chunk's histogram (into = counts) or its warp's (into = the warp's
 * row of counts). */
__device__ __forceinline__ void route_chunk_histogram(int *counts, int n, int *into,
                                                      const int (&e)[ROUTE_WARP_SLOTS / 32]) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        counts[i] = 0;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < ROUTE_WARP_SLOTS / 32; u++)
        if (e[u] >= 0) atomicAdd(&into[e[u]], 1);
    __syncthreads();
}

__global__ void __launch_bounds__(ROUTE_CHUNK_WARPS * 32)
    sm90_route_chunk_count_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    mm_wait_previous();
    extern __shared__ int hist[]; /* [E_r] */
    const route_chunk c = route_chunk_of(sh, L, peers);
    if (c.n == 0) return; /* the scan reads only the chunks that hold slots */
    const int r = sh.first_rank + blockIdx.y;
    int e[ROUTE_WARP_SLOTS / 32];
    route_warp_experts(sh, L, peers, c, r, e);
    route_chunk_histogram(hist, sh.E_r, hist, e);
    int32_t *out = (int32_t *)(peers[r] + L.route_chunks) + (size_t)blockIdx.x * sh.E_r;
    for (int i = threadIdx.x; i < sh.E_r; i += blockDim.x)
        out[i] = hist[i];
}

/* One block per local rank: expert e's count is the sum over the chunks that hold slots (chunk
 * order: home rank, then slot), its offset and tiles as route_write_tiles writes them; then each
 * chunk's count is replaced by the chunk's first slot row for e. */
__global__ void sm90_route_chunk_scan_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    mm_wait_previous();
    const int r = sh.first_rank + blockIdx.x;
    uint8_t *b = peers[r];
    int32_t *chunks = (int32_t *)(b + L.route_chunks), *count = (int32_t *)(b + L.expert_count);
    const int cps = L.route_chunks_per_src;
    /* the chunks of home rank src that hold slots */
    auto used = [&](int src) {
        return (route_src_slots(sh, L, peers, src) + MM_ROUTE_CHUNK - 1) / MM_ROUTE_CHUNK;
    };
    route_write_tiles(
        sh, L, b,
        [&](int e) {
            int n = 0;
            for (int src = 0; src < sh.R; src++) {
                const int32_t *ch = chunks + (size_t)src * cps * sh.E_r + e;
#pragma unroll 8
                for (int q = 0, nq = used(src); q < nq; q++)
                    n += ch[(size_t)q * sh.E_r];
            }
            return n;
        },
        [&](int e, int n, int offset) {
            count[e] = n;
            int row = offset;
            for (int src = 0; src < sh.R; src++) {
                int32_t *ch = chunks + (size_t)src * cps * sh.E_r + e;
                /* Eight counts loaded before any store: a store between two loads of the same
                 * array keeps the next load from issuing early (one L2 latency per chunk). */
                for (int q0 = 0, nq = used(src); q0 < nq; q0 += 8) {
                    int v[8];
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        v[u] = q0 + u < nq ? ch[(size_t)(q0 + u) * sh.E_r] : 0;
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        if (q0 + u < nq) {
                            ch[(size_t)(q0 + u) * sh.E_r] = row;
                            row += v[u];
                        }
                }
            }
        });
}

__global__ void __launch_bounds__(ROUTE_CHUNK_WARPS * 32)
    sm90_route_chunk_fill_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    mm_wait_previous();
    extern __shared__ int next_row[]; /* [ROUTE_CHUNK_WARPS][E_r]: counts, then each warp's next row */
    const route_chunk c = route_chunk_of(sh, L, peers);
    if (c.n == 0) return;
    const int r = sh.first_rank + blockIdx.y, E = sh.E_r;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int e[ROUTE_WARP_SLOTS / 32];
    route_warp_experts(sh, L, peers, c, r, e);
    /* The slots' activation scales, loaded with the ids (not one latency per round below). */
    const float *x_scale = (const float *)(peers[c.src] + L.x_scale);
    const int w0 = warp * ROUTE_WARP_SLOTS;
    float scale[ROUTE_WARP_SLOTS / 32];
#pragma unroll
    for (int u = 0; u < ROUTE_WARP_SLOTS / 32; u++)
        scale[u] = sh.nvfp4 && e[u] >= 0 ? x_scale[(c.j0 + w0 + 32 * u + lane) / sh.K] : 1.0f;
    /* The chunk's first row of each expert this thread prefixes below (E <= 4 x the block). */
    uint8_t *b = peers[r];
    const int32_t *first = (const int32_t *)(b + L.route_chunks) + (size_t)blockIdx.x * E;
    constexpr int per_thread = MM_ROUTE_CHUNK_EXPERTS / (ROUTE_CHUNK_WARPS * 32);
    int first_row[per_thread];
#pragma unroll
    for (int q = 0; q < per_thread; q++) {
        const int i = threadIdx.x + q * ROUTE_CHUNK_WARPS * 32;
        first_row[q] = i < E ? first[i] : 0;
    }
    int *mine = next_row + warp * E;
    route_chunk_histogram(next_row, ROUTE_CHUNK_WARPS * E, mine, e);
    /* Each warp's first row per expert: the chunk's, plus the slots of the warps before it. */
#pragma unroll
    for (int q = 0; q < per_thread; q++) {
        const int i = threadIdx.x + q * ROUTE_CHUNK_WARPS * 32;
        if (i >= E) break;
        int row = first_row[q];
        for (int w = 0; w < ROUTE_CHUNK_WARPS; w++) {
            const int v = next_row[w * E + i];
            next_row[w * E + i] = row;
            row += v;
        }
    }
    __syncthreads();
    int32_t *slots = (int32_t *)(b + L.slots);
    float *slot_scale = (float *)(b + L.slot_scale);
    const unsigned lower = (1u << lane) - 1u;
#pragma unroll
    for (int u = 0; u < ROUTE_WARP_SLOTS / 32; u++) {
        /* The lanes of this round on the same expert, in lane (= slot) order. */
        const unsigned same = __match_any_sync(0xFFFFFFFFu, e[u]);
        if (e[u] >= 0) {
            const int j = c.j0 + w0 + 32 * u + lane;
            const int at = mine[e[u]] + __popc(same & lower);
            slots[at] = (c.src * sh.T_max) * sh.K + j;
            slot_scale[at] = scale[u];
        }
        __syncwarp();
        if (e[u] >= 0 && (same & lower) == 0) mine[e[u]] += __popc(same);
        __syncwarp();
    }
}

/* A forward with few slots (one process: plan_route ROUTE_ONE_KERNEL): count, offsets, tiles
 * and fill in one kernel, one block per (local expert, rank). Every block counts all of its rank's
 * experts itself in a shared-memory histogram (E_r ints of dynamic shared memory), so no block waits
 * for another and two kernel boundaries go. Same tables, same slot order as the three kernels. */
__global__ void sm90_route_small_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers,
                                        int order) {
    mm_wait_previous();
    extern __shared__ int hist[];
    __shared__ int sums[4][32];
    const int e = blockIdx.x, r = sh.first_rank + blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int i = threadIdx.x; i < sh.E_r; i += blockDim.x)
        hist[i] = 0;
    __syncthreads();
    for (int src = 0; src < sh.R; src++) {
        const uint8_t *b = peers[src];
        const int n = *(const int32_t *)(b + L.num_tokens) * sh.K;
        const int32_t *ids = (const int32_t *)(b + L.topk_ids);
        const uint8_t *state = b + L.token_state;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int local = ids[j] - r * sh.E_r;
            if (local >= 0 && local < sh.E_r && state[j / sh.K] == MM_TOKEN_LIVE) atomicAdd(&hist[local], 1);
        }
    }
    __syncthreads();
    /* Slots and tiles of the experts before e, and of all experts. */
    int v[4] = {0, 0, 0, 0};
    for (int i = threadIdx.x; i < sh.E_r; i += blockDim.x) {
        const int n = hist[i], t = (n + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS;
        if (i < e) v[0] += n, v[1] += t;
        v[2] += n, v[3] += t;
    }
    for (int k = 0; k < 4; k++) {
        for (int o = 16; o > 0; o >>= 1)
            v[k] += __shfl_xor_sync(0xFFFFFFFFu, v[k], o);
        if (lane == 0) sums[k][warp] = v[k];
    }
    __syncthreads();
    int slot_before = 0, tile_before = 0, slot_total = 0, tile_total = 0;
    for (int w = 0; w < nwarps; w++)
        slot_before += sums[0][w], tile_before += sums[1][w], slot_total += sums[2][w],
            tile_total += sums[3][w];
    uint8_t *b = peers[r];
    const int count = hist[e], tiles = (count + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS;
    if (threadIdx.x == 0) {
        ((int32_t *)(b + L.expert_count))[e] = count;
        ((int32_t *)(b + L.expert_offset))[e] = slot_before;
        if (e == 0) {
            ((int32_t *)(b + L.expert_offset))[sh.E_r] = slot_total;
            *(int32_t *)(b + L.num_tiles) = tile_total;
        }
    }
    for (int i = threadIdx.x; i < tiles; i += blockDim.x)
        route_tile_table(L, b).store(tile_before + i, e, i * MM_TILE_TOKENS, slot_before + i * MM_TILE_TOKENS,
                                     min(MM_TILE_TOKENS, count - i * MM_TILE_TOKENS));
    if (order) { /* this expert's tiles' places in the rank's tile order (plan_route_orders_tiles) */
        int32_t *ord = (int32_t *)(b + L.tile_order);
        for (int i = 0; i < tiles; i++) { /* tiles is the block's: every thread takes each turn */
            const int c = min(MM_TILE_TOKENS, count - i * MM_TILE_TOKENS);
            int before = 0, at;
            for (int x = threadIdx.x; x < sh.E_r; x += blockDim.x)
                before += tile_order_before(hist[x], x, e, i, c);
            block_exclusive_scan(before, &at);
            if (threadIdx.x == 0) ord[at] = tile_before + i;
        }
    }
    fill_expert(sh, L, peers, r * sh.E_r + e, (int32_t *)(b + L.slots) + slot_before,
                (float *)(b + L.slot_scale) + slot_before);
}

int sm90_route_plan(const mm_dev_shape &sh, long total_tokens) {
    return plan_route(sh.local_ranks == sh.R, sh.R, total_tokens, sh.K, sh.E_r, sh.H);
}

megamoe_status sm90_route_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                 int route, long total_slots, cudaStream_t s) {
    const int local_ranks = sh.local_ranks;
    const dim3 grid(sh.E_r, local_ranks);
    if (route == ROUTE_ONE_KERNEL) {
        MM_CUDA_TRY(mm_launch(sm90_route_small_kernel, grid, 256, (size_t)sh.E_r * 4, s, sh, L, peers,
                              plan_route_orders_tiles(route, sh.nvfp4, total_slots, sh.E)));
        return MEGAMOE_OK;
    }
    if (route ==
        ROUTE_CHUNKS) { /* the layout holds route_chunks exactly then (E_r <= MM_ROUTE_CHUNK_EXPERTS) */
        const dim3 chunks((unsigned)(sh.R * L.route_chunks_per_src), local_ranks);
        /* a count per local expert: the chunk's (count), each warp's (fill) */
        const size_t hist = (size_t)sh.E_r * sizeof(int);
        MM_CUDA_TRY(
            mm_launch(sm90_route_chunk_count_kernel, chunks, ROUTE_CHUNK_WARPS * 32, hist, s, sh, L, peers));
        MM_CUDA_TRY(cudaGetLastError());
        MM_CUDA_TRY(mm_launch(sm90_route_chunk_scan_kernel, local_ranks, 1024, 0, s, sh, L, peers));
        MM_CUDA_TRY(cudaGetLastError());
        MM_CUDA_TRY(mm_launch(sm90_route_chunk_fill_kernel, chunks, ROUTE_CHUNK_WARPS * 32,
                              ROUTE_CHUNK_WARPS * hist, s, sh, L, peers));
        MM_CUDA_TRY(cudaGetLastError());
        return MEGAMOE_OK;
    }
    MM_CUDA_TRY(mm_launch(sm90_route_count_kernel, grid, 256, 0, s, sh, L, peers));
    MM_CUDA_TRY(cudaGetLastError());
    MM_CUDA_TRY(mm_launch(sm90_route_tiles_kernel, local_ranks, 256, 0, s, sh, L, peers));
    MM_CUDA_TRY(cudaGetLastError());
    MM_CUDA_TRY(mm_launch(sm90_route_fill_kernel, grid, 256, 0, s, sh, L, peers));
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
