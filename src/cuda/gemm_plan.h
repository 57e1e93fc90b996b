/*
 * gemm_plan.h -- every choice a forward's expert GEMMs make, as plain C that the host tests check
 * (tests/test_plan.c): the rules (which kernel, split-K, the streaming kernel's variants, the
 * warp-specialized kernel's block order and walk, the routing and its tile order, the combine's form),
 * each threshold with its reason, and the plan they add up to -- plan_gemm turns a forward's shape and
 * slot counts (gemm_desc) into a value (gemm_plan: per phase, the launches with their family, instance,
 * splits, walk, split-N and grid) that dispatch.cu executes. Every rule is a function of the group's
 * slot count and the shape only (never of R or of which rank computes), so y is bitwise the same for
 * any R and number of GPUs. With NCCL only the device knows the group's count: the plan then holds
 * every launch the group's count may need, and each kernel takes the choice on the device from the
 * rules plan_gemm_phase composes on the host (gemm/fragments.cuh gemm_device_choice), leaving unless
 * it is the one.
 */
#ifndef MEGAMOE_GEMM_PLAN_H
#define MEGAMOE_GEMM_PLAN_H

#include <string.h>

#include "internal.h"      /* MM_TILE_TOKENS, MM_SPLITK_ENTRIES */
#include "weight_layout.h" /* MM_FRAG_K: the K step */

#ifdef __CUDACC__
#define MM_PLAN_FN __host__ __device__ inline
#define MM_PLAN_INLINE __host__ __device__ __forceinline__ /* inlined as the caller's own code (its SASS) */
/* also in the instance tables' constant expressions */
#define MM_PLAN_RULE __host__ __device__ constexpr inline
#define MM_PLAN_HOST static inline
#else
#define MM_PLAN_FN static inline
#define MM_PLAN_INLINE static inline
#define MM_PLAN_RULE static inline
#define MM_PLAN_HOST static inline
#endif

enum { PHASE_GATE_UP = 0, PHASE_DOWN = 1 };

/* Split-K plan for a forward: when the tiles are too few to fill the GPU (decode), K is split. It is a
 * function of the global token count and the shape only, never of R or of which rank computes it, so
 * y stays bitwise independent of R and of the number of GPUs. ws_tiles bounds a rank's tiles. */
typedef struct splitk_plan {
    int splits, ws_tiles;
} splitk_plan;

/* The plans' GPU: 132 SMs fixed, so that no plan (and no y) depends on the GPU it runs on. */
#define MM_PLAN_SMS 132

/* The tile order the streaming kernel walks its items in where the routing writes one
 * (plan_route_orders_tiles): tiles by tokens, most first, ties by (expert, tile) -- so the persistent
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

/* Which kernel runs a phase's expert GEMMs (dispatch.cu's table), from the group's slots per expert:
 * NVFP4 the streaming kernel up to MM_STREAM_MAX_AVG, then wgmma -- or, where both K are long, the
 * warp-specialized kernel on 64-token blocks (ws64) -- and the warp-specialized kernel on 128-token
 * blocks (ws) from MM_WS_MIN_TOKENS; BF16 mma.sync below MM_BF16_WS64_MIN_AVG, ws64 from there, ws
 * from MM_WS_MIN_TOKENS where mma.sync plans no K split. override_kernel (megamoe_layer_config.
 * gemm_kernel: tests and benchmarks) replaces the rule for every rank. The values are those of
 * megamoe_gemm_kernel. Measurements: DECISIONS. */
