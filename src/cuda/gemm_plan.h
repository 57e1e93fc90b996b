/*
 * gemm_plan.h -- the decisions a forward's expert GEMMs take from the group's slot count and the
 * shape only (so y does not depend on R or on the number of GPUs): the split-K plans of the
 * mma.sync and streaming kernels and the choice between the kernels. Plain C as well as CUDA, so
 * the host tests check their invariants (tests/test_plan.c), among them that the partial sums they
 * plan fit the split-K workspace.
 */
#ifndef MEGAMOE_GEMM_PLAN_H
#define MEGAMOE_GEMM_PLAN_H

#include "internal.h" /* MM_TILE_TOKENS, MM_SPLITK_ENTRIES */

#ifdef __CUDACC__
#define MM_PLAN_FN __host__ __device__ inline
#else
#define MM_PLAN_FN static inline
#endif

/* Split-K plan for a forward: when the tiles are too few to fill the GPU (decode), K is split. It is a
 * function of the global token count and the shape only, never of R or of which rank computes it, so
 * y stays bitwise independent of R and of the number of GPUs. ws_tiles bounds a rank's tiles. */
typedef struct splitk_plan {
    int splits, ws_tiles;
} splitk_plan;

/* The plans' GPU: 132 SMs fixed, so that no plan (and no y) depends on the GPU it runs on. */
#define MM_PLAN_SMS 132

/* The tile order the streaming kernel walks its items in where the routing writes one
 * (sm90_route_orders_tiles): tiles by tokens, most first, ties by (expert, tile) -- so the persistent
 * blocks take the heaviest items in their first round and the lightest last, and finish closer
 * together (longest processing time first). A tile's position: the tiles with more tokens, and those
 * with as many of an earlier expert or an earlier tile of its own. This is expert x's share of it
 * (x holds n tokens: n / 64 full tiles and one of n % 64); tile i of expert e holds c tokens. */
MM_PLAN_FN int tile_order_before(int n, int x, int e, int i, int c) {
    const int full = n / MM_TILE_TOKENS, rem = n % MM_TILE_TOKENS;
    int before = (c < MM_TILE_TOKENS ? full : 0) + (rem > c ? 1 : 0);
    if (x < e) before += (c == MM_TILE_TOKENS ? full : 0) + (rem > 0 && rem == c ? 1 : 0);
    if (x == e && c == MM_TILE_TOKENS) before += i; /* its own full tiles before tile i */
    return before;
}

