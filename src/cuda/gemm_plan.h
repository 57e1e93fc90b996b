/*
 * gemm_plan.h -- the decisions a forward's expert GEMMs take from the group's slot count and the
 * shape only (so y does not depend on R or on the number of GPUs): the choice between the kernels
 * (dispatch.cu's table), the split-K plans of the mma.sync, wgmma and streaming kernels, the
 * streaming kernel's variants, the warp-specialized kernel's block order and the streaming kernel's
 * tile order. Plain C as well as CUDA, so
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

#define MM_MMA_ROWS 128 /* weight rows per mma.sync block: plan_splitk's row blocks (y = rows / 128) */
MM_PLAN_FN splitk_plan plan_splitk(long slots, int E, int y, int nkc) {
    const int ws_tiles = plan_tile_bound(slots, E);
    int sp = splitk_wanted(slots, E, y, nkc);
    if (sp < 2 || (long)y * ws_tiles * sp > MM_SPLITK_ENTRIES) sp = 1;
    const splitk_plan plan = {sp, ws_tiles};
    return plan;
}

/* Which kernel runs the expert GEMMs of a forward (dispatch.cu's table): NVFP4 the streaming kernel
 * up to 16 tokens per expert on average, then wgmma, the warp-specialized kernel on 64-token blocks
 * (ws64) where both K are long, and on 128-token blocks (ws) from 64 per expert; BF16 mma.sync below
 * 4 tokens per expert, ws64 from 4, ws from 64 where mma.sync plans no K split. A function of the global token count and the shape only, like the split-K plans, so y does not
 * depend on R or on the number of GPUs. `force` (from megamoe_layer_config.gemm_kernel, for tests
 * and benchmarks) overrides it for every rank. The values are those of megamoe_gemm_kernel. */
enum {
    GEMM_AUTO = MEGAMOE_GEMM_AUTO,
    GEMM_MMA = MEGAMOE_GEMM_MMA,
    GEMM_WGMMA = MEGAMOE_GEMM_WGMMA,
    GEMM_STREAM = MEGAMOE_GEMM_STREAM,
    GEMM_WS = MEGAMOE_GEMM_WS,
    GEMM_WS64 = MEGAMOE_GEMM_WS64
};
/* The warp-specialized kernel (sm90_expert_ws.cu, blocks of 256 rows x 128 tokens) from this many
 * tokens per expert on average: NVFP4 at any K (at a short K, Qwen3-like I = 768, its walking grid
 * beats wgmma from here; one-item blocks there would lose below 256 per expert), BF16 when K is not
 * split. Measurements: DECISIONS. */
#define MM_WS_MIN_TOKENS 64
#define MM_WS_ROWS 256 /* weight rows per warp-specialized block */
/* On one process the NVFP4 ws down projection walks (one block per SM taking items from a counter)
 * when its K (= I) is below this: its items are short there (Qwen3-like I = 768: 12 K steps), so
 * their fill and epilogue weigh most; at Mixtral-like I = 14336 the walk lost. Gate/up always walks
 * (NVFP4 and BF16). Measurements: DECISIONS. */
#define MM_WS_DOWN_WALK_MAX_K 2048
/* The warp-specialized kernel's block order (item -> tile of the tile list, row block): groups of
 * MM_WS_GROUP tiles, and within a group every row block for each of the group's tiles in turn, so a
 * group's tokens stay in L2 while the row blocks pass and each row block's weights serve the group's
 * tiles of one expert from L2 (16 beats 1 and 64: DECISIONS). Items
 * 0 .. nrb * tiles - 1 cover every (tile, row block) once (tests/test_plan.c). */
#define MM_WS_GROUP 16
MM_PLAN_FN void ws_item_place(int item, int nrb, int tiles, int *tile, int *rb) {
    const int group = item / (MM_WS_GROUP * nrb), in_group = item % (MM_WS_GROUP * nrb);
    const int left = tiles - group * MM_WS_GROUP, group_tiles = left < MM_WS_GROUP ? left : MM_WS_GROUP;
    *tile = group * MM_WS_GROUP + in_group % group_tiles;
    *rb = in_group / group_tiles;
}
/* The warp-specialized kernel on 64-token blocks (GEMM_WS64) below MM_WS_MIN_TOKENS per expert:
 * NVFP4 above 16 per expert when both K are 4096 or more; BF16 from 4 per expert (in place of the
 * wgmma kernel and mma.sync split-K, including where mma.sync would split K). Measurements: DECISIONS. */