enum {
    GEMM_AUTO = MEGAMOE_GEMM_AUTO,
    GEMM_MMA = MEGAMOE_GEMM_MMA,
    GEMM_WGMMA = MEGAMOE_GEMM_WGMMA,
    GEMM_STREAM = MEGAMOE_GEMM_STREAM,
    GEMM_WS = MEGAMOE_GEMM_WS,
    GEMM_WS64 = MEGAMOE_GEMM_WS64
};
#define MM_WS_ROWS 256 /* weight rows per warp-specialized block */
/* ws from here: its walking grid beats wgmma even at a short K (Qwen3-like I = 768) */
#define MM_WS_MIN_TOKENS 64
#define MM_STREAM_MAX_AVG 16 /* NVFP4 streaming up to here: weight-bandwidth bound, it beats wgmma there */
/* NVFP4 ws64 (not wgmma) where both K reach this: long items amortize its fill */
#define MM_WS64_MIN_K 4096
#define MM_BF16_WS64_MIN_AVG 4 /* BF16 ws64 from here, in place of wgmma and mma.sync split-K */
MM_PLAN_FN int gemm_choice(int override_kernel, long slots, int E, int splits, int nvfp4, int min_k) {
    if (override_kernel == GEMM_MMA || override_kernel == GEMM_WGMMA || override_kernel == GEMM_WS ||
        override_kernel == GEMM_WS64)
        return override_kernel;
    if (override_kernel == GEMM_STREAM)
        return nvfp4 ? GEMM_STREAM : GEMM_MMA; /* the streaming kernel is NVFP4 only */
    if (slots >= (long)MM_WS_MIN_TOKENS * E && (nvfp4 || splits == 1)) return GEMM_WS;
    if (nvfp4) {
        if (slots <= (long)MM_STREAM_MAX_AVG * E) return GEMM_STREAM;
        return min_k >= MM_WS64_MIN_K ? GEMM_WS64 : GEMM_WGMMA;
    }
    return slots >= (long)MM_BF16_WS64_MIN_AVG * E ? GEMM_WS64 : GEMM_MMA;
}
/* The warp-specialized kernel's walk (one block per SM taking items from a counter) or one block per
 * item: always across GPUs (the host knows only a bound of the items) and for gate/up (its epilogue,
 * staged in a tile of its own, overlaps the next item's fill); the NVFP4 down projection where its K
 * (= I) is short, its items' fill and epilogue weighing most there. */
/* NVFP4 down walks below this I: at Mixtral-like I = 14336 the walk lost */
#define MM_WS_DOWN_WALK_MAX_K 2048
MM_PLAN_FN int ws_walks(int nccl, int phase, int nvfp4, int I) {
    return nccl || phase == PHASE_GATE_UP || (nvfp4 && I < MM_WS_DOWN_WALK_MAX_K);
}
/* The warp-specialized kernel's block order (item -> tile of the tile list, row block): groups of
 * MM_WS_GROUP tiles, and within a group every row block for each of the group's tiles in turn, so a
 * group's tokens stay in L2 while the row blocks pass and each row block's weights serve the group's
 * tiles of one expert from L2. Items 0 .. nrb * tiles - 1 cover every (tile, row block) once
 * (tests/test_plan.c). */
#define MM_WS_GROUP 16 /* tiles per group: 16 beats 1 and 64 (DECISIONS) */
MM_PLAN_FN void ws_item_place(int item, int nrb, int tiles, int *tile, int *rb) {
    const int group = item / (MM_WS_GROUP * nrb), in_group = item % (MM_WS_GROUP * nrb);
    const int left = tiles - group * MM_WS_GROUP, group_tiles = left < MM_WS_GROUP ? left : MM_WS_GROUP;
    *tile = group * MM_WS_GROUP + in_group % group_tiles;
    *rb = in_group / group_tiles;
}
/* The NVFP4 ws kernel on 128-token blocks below MM_WS_SPLIT_N_BELOW slots per expert on average
 * splits its m64n128 wgmma into m64n64 + m64n32 + m64n32, each part past the item's tokens skipped
 * (there most items hold 40-90 tokens); from there on one m64n128. y is the same either way. */
#define MM_WS_SPLIT_N_BELOW 128 /* split, full items cost 3-5% more (DECISIONS 58) */
MM_PLAN_FN int ws_split_n(long slots, int E) { return slots < (long)MM_WS_SPLIT_N_BELOW * E; }
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
    return items > (double)MM_STREAM_BLOCKS_PER_SM * sms &&
           items <= (double)(MM_STREAM_BLOCKS_PER_SM + 1) * sms;
}

/* The streaming kernel's K loop not unrolled (its own instantiation, launched per phase) where the
 * phase's splits stream fewer than MM_STREAM_ROLL_BELOW K steps: Qwen3-like gate/up at T = 1 (8 steps
 * of 4 splits) and down at every T (12). A decode forward fetches the kernel's code cold after the
 * L2 flush, and the unrolled loop is MM_STREAM_UNROLL steps' code (DECISIONS: against unrolling
 * everywhere at 1, and against a run-time choice inside one kernel). */