/* At most the tiles of a rank: one partial tile per active expert plus the full ones. */
MM_PLAN_FN int plan_tile_bound(long slots, int E) {
    return (int)(slots < E ? slots : E) + (int)((slots + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS);
}

/* The splits wanted before the plan's fallback to 1 (which only lowers them). They never grow with
 * the token count, so at a rank's own count they bound what the group's count can plan. */
MM_PLAN_FN int splitk_wanted(long slots, int E, int y, int nkc) {
    const int active = (int)(slots < E ? slots : E);
    const int target = 4 * MM_PLAN_SMS, blocks = active * y > 0 ? active * y : 1;
    int sp = (target + blocks - 1) / blocks;
    sp = sp < nkc / 8 ? sp : nkc / 8;
    return sp < 8 ? sp : 8;
}

MM_PLAN_FN splitk_plan plan_splitk(long slots, int E, int y, int nkc) {
    const int ws_tiles = plan_tile_bound(slots, E);
    int sp = splitk_wanted(slots, E, y, nkc);
    if (sp < 2 || (long)y * ws_tiles * sp > MM_SPLITK_ENTRIES) sp = 1;
    const splitk_plan plan = {sp, ws_tiles};
    return plan;
}

/* Which kernel runs the expert GEMMs of a forward: for NVFP4 the streaming kernel up to 8 tokens per
 * expert on average, wgmma above; for BF16 wgmma when the experts average 4 tokens or more and no K
 * split is planned (measured: wgmma already matches mma.sync at 4 and wins from 16), mma.sync below.
 * A function of the global token count and the shape only, like the split-K plans, so y does not
 * depend on R or on the number of GPUs. `force` (from megamoe_layer_config.gemm_kernel, for tests
 * and benchmarks) overrides it for every rank. */
enum { GEMM_AUTO = 0, GEMM_MMA = 1, GEMM_WGMMA = 2, GEMM_STREAM = 3, GEMM_WS = 4, GEMM_WS64 = 5 };
/* The warp-specialized kernel (sm90_expert_ws.cu, blocks of 256 rows x 128 tokens) from this many
 * tokens per expert on average; for NVFP4 only when both K are long (min_k = min(H, I) >= 2048).
 * Measured (H200, 2026-11-29, session 6 calls 2-4, ms ws / wgmma): NVFP4 DSv3 T = 512 (16 per expert)
 * 4.29 / 3.38, T = 2048 (64) 5.68 / 6.01, T = 8192 16.9 / 20.6; Mixtral T = 128 (32) 0.573 / 0.559,
 * T = 512 (128) 1.30 / 1.47, T = 8192 13.5 / 17.2; Qwen3 (I = 768: 12 K steps in the down
 * projection) T = 2048 1.06 / 0.93, T = 8192 3.51 / 3.19. BF16: DSv3 T = 2048 7.13 / 8.77, Qwen3
 * T = 2048 1.06 / 1.08, T = 8192 3.42 / 3.78, Mixtral T = 8192 16.4 / 20.4. */
#ifndef MM_WS_MIN_TOKENS
#define MM_WS_MIN_TOKENS 64
#endif
#define MM_WS_ROWS 256 /* weight rows per warp-specialized block */
/* The warp-specialized kernel's block order (item -> tile of the tile list, row block): groups of
 * MM_WS_GROUP tiles, and within a group every row block for each of the group's tiles in turn, so a
 * group's tokens stay in L2 while the row blocks pass and each row block's weights serve the group's
 * tiles of one expert from L2 (measured: 16 beat 1 and 64, BENCHMARKS sixth session). Items
 * 0 .. nrb * tiles - 1 cover every (tile, row block) once (tests/test_plan.c). */
#ifndef MM_WS_GROUP
#define MM_WS_GROUP 16
#endif
MM_PLAN_FN void ws_item_place(int item, int nrb, int tiles, int *tile, int *rb) {
    const int group = item / (MM_WS_GROUP * nrb), in_group = item % (MM_WS_GROUP * nrb);
    const int left = tiles - group * MM_WS_GROUP, group_tiles = left < MM_WS_GROUP ? left : MM_WS_GROUP;
    *tile = group * MM_WS_GROUP + in_group % group_tiles;
    *rb = in_group / group_tiles;
}
/* The warp-specialized kernel on 64-token blocks (GEMM_WS64) below MM_WS_MIN_TOKENS per expert:
 * NVFP4 above 16 per expert when both K are 4096 or more; BF16 from 4 per expert (in place of the
 * wgmma kernel and mma.sync split-K). Measured (H200, session 7 call 3, ms ws64 / the choice before):
 * NVFP4
 * Mixtral T = 96 (24 per expert) 0.487 / 0.518, T = 128 0.508 / 0.557, T = 160 0.525 / 0.576,
 * T = 192 (48) 0.548 / 0.621, but T = 256 (64, ws) 0.830 / 0.688, T = 64 (16) 0.587 / 0.495 (call 2);
 * DSv3 (min(H, I) = 2048) T = 1024 (32) 5.09 / 3.81 (call 2). BF16: DSv3 T = 128 / 512 / 1024 4.88 /
 * 5.19 / 5.50 against 4.95 / 5.36 / 5.89; Qwen3 0.333 / 0.406 / 0.577 against 0.351 / 0.436 / 0.579;
 * Mixtral 0.688 / 1.369 against 1.121 / 1.504 at T = 128 / 512. BF16 takes it when mma.sync would split
 * K as well (session 8 call 1, H200, Mixtral T = 32 / 128 / 256: 0.655 / 0.692 / 0.893 ms against
 * mma.sync split-K 0.728 / 1.102 / 1.591; DSv3 and Qwen3, never split there, unchanged). */
MM_PLAN_FN int gemm_choice(int force, long slots, int E, int splits, int nvfp4, int min_k) {
    if (force == GEMM_MMA || force == GEMM_WGMMA || force == GEMM_WS || force == GEMM_WS64) return force;
    if (force == GEMM_STREAM) return nvfp4 ? GEMM_STREAM : GEMM_MMA; /* the streaming kernel is NVFP4 only */
    if (slots >= (long)MM_WS_MIN_TOKENS * E && (nvfp4 ? min_k >= 2048 : splits == 1)) return GEMM_WS;
    /* NVFP4: streaming up to 8 tokens per expert on average (measured 2026-11-29, H200: at 4-8 it
     * beats wgmma by 8-27%, at 16 and 32 it loses by 30-55%). */
    if (nvfp4) {
        if (slots <= 8L * E) return GEMM_STREAM;
        return min_k >= 4096 && slots > 16L * E ? GEMM_WS64 : GEMM_WGMMA;
    }
    return slots >= 4L * E ? GEMM_WS64 : GEMM_MMA;
}
/* The order of the kernels along the token count (the choice never goes down as it grows): the
 * few-token kernels (mma.sync, streaming), wgmma, the warp-specialized kernel on 64-token blocks,
 * on 128-token blocks. */
MM_PLAN_FN int gemm_rank(int kernel) {
    return kernel == GEMM_WS ? 3 : kernel == GEMM_WS64 ? 2 : kernel == GEMM_WGMMA ? 1 : 0;
}

/* The streaming kernel's split-K (sm90_expert_stream.cu): its persistent blocks walk work items of
 * (tile, 128-row slab, K split). K is split only when the (tile, slab) pairs are too few to give
 * every resident block an item, and then into as many splits as keep the items within one per
 * resident block (so no block waits on a second item; the last warp to store a split adds them
 * up, which costs ~2 us per item), each split keeping 8 or more K steps, at most 16 splits, and only
 * while the partial sums ([splits, slabs, slots, 128] f32) fit the split-K workspace and the
 * per-(tile, slab, warp) counters fit theirs. Like plan_splitk, a function of the group's slot
 * count and the shape only: `active` estimates the tiles from the slot count.
 * Measured (H200, DSv3 T = 1): 2 splits of gate/up and none of down, 0.106 ms, against 9 and 4 splits
 * with a finish kernel per phase (an item target of 2112), 0.119 ms, and no split, 0.125 ms. */
#ifndef MM_STREAM_BLOCKS_PER_SM
#define MM_STREAM_BLOCKS_PER_SM 4   /* persistent streaming blocks per SM (overridable for experiments) */
#endif
#ifndef MM_STREAM_TARGET_ITEMS /* the resident blocks */
#define MM_STREAM_TARGET_ITEMS ((long)MM_STREAM_BLOCKS_PER_SM * MM_PLAN_SMS)
#endif
#define MM_STREAM_WARPS 4 /* consumer warps per streaming block: split-K counters per (tile, slab) */
#ifndef MM_STREAM_MIN_SPLIT_STEPS
#define MM_STREAM_MIN_SPLIT_STEPS 8 /* K steps per split at least (an experiment at 4: Qwen3's down
                                     * projection, 12 steps, is never split at 8, so at T = 1 only its
                                     * 128 (tile, slab) items of the 528 blocks stream) */