#define MM_STREAM_MAX_AVG 16 /* the streaming kernel up to this many slots per expert on average */
MM_PLAN_FN int gemm_choice(int force, long slots, int E, int splits, int nvfp4, int min_k) {
    if (force == GEMM_MMA || force == GEMM_WGMMA || force == GEMM_WS || force == GEMM_WS64) return force;
    if (force == GEMM_STREAM) return nvfp4 ? GEMM_STREAM : GEMM_MMA; /* the streaming kernel is NVFP4 only */
    if (slots >= (long)MM_WS_MIN_TOKENS * E && (nvfp4 || splits == 1)) return GEMM_WS;
    /* NVFP4: streaming up to MM_STREAM_MAX_AVG tokens per expert on average (where it beats wgmma:
     * DECISIONS). */
    if (nvfp4) {
        if (slots <= (long)MM_STREAM_MAX_AVG * E) return GEMM_STREAM;
        return min_k >= 4096 ? GEMM_WS64 : GEMM_WGMMA;
    }
    return slots >= 4L * E ? GEMM_WS64 : GEMM_MMA;
}
/* The NVFP4 ws kernel on 128-token blocks below MM_WS_SPLIT_N_BELOW slots per expert on average
 * splits its m64n128 wgmma into m64n64 + m64n32 + m64n32, each part past the item's tokens skipped
 * (there most items hold 40-90 tokens); from there on one m64n128 (split, full items cost 3-5%
 * more). y is the same either way. DECISIONS 58. */