/* K steps per split below which the loop's code, fetched cold, outweighs unrolling */
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
/* grouped from here: faster from ~4 per expert, slower at ~1 (DECISIONS 35) */
#define MM_STREAM_GROUPED_MIN_AVG 4
/* 32-token chunks above: a tile's weights streamed once, not once per 16 tokens */
#define MM_STREAM_WIDE_ABOVE 8
/* the wide instantiation's blocks per SM: 32 token rows, 4 n-tiles of sums each */
#define MM_STREAM_WIDE_BLOCKS 3
/* The resident blocks per SM each instantiation's persistent grid and split plan count on. */
MM_PLAN_RULE int plan_stream_blocks_per_sm(int variant) {
    return variant == STREAM_WIDE          ? MM_STREAM_WIDE_BLOCKS
           : variant == STREAM_MORE_BLOCKS ? MM_STREAM_BLOCKS_PER_SM + 1
                                           : MM_STREAM_BLOCKS_PER_SM;
}
MM_PLAN_FN int plan_stream_variant(long slots, int E, int E_loc, int y, int nkc, int sms) {
    if (slots > (long)MM_STREAM_WIDE_ABOVE * E) return STREAM_WIDE;
    if (slots >= (long)MM_STREAM_GROUPED_MIN_AVG * E) return STREAM_GROUPED;
    if (plan_stream_more_blocks(slots, E, E_loc, y, nkc, sms)) return STREAM_MORE_BLOCKS;
    if (plan_stream_rolled(slots, E, y, nkc)) return STREAM_ROLLED;
    return STREAM_PER_SLOT;
}

/* Which routing builds a forward's tables (dispatch.cu's table; every one writes the same tables
 * from the staged ids: DECISIONS 42). In one process, where the host knows the group's token count:
 * one warp of the stage block for a single token of one rank (route_one_warp: K <= 32 lanes, a warp
 * more in the stage block), one kernel up to MM_ROUTE_ONE_KERNEL_SLOTS slots (a shared count per
 * local expert). Else -- and always across GPUs -- count / scan / fill over chunks of slots where a
 * block holds a count per local expert and warp (E_r <= MM_ROUTE_CHUNK_EXPERTS), else count / tiles /
 * fill per expert (no bound on E_r). stage_threads: plan_stage_threads. */
enum { ROUTE_WARP = 0, ROUTE_ONE_KERNEL = 1, ROUTE_CHUNKS = 2, ROUTE_PER_EXPERT = 3 };
#define MM_ROUTE_WARP_EXPERTS 1024       /* experts per rank route_one_warp walks (32 per lane round) */
#define MM_ROUTE_ONE_KERNEL_SLOTS 1024   /* over it the chunks are faster (DECISIONS 42) */
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
#define MM_WGMMA_ROWS 256 /* weight rows per wgmma block */
/* NVFP4 wgmma blocks per SM (registers capped at 128): ptxas then serializes each warpgroup's wgmma
 * with its next step (C7511), but the other warpgroups fill the tensor cores. */
#define MM_WGMMA_NVFP4_BLOCKS 2 /* faster than 1 block of 155 registers (DECISIONS 37) */
#define MM_WGMMA_RESIDENT (MM_WGMMA_NVFP4_BLOCKS * MM_PLAN_SMS) /* NVFP4 wgmma blocks resident */
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

/* Where a rank reads its gate/up input from the gathered copy L.xg (sm90_gather_kernel; the copy is
 * exact, so y is the same either way): where the plan gathers (gemm_plan.gathered) and the copy holds
 * the rank's slot rows (MM_GATHER_CAP), in one process always, across GPUs from MM_GATHER_MIN_SLOTS
 * slot rows of the rank on (the rank's count, known on the device after routing: rank_gathered). */
/* below, the gather's copy and launch cost more than remote reads at decode (DECISIONS 44) */
#define MM_GATHER_MIN_SLOTS 512
MM_PLAN_INLINE int plan_rank_gathers(int one_process, int rank_slots) {
    return one_process || rank_slots >= MM_GATHER_MIN_SLOTS;
}

/* The combine of a rank's T tokens (sm90_combine.cu): up to MM_COMBINE_CLUSTER_TOKENS tokens a cluster
 * of MM_COMBINE_CLUSTER blocks per token, each taking an eighth of the token's chunk sums through
 * distributed shared memory; above, a block per token. Both give the same bits (one order of sums). */