#endif
MM_PLAN_FN int plan_stream_splits(long slots, int E, int y, int nkc) {
    const long active = slots < E ? slots : E;
    if (active <= 0) return 1;
    const long target = MM_STREAM_TARGET_ITEMS, items = active * y;
    long sp = target / items;
    if (sp > nkc / MM_STREAM_MIN_SPLIT_STEPS) sp = nkc / MM_STREAM_MIN_SPLIT_STEPS;
    if (sp > 16) sp = 16;
    const long fit = (long)MM_SPLITK_ENTRIES * 64 / ((long)y * slots); /* workspace: ENTRIES x 128 x 64 f32 */
    if (sp > fit) sp = fit;
    /* plan_tile_bound in long arithmetic: the int form changes this kernel's SASS, not yet run on a GPU */
    const long tiles = active + (slots + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS;
    if (tiles * y * MM_STREAM_WARPS > MM_SPLITK_ENTRIES) sp = 1;
    return sp < 2 ? 1 : (int)sp;
}

/* One streaming block per SM more (5, with a ring of 6 stages instead of 8), for an unsplit phase
 * whose items would leave a short second round on 4 per SM but fit 5: the items are estimated as the
 * phase's slabs times the local experts that uniform routing of `slots` slots reaches, E_loc (1 -
 * (1 - 1/E)^slots). Measured (H200, session 11 call 1, the whole build at 5 x 6): Qwen3-like T = 8
 * (~600 gate/up items) 0.0899 -> 0.0848 ms; T = 32 (3 rounds either way) unchanged; where it split
 * or streamed long slabs (T = 1, Mixtral-like) 6 stages lost 2-14%, hence only here. */
MM_PLAN_FN int plan_stream_more_blocks(long slots, int E, int E_loc, int y, int nkc, int sms) {
    if (slots <= 0 || E <= 0 || plan_stream_splits(slots, E, y, nkc) > 1) return 0;
    double miss = 1.0; /* (1 - 1/E)^slots by squaring: no libm in device-compiled plan code */
    for (double b = 1.0 - 1.0 / E; slots > 0; slots >>= 1, b *= b)
        if (slots & 1) miss *= b;
    const double items = E_loc * (1.0 - miss) * y;
    return items > (double)MM_STREAM_BLOCKS_PER_SM * sms && items <= (double)(MM_STREAM_BLOCKS_PER_SM + 1) * sms;
}

/* The streaming kernel's K loop not unrolled (its own instantiation, launched per phase) where the
 * phase's splits stream fewer than MM_STREAM_ROLL_BELOW K steps: Qwen3-like gate/up at T = 1 (8 steps
 * of 4 splits) and down at every T (12). A decode forward fetches the kernel's code cold after the
 * L2 flush, and the unrolled loop is MM_STREAM_UNROLL steps' code. Measured (H200, session 12 call 2,
 * graph replay + L2 flush, twice each): Qwen3-like T = 1 0.0412 -> 0.0377 ms, T = 8-128 within 1%
 * (0.0778 / 0.0785, 0.1473 / 0.1481, 0.1829 / 0.1830); the other shapes never take it. Unrolling
 * everywhere at 1 instead (session 11 call 9): Qwen3 T = 1 0.0401, but DSv3 T = 8-32 4% slower; a
 * run-time choice between both loops inside one kernel: 2% slower at T = 1. */
#ifndef MM_STREAM_ROLL_BELOW
#define MM_STREAM_ROLL_BELOW 16 /* 0: never */
#endif
MM_PLAN_FN int plan_stream_rolled(long slots, int E, int y, int nkc) {
    return nkc / plan_stream_splits(slots, E, y, nkc) < MM_STREAM_ROLL_BELOW;
}

/* The NVFP4 wgmma kernel's split-K (sm90_expert_wgmma.cu): blocks of 256 weight rows x one token
 * tile, 2 resident per SM. With few experts and a long K (Mixtral-like down projection, 16-64 tokens
 * per expert: 8 tiles x 16 row blocks = 128 blocks of 224 K steps) the blocks are fewer than the
 * resident slots and the weights stream through half the GPU; then K is split into as many parts as
 * keep the blocks within one resident wave, each 8 K steps or more, at most 8, and only while the
 * partial sums (64 KB per block and split: two workspace entries) and the counters fit. The tiles
 * are estimated from the slot count (each active expert at least one, at most 64 tokens each);
 * the wanted splits never grow with the slot count, so a rank's own count bounds the group's (NCCL). */
#define MM_WGMMA_ROWS 256           /* weight rows per wgmma block */
#define MM_WGMMA_RESIDENT (2 * MM_PLAN_SMS) /* NVFP4 wgmma blocks resident */
MM_PLAN_FN int wgmma_splits_wanted(long slots, int E, int y, int nkc) {
    const long active = slots < E ? slots : E, full = (slots + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS;
    const long tiles = active > full ? active : full, blocks = tiles * y > 0 ? tiles * y : 1;
    long sp = MM_WGMMA_RESIDENT / blocks;
    if (sp > nkc / 8) sp = nkc / 8;
    return sp > 8 ? 8 : sp < 1 ? 1 : (int)sp;
}
MM_PLAN_FN splitk_plan plan_wgmma_splits(long slots, int E, int y, int nkc) {
    const int ws_tiles = plan_tile_bound(slots, E);
    int sp = wgmma_splits_wanted(slots, E, y, nkc);
    if (sp < 2 || 2L * y * ws_tiles * sp > MM_SPLITK_ENTRIES) sp = 1;
    const splitk_plan plan = {sp, ws_tiles};
    return plan;
}

#endif /* MEGAMOE_GEMM_PLAN_H */