#define MM_WS_SPLIT_N_BELOW 128
MM_PLAN_FN int ws_split_n(long slots, int E) {
    return slots < (long)MM_WS_SPLIT_N_BELOW * E;
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
 * (DECISIONS: this plan against more splits with a finish kernel per phase, and against none.) */
#define MM_STREAM_BLOCKS_PER_SM 4 /* persistent streaming blocks per SM */
#define MM_STREAM_TARGET_ITEMS ((long)MM_STREAM_BLOCKS_PER_SM * MM_PLAN_SMS) /* the resident blocks */
#define MM_STREAM_WARPS 4 /* consumer warps per streaming block: split-K counters per (tile, slab) */
#define MM_STREAM_MIN_SPLIT_STEPS 8 /* K steps per split at least */
MM_PLAN_FN int plan_stream_splits(long slots, int E, int y, int nkc) {
    const long active = slots < E ? slots : E;
    if (active <= 0) return 1;
    const long target = MM_STREAM_TARGET_ITEMS, items = active * y;
    long sp = target / items;
    if (sp > nkc / MM_STREAM_MIN_SPLIT_STEPS) sp = nkc / MM_STREAM_MIN_SPLIT_STEPS;
    if (sp > 16) sp = 16;
    const long fit = (long)MM_SPLITK_ENTRIES * 64 / ((long)y * slots); /* workspace: ENTRIES x 128 x 64 f32 */
    if (sp > fit) sp = fit;
    /* plan_tile_bound in long arithmetic (the int form compiles the streaming kernel differently) */
    const long tiles = active + (slots + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS;
    if (tiles * y * MM_STREAM_WARPS > MM_SPLITK_ENTRIES) sp = 1;
    return sp < 2 ? 1 : (int)sp;
}

/* One streaming block per SM more (5, with a ring of 6 stages instead of 8), for an unsplit phase
 * whose items would leave a short second round on 4 per SM but fit 5: the items are estimated as the
 * phase's slabs times the local experts that uniform routing of `slots` slots reaches, E_loc (1 -
 * (1 - 1/E)^slots). Only here: where a phase splits or streams long slabs the shorter ring loses
 * (DECISIONS). */
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
 * L2 flush, and the unrolled loop is MM_STREAM_UNROLL steps' code (DECISIONS: against unrolling
 * everywhere at 1, and against a run-time choice inside one kernel). */
#define MM_STREAM_ROLL_BELOW 16
MM_PLAN_FN int plan_stream_rolled(long slots, int E, int y, int nkc) {
    return nkc / plan_stream_splits(slots, E, y, nkc) < MM_STREAM_ROLL_BELOW;
}

/* The streaming kernel's instantiation for a phase (sm90_expert_stream.cu; the numerics are the same
 * in each): above MM_STREAM_WIDE_ABOVE slots per expert on average the grouped layout on 32-token
 * chunks (tiles of up to 32 tokens stream their weights once, not once per 16 tokens: DECISIONS),
 * 3 blocks per SM; from MM_STREAM_GROUPED_MIN_AVG the grouped ring layout, else the per-slot layout
 * with one block per SM more (plan_stream_more_blocks), or with the K loop not unrolled
 * (plan_stream_rolled), or plain. */
enum {
    STREAM_PER_SLOT = 0,
    STREAM_GROUPED = 1,
    STREAM_MORE_BLOCKS = 2,
    STREAM_ROLLED = 3,
    STREAM_WIDE = 4,
    STREAM_VARIANTS = 5
};
#define MM_STREAM_GROUPED_MIN_AVG 4
#define MM_STREAM_WIDE_ABOVE 8
MM_PLAN_FN int plan_stream_variant(long slots, int E, int E_loc, int y, int nkc, int sms) {
    if (slots > (long)MM_STREAM_WIDE_ABOVE * E) return STREAM_WIDE;
    if (slots >= (long)MM_STREAM_GROUPED_MIN_AVG * E) return STREAM_GROUPED;
    if (plan_stream_more_blocks(slots, E, E_loc, y, nkc, sms)) return STREAM_MORE_BLOCKS;
    if (plan_stream_rolled(slots, E, y, nkc)) return STREAM_ROLLED;
    return STREAM_PER_SLOT;
}

/* Which routing builds a forward's tables (dispatch.cu's table; every one writes the same tables
 * from the staged ids: DECISIONS 90). In one process, where the host knows the group's token count:
 * one warp of the stage block for a single token of one rank (route_one_warp: K <= 32 lanes, a warp
 * more in the stage block), one kernel up to MM_ROUTE_ONE_KERNEL_SLOTS slots (a shared count per
 * local expert). Else -- and always across GPUs -- count / scan / fill over chunks of slots where a
 * block holds a count per local expert and warp (E_r <= MM_ROUTE_CHUNK_EXPERTS), else count / tiles /
 * fill per expert (no bound on E_r). stage_threads: plan_stage_threads. */
enum { ROUTE_WARP = 0, ROUTE_ONE_KERNEL = 1, ROUTE_CHUNKS = 2, ROUTE_PER_EXPERT = 3 };
#define MM_ROUTE_WARP_EXPERTS 1024       /* experts per rank route_one_warp walks (32 per lane round) */
#define MM_ROUTE_ONE_KERNEL_SLOTS 1024   /* over it the chunks are faster (DECISIONS 89) */
#define MM_ROUTE_ONE_KERNEL_EXPERTS 8192 /* its shared count per expert: 32 KB */
/* The stage kernel's threads: one per 16-value block of a token (448 for H = 7168), 64 to 1024. */
MM_PLAN_FN int plan_stage_threads(int H) {
    const int nb = H / 16;
    return nb < 64 ? 64 : nb > 1024 ? 1024 : (nb + 31) / 32 * 32;
}
MM_PLAN_FN int plan_route(int one_process, int R, long total_tokens, int K, int E_r, int H) {
    if (one_process && R == 1 && total_tokens <= 1 && K <= 32 && E_r <= MM_ROUTE_WARP_EXPERTS &&
        plan_stage_threads(H) + 32 <= 1024)
        return ROUTE_WARP;
    if (one_process && total_tokens * K <= MM_ROUTE_ONE_KERNEL_SLOTS && E_r <= MM_ROUTE_ONE_KERNEL_EXPERTS)
        return ROUTE_ONE_KERNEL;
    return E_r <= MM_ROUTE_CHUNK_EXPERTS ? ROUTE_CHUNKS : ROUTE_PER_EXPERT;
}
/* Whether the routing also writes the tile order the streaming kernel walks (tile_order_before): the
 * one-kernel routing of an NVFP4 forward in the streaming kernel's regime (gemm_choice) with more
 * than one round of items per block to even out (from 128 slots). */
MM_PLAN_FN int plan_route_orders_tiles(int route, int nvfp4, long slots, int E) {
    return route == ROUTE_ONE_KERNEL && nvfp4 && slots >= 128 && slots <= (long)MM_STREAM_MAX_AVG * E;
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