#define MM_COMBINE_CLUSTER 8 /* blocks per token in the few-token form (the portable cluster size) */
/* a token's K rows of p over 8 SMs, not one: DSv3-like T = 1 (DECISIONS) */
#define MM_COMBINE_CLUSTER_TOKENS 16
typedef struct combine_plan {
    int cluster;         /* the few-token form */
    int blocks, threads; /* the grid (a cluster per token, or a block) and the block */
    int smem;            /* the chunk sums: K x H / 128 f32 */
} combine_plan;
MM_PLAN_HOST combine_plan plan_combine(int T, int K, int H) {
    const int nch = H / 128, tokens = T > 0 ? T : 1;
    combine_plan c;
    c.cluster = T <= MM_COMBINE_CLUSTER_TOKENS;
    c.smem = K * nch * 4;
    if (c.cluster) { /* a warp per chunk of the block's share (at most 32 warps) */
        const int per_block = (nch + MM_COMBINE_CLUSTER - 1) / MM_COMBINE_CLUSTER;
        c.blocks = tokens * MM_COMBINE_CLUSTER;
        c.threads = per_block > 32 ? 1024 : per_block * 32;
    } else { /* a thread per 16 columns (448 for H = 7168): four 16-byte loads per slot row each */
        const int n = H / 16;
        c.blocks = tokens;
        c.threads = n < 64 ? 64 : n > 1024 ? 1024 : (n + 31) / 32 * 32;
    }
    return c;
}

/* ---- The plan of a forward's expert GEMMs, as a value ----------------------------------------- */

/* The part of the plan every GEMM kernel is given by value, for the choice it takes on the device
 * (gemm_device_choice at the group's count, which with NCCL only the device knows): the override the
 * plan was made with (megamoe_layer_config.gemm_kernel: GEMM_AUTO or the kernel a test forces). */
typedef struct gemm_rule {
    int override_kernel;
} gemm_rule;

/* A phase's rows of weights and K steps. */
MM_PLAN_FN int gemm_phase_rows(int phase, int H, int I) { return phase == PHASE_GATE_UP ? 2 * I : H; }
MM_PLAN_FN int gemm_phase_nkc(int phase, int H, int I) {
    return (phase == PHASE_GATE_UP ? H : I) / MM_FRAG_K;
}

/* The kernel a phase runs at the group's slot count, and the mma.sync kernel's plan that choice
 * depends on. The host's plan takes it here (one process, where the host knows the count); every
 * GEMM kernel takes the same two rules on the device (gemm_device_choice, where with NCCL only the
 * device knows the count) and, if it is the one, plans its own splits at that count with its
 * family's rule (plan_splitk, plan_wgmma_splits, plan_stream_splits, ws_split_n), as the host does. */
typedef struct gemm_phase_choice {
    int kernel;      /* gemm_choice: GEMM_MMA, GEMM_STREAM, GEMM_WGMMA, GEMM_WS64 or GEMM_WS */
    splitk_plan mma; /* plan_splitk: the mma.sync kernel's splits and tile bound */
} gemm_phase_choice;
MM_PLAN_HOST gemm_phase_choice plan_gemm_phase(gemm_rule rule, long slots, int E, int H, int I, int phase,
                                               int nvfp4) {
    gemm_phase_choice c;
    c.mma = plan_splitk(slots, E, gemm_phase_rows(phase, H, I) / MM_MMA_ROWS, gemm_phase_nkc(phase, H, I));
    c.kernel = gemm_choice(rule.override_kernel, slots, E, c.mma.splits, nvfp4, H < I ? H : I);
    return c;
}

/* The compiled set, as data: each family's instance table (in its .cu; both the launch and the
 * shared-memory opt-in read it) has a row per combination of its template axes, the axes being the
 * bits of the row's index. A row is built where the plan can produce it: */
/* MEGAMOE_FORCED_KERNELS (a CMake option, ON in the test build `make test` uses, OFF in the wheel):
 * also the instances only a forced gemm_kernel reaches. gemm_choice never names NVFP4 on mma.sync
 * (the streaming kernel takes those forwards) nor BF16 on wgmma (ws64 and ws take those): test_plan
 * checks it over its grid of shapes and counts. */
#ifdef MEGAMOE_FORCED_KERNELS
#define MM_FORCED_KERNELS 1
#else
#define MM_FORCED_KERNELS 0
#endif
MM_PLAN_RULE int gemm_forced_only(int kernel, int nvfp4) {
    return (kernel == GEMM_MMA && nvfp4) || (kernel == GEMM_WGMMA && !nvfp4);
}
MM_PLAN_RULE int gemm_family_built(int kernel, int nvfp4) {
    return MM_FORCED_KERNELS || !gemm_forced_only(kernel, nvfp4);
}
/* Whether a layer's gemm_kernel can run in this build (finalize refuses it otherwise). */
MM_PLAN_RULE int gemm_override_built(int override_kernel, int nvfp4) {
    return override_kernel == GEMM_MMA || override_kernel == GEMM_WGMMA
               ? gemm_family_built(override_kernel, nvfp4)
               : 1;
}
#define MMA_INSTANCES 8 /* [split][nvfp4][phase] */
MM_PLAN_RULE int mma_instance(int phase, int nvfp4, int split) {
    return phase | (nvfp4 != 0) << 1 | (split != 0) << 2;
}
MM_PLAN_RULE int mma_instance_built(int nvfp4) { return gemm_family_built(GEMM_MMA, nvfp4); }
#define WGMMA_INSTANCES 16 /* [walk][split][nvfp4][phase]; split: NVFP4 only */
MM_PLAN_RULE int wgmma_instance(int phase, int nvfp4, int split, int walk) {
    return phase | (nvfp4 != 0) << 1 | (split != 0) << 2 | (walk != 0) << 3;
}
MM_PLAN_RULE int wgmma_instance_built(int nvfp4, int split) {
    return (nvfp4 || !split) && gemm_family_built(GEMM_WGMMA, nvfp4);
}
/* [split_n][walk][128 tokens][nvfp4][phase]; gate/up always walks (ws_walks), split_n is the NVFP4
 * 128-token form's only. */
#define WS_INSTANCES 32
MM_PLAN_RULE int ws_instance(int phase, int nvfp4, int ntok128, int walk, int split_n) {
    return phase | (nvfp4 != 0) << 1 | (ntok128 != 0) << 2 | (walk != 0) << 3 | (split_n != 0) << 4;
}
MM_PLAN_RULE int ws_instance_built(int phase, int nvfp4, int ntok128, int walk, int split_n) {
    return (walk || phase == PHASE_DOWN) && (!split_n || (nvfp4 && ntok128));
}
/* The streaming kernel's: a row per variant (plan_stream_variant), both phases in it. */

/* What a forward's expert GEMMs are planned from (dispatch.cu fills it). */
typedef struct gemm_desc {
    long slots;     /* the group's slots S = tokens x K; NCCL: this rank's, a lower bound of the group's */
    long max_slots; /* R x T_max x K: the most the group can have */
    int R, local_ranks;  /* ranks in the group; ranks this process drives (R in one process, 1 with NCCL) */
    int E, E_r, K, H, I; /* experts, per rank, top-k, hidden and intermediate sizes */
    int nvfp4, bf16_act; /* NVFP4 weights; with bf16 activations (W4A16) */
    int max_tiles;       /* the buffer's tile bound per rank (L.max_tiles, sized for T_max) */
    int has_xg;          /* the buffer holds the gathered copy (L.xg) */
    int sms;             /* the GPU's SMs, for the persistent grids (the rules above take MM_PLAN_SMS) */
    int override_kernel; /* megamoe_layer_config.gemm_kernel: GEMM_AUTO or a forced kernel (tests) */
} gemm_desc;

/* One kernel launch of a phase. */
typedef struct gemm_launch {
    int kernel;      /* the family: GEMM_MMA, GEMM_STREAM, GEMM_WGMMA, GEMM_WS64 or GEMM_WS */
    int phase;       /* PHASE_GATE_UP or PHASE_DOWN */
    int instance;    /* the row of the family's instance table (streaming: the variant) */
    int splits;      /* mma.sync, wgmma: K splits per rank in the grid (1: the unsplit instance) */
    int walk;        /* wgmma, ws: the blocks walk the tiles or items of a capped grid */
    int split_n;     /* ws: the 64 + 32 + 32 form */
    int tma;         /* ws: the token tile by TMA (one rank driven here, its rows consecutive) */
    int tiles;       /* the tile bound the grid covers */
    int grid[3];     /* x, y, z */
    long host_slots; /* streaming: the group's slots where the host knows them (one process), else 0 */
    int host_splits; /* streaming: their split plan, else 0 (the blocks plan on the device) */
    int ordered;     /* streaming: the routing wrote the tile order (plan_route_orders_tiles) */
    gemm_rule rule;  /* for plan_gemm_phase on the device */
} gemm_launch;

/* A phase's launches, in order. One process: the one kernel the group's count chooses. NCCL: every
 * kernel the group's count (between this rank's and every rank's at T_max) may choose, each with the
 * most splits it may plan; the blocks of all but the device's choice leave at once. */
#define GEMM_MAX_LAUNCHES 5 /* the few-token kernel, wgmma, ws64, ws and its 64 + 32 + 32 form */
typedef struct gemm_phase_plan {
    int kernel; /* the choice at desc.slots (one process: the kernel that runs) */
    int num_launches;
    gemm_launch launch[GEMM_MAX_LAUNCHES];
} gemm_phase_plan;

typedef struct gemm_plan {
    int tiles;                /* token tiles per rank the grids cover; 0: nothing runs */
    int gathered;             /* the gate/up input gathered into L.xg first (sm90_gather_kernel) */
    int act_f16;              /* W4A16: sm90_act_f16 between the phases */
    long act_rows;            /* its rows per rank at most */
    gemm_phase_plan phase[2]; /* [PHASE_GATE_UP], [PHASE_DOWN] */
} gemm_plan;

MM_PLAN_HOST gemm_launch gemm_launch_of(const gemm_desc *d, int kernel, int phase, int tiles) {
    gemm_launch g;
    memset(&g, 0, sizeof g);
    g.kernel = kernel;
    g.phase = phase;
    g.splits = 1;
    g.tiles = tiles;
    g.rule.override_kernel = d->override_kernel;
    return g;
}

/* mma.sync: a block per (tile, 128-row block, rank x K split). */
MM_PLAN_HOST gemm_launch plan_mma_launch(const gemm_desc *d, int phase, int tiles, int splits) {
    gemm_launch g = gemm_launch_of(d, GEMM_MMA, phase, tiles);
    g.splits = splits;
    g.instance = mma_instance(phase, d->nvfp4, splits > 1);
    g.grid[0] = tiles;
    g.grid[1] = gemm_phase_rows(phase, d->H, d->I) / MM_MMA_ROWS;
    g.grid[2] = d->local_ranks * splits;
    return g;
}

/* wgmma: a block per (tile, 256-row block, rank x K split; splits NVFP4 only). Walking (NCCL, whose
 * tile bound is sized for every rank at T_max) the grid is cut to about one wave, its blocks walking
 * the tiles the device counted, so a decode forward does not schedule tens of thousands of blocks
 * that only leave. */
MM_PLAN_HOST gemm_launch plan_wgmma_launch(const gemm_desc *d, int phase, int tiles, int splits) {
    gemm_launch g = gemm_launch_of(d, GEMM_WGMMA, phase, tiles);
    const int y = gemm_phase_rows(phase, d->H, d->I) / MM_WGMMA_ROWS,
              sp = d->nvfp4 && splits > 1 ? splits : 1;
    g.splits = sp;
    g.walk = d->local_ranks < d->R;
    int bx = tiles;
    if (g.walk) {
        const int per_sm = d->nvfp4 ? MM_WGMMA_NVFP4_BLOCKS : 1, yz = y * d->local_ranks * sp;
        const int cap = d->sms * per_sm / yz > 1 ? d->sms * per_sm / yz : 1;
        if (bx > cap) bx = cap;
    }
    g.instance = wgmma_instance(phase, d->nvfp4, sp > 1, g.walk);
    g.grid[0] = bx;
    g.grid[1] = y;
    g.grid[2] = d->local_ranks * sp;
    return g;
}

/* The warp-specialized kernel (kernel GEMM_WS: 128-token blocks, GEMM_WS64: 64): a block per (tile,
 * 256-row block) of the bound, or walking (ws_walks) one block per SM -- the largest odd count, as
 * measured -- each taking the items the device counted. */
MM_PLAN_HOST gemm_launch plan_ws_launch(const gemm_desc *d, int kernel, int phase, int tiles, int split_n,
                                        int gathered) {
    gemm_launch g = gemm_launch_of(d, kernel, phase, tiles);
    int blocks = (gemm_phase_rows(phase, d->H, d->I) / MM_WS_ROWS) * tiles;
    g.walk = ws_walks(d->local_ranks < d->R, phase, d->nvfp4, d->I);
    if (g.walk) {
        const int cap = d->sms > 1 ? (d->sms - 1) | 1 : 1;
        if (blocks > cap) blocks = cap;
    }
    g.split_n = split_n;
    /* The token tile by TMA where an item's rows are consecutive rows of one matrix of the rank's
     * buffer (down's act; gate/up's gathered copy) and one rank is driven here (a map per rank would
     * not fit one kernel parameter). */
    g.tma = d->local_ranks == 1 && (phase == PHASE_DOWN || gathered);
    g.instance = ws_instance(phase, d->nvfp4, kernel == GEMM_WS, g.walk, split_n);
    g.grid[0] = blocks;
    g.grid[1] = 1;
    g.grid[2] = d->local_ranks;
    return g;
}

/* The streaming kernel: a persistent grid of the variant's resident blocks, at most the items' bound.
 * In one process the host's count is the group's, so the blocks take the split plan as an argument
 * instead of reading the count and planning (64-bit divisions, code fetched cold at decode) before
 * their first copy. Returns 0 where no block would run. */
MM_PLAN_HOST int plan_stream_launch(const gemm_desc *d, int phase, int tiles, gemm_launch *g) {
    const int Y = gemm_phase_rows(phase, d->H, d->I) / 128, nkc = gemm_phase_nkc(phase, d->H, d->I);
    const int one_process = d->local_ranks == d->R;
    *g = gemm_launch_of(d, GEMM_STREAM, phase, tiles);
    g->instance = plan_stream_variant(d->slots, d->E, d->E_r * d->local_ranks, Y, nkc, d->sms);
    const long resident = (long)plan_stream_blocks_per_sm(g->instance) * d->sms;
    const long bound = (long)d->local_ranks * tiles * Y * 16;
    g->grid[0] = (int)(bound < resident ? bound : resident);
    g->grid[1] = g->grid[2] = 1;
    g->host_slots = one_process ? d->slots : 0;
    g->host_splits = one_process ? plan_stream_splits(d->slots, d->E, Y, nkc) : 0;
    const int route = plan_route(one_process, d->R, d->slots / d->K, d->K, d->E_r, d->H);
    g->ordered = plan_route_orders_tiles(route, d->nvfp4, d->slots, d->E);
    return g->grid[0] > 0;
}

MM_PLAN_HOST void plan_add(gemm_phase_plan *p, gemm_launch g) { p->launch[p->num_launches++] = g; }

/* One process: the kernel the group's count chooses, with its plan (plan_gemm_phase). */
MM_PLAN_HOST gemm_phase_plan plan_phase_one_process(const gemm_desc *d, int phase, int tiles, int gathered) {
    const int rows = gemm_phase_rows(phase, d->H, d->I), nkc = gemm_phase_nkc(phase, d->H, d->I);
    const gemm_rule rule = {d->override_kernel};
    const gemm_phase_choice c = plan_gemm_phase(rule, d->slots, d->E, d->H, d->I, phase, d->nvfp4);
    gemm_phase_plan p;
    memset(&p, 0, sizeof p);
    p.kernel = c.kernel;
    gemm_launch g;
    if (c.kernel == GEMM_MMA) plan_add(&p, plan_mma_launch(d, phase, tiles, c.mma.splits));
    if (c.kernel == GEMM_STREAM && plan_stream_launch(d, phase, tiles, &g)) plan_add(&p, g);
    if (c.kernel == GEMM_WGMMA)
        plan_add(&p, plan_wgmma_launch(d, phase, tiles,
                                       plan_wgmma_splits(d->slots, d->E, rows / MM_WGMMA_ROWS, nkc).splits));
    if (c.kernel == GEMM_WS64) plan_add(&p, plan_ws_launch(d, GEMM_WS64, phase, tiles, 0, gathered));
    if (c.kernel == GEMM_WS)
        plan_add(&p,
                 plan_ws_launch(d, GEMM_WS, phase, tiles, d->nvfp4 && ws_split_n(d->slots, d->E), gathered));
    return p;
}

/* NCCL: the group's count lies between this rank's (desc.slots) and every rank's at T_max. The choice
 * never goes down as the count grows (gemm_rank), and the splits wanted never grow: so the kernels
 * from the choice at this rank's count (with the most splits it may plan) up to the choice at the
 * bound, each with the splits this rank's count wants; of the ws kernel's two forms, each the range
 * may plan. */
MM_PLAN_HOST gemm_phase_plan plan_phase_nccl(const gemm_desc *d, int phase, int tiles, int gathered) {
    const int rows = gemm_phase_rows(phase, d->H, d->I), nkc = gemm_phase_nkc(phase, d->H, d->I);
    const int min_k = d->H < d->I ? d->H : d->I,
              wanted = splitk_wanted(d->slots, d->E, rows / MM_MMA_ROWS, nkc);
    const int sp = wanted > 1 ? wanted : 1;
    const int k = gemm_choice(d->override_kernel, d->slots, d->E, sp, d->nvfp4, min_k);
    const int top = gemm_rank(gemm_choice(d->override_kernel, d->max_slots, d->E, 1, d->nvfp4, min_k));
    gemm_phase_plan p;
    memset(&p, 0, sizeof p);
    p.kernel = k;
    gemm_launch g;
    if (k == GEMM_MMA) plan_add(&p, plan_mma_launch(d, phase, tiles, sp));
    if (k == GEMM_STREAM && plan_stream_launch(d, phase, tiles, &g)) plan_add(&p, g);
    if (gemm_rank(k) <= 1 && top >= 1)
        plan_add(&p, plan_wgmma_launch(d, phase, tiles,
                                       wgmma_splits_wanted(d->slots, d->E, rows / MM_WGMMA_ROWS, nkc)));
    if (gemm_rank(k) <= 2 && top >= 2) plan_add(&p, plan_ws_launch(d, GEMM_WS64, phase, tiles, 0, gathered));
    if (top >= 3) {
        const int split = d->nvfp4 && ws_split_n(d->slots, d->E),
                  full = !d->nvfp4 || !ws_split_n(d->max_slots, d->E);
        if (full) plan_add(&p, plan_ws_launch(d, GEMM_WS, phase, tiles, 0, gathered));
        if (split) plan_add(&p, plan_ws_launch(d, GEMM_WS, phase, tiles, 1, gathered));
    }
    return p;
}

/* desc -> plan: everything dispatch.cu launches for a forward's expert GEMMs. */
MM_PLAN_HOST gemm_plan plan_gemm(const gemm_desc *d) {
    gemm_plan p;
    memset(&p, 0, sizeof p);
    if (d->max_tiles <= 0) return p;
    const int nccl = d->local_ranks < d->R;
    const gemm_rule rule = {d->override_kernel};
    const gemm_phase_choice gate_up =
        plan_gemm_phase(rule, d->slots, d->E, d->H, d->I, PHASE_GATE_UP, d->nvfp4);
    /* A rank has at most ws_tiles tiles: launching max_tiles (sized for T_max) would schedule
     * thousands of blocks that only read the tile count and exit, ~0.2 ms at T = 1. With NCCL the
     * host knows only the bound. */
    p.tiles = nccl || d->max_tiles < gate_up.mma.ws_tiles ? d->max_tiles : gate_up.mma.ws_tiles;
    if (p.tiles <= 0) return p;
    /* The gate/up input in slot order: always across GPUs (a remote row then crosses NVLink once, not
     * once per row block), and in one process where the warp-specialized kernels take gate/up (their
     * token tile is then one TMA box per K step; DECISIONS 44). */
    p.gathered = d->has_xg && (nccl || gate_up.kernel == GEMM_WS || gate_up.kernel == GEMM_WS64);
    p.act_f16 = d->bf16_act;
    p.act_rows = nccl ? d->max_slots : d->slots;
    for (int phase = PHASE_GATE_UP; phase <= PHASE_DOWN; phase++)
        p.phase[phase] = nccl ? plan_phase_nccl(d, phase, p.tiles, p.gathered)
                              : plan_phase_one_process(d, phase, p.tiles, p.gathered);
    return p;
}

#endif /* MEGAMOE_GEMM_PLAN_H */
