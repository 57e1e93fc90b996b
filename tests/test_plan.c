/*
 * test_plan.c -- every rule of src/cuda/gemm_plan.h and the plan they add up to, on the host, over a
 * grid of shapes, token counts and rank counts: the partial sums every split-K plan asks for fit the
 * split-K workspace the buffer layout reserves (a plan past it would write into the next region),
 * splits keep 8 or more K steps, each threshold sits where its reason says, the plan of one process
 * launches exactly the kernel the rules choose, and the plan of an NCCL rank holds every launch the
 * group's count may need (a rank's own count bounds what the group's count can plan and choose).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "cuda/gemm_plan.h"
#include "internal.h"

static const int k_E[] = {8, 16, 64, 128, 256};
static const int k_K[] = {1, 2, 4, 8};
static const int k_HI[][2] = {{256, 256}, {2048, 768}, {4096, 14336}, {7168, 2048}, {1024, 512}};
static const int k_T[] = {0,   1,   2,   3,   7,   8,   9,    31,   32,   33,
                          100, 127, 128, 129, 500, 512, 1000, 2048, 4096, 8192};
#define N(a) ((int)(sizeof a / sizeof a[0]))

/* Calls f(E, K, H, I, slots, y, nkc) for both phases of every shape and group slot count. */
typedef void (*plan_case)(int E, int K, int H, int I, long slots, int y, int nkc);
static void for_each_case(plan_case f) {
    for (int a = 0; a < N(k_E); a++)
        for (int b = 0; b < N(k_K); b++)
            for (int c = 0; c < N(k_HI); c++)
                for (int t = 0; t < N(k_T); t++)
                    for (int R = 1; R <= 8; R *= 2) {
                        const int E = k_E[a], K = k_K[b], H = k_HI[c][0], I = k_HI[c][1];
                        const long slots = (long)R * k_T[t] * K;
                        f(E, K, H, I, slots, 2 * I / 128, H / 64); /* gate/up */
                        f(E, K, H, I, slots, H / 128, I / 64);     /* down */
                    }
}

static void stream_case(int E, int K, int H, int I, long slots, int y, int nkc) {
    (void)K;
    const int sp = plan_stream_splits(slots, E, y, nkc);
    assert_true(sp >= 1 && sp <= 16);
    if (sp > 1) {
        assert_true(nkc / sp >= MM_STREAM_MIN_SPLIT_STEPS); /* every split sums that many K steps or more */
        /* [splits][slabs][slot rows][128] f32 within MM_SPLITK_ENTRIES x 128 x 64 f32 */
        assert_true((long)sp * y * slots * 128 <= (long)MM_SPLITK_ENTRIES * 128 * 64);
        /* the last-arriver counters, one per (tile, slab, consumer warp) of a rank's tiles */
        const long active = slots < E ? slots : E;
        assert_true((active + slots / MM_TILE_TOKENS) * y * MM_STREAM_WARPS <= MM_SPLITK_ENTRIES);
        /* splits only while the items stay within one per resident block */
        assert_true((long)sp * active * y <= MM_STREAM_TARGET_ITEMS);
    }
}

static void test_stream_splits_fit_the_workspace(void **state) {
    (void)state;
    for_each_case(stream_case);
    /* DeepSeek-V3-like T = 1 (8 slots): gate/up in 2 splits, down unsplit (measured best, gemm_plan.h) */
    assert_int_equal(plan_stream_splits(8, 256, 2 * 2048 / 128, 7168 / 64), 2);
    assert_int_equal(plan_stream_splits(8, 256, 7168 / 128, 2048 / 64), 1);
    /* One block per SM more only for an unsplit phase of ~4-5 items per SM: Qwen3-like T = 8's gate/up
     * (64 slots reach ~50 of 128 experts: ~600 items of 12 slabs), not its down projection (~800),
     * nor T = 1 (split), T = 32 (~1300), DeepSeek-V3-like T = 8 (~1800) or Mixtral-like T = 8 */
    assert_true(plan_stream_more_blocks(64, 128, 128, 2 * 768 / 128, 2048 / 64, MM_PLAN_SMS));
    assert_false(plan_stream_more_blocks(64, 128, 128, 2048 / 128, 768 / 64, MM_PLAN_SMS));
    assert_false(plan_stream_more_blocks(8, 128, 128, 2 * 768 / 128, 2048 / 64, MM_PLAN_SMS));
    assert_false(plan_stream_more_blocks(256, 128, 128, 2 * 768 / 128, 2048 / 64, MM_PLAN_SMS));
    assert_false(plan_stream_more_blocks(64, 256, 256, 2 * 2048 / 128, 7168 / 64, MM_PLAN_SMS));
    assert_false(plan_stream_more_blocks(16, 8, 8, 2 * 14336 / 128, 4096 / 64, MM_PLAN_SMS));
    assert_false(plan_stream_more_blocks(0, 128, 128, 12, 32, MM_PLAN_SMS));
    /* The K loop not unrolled for splits of < 16 steps: Qwen3-like gate/up at T = 1 (4 splits of 8)
     * and its down projection (12 steps) at any T; not its gate/up at T = 8 (32 steps), nor
     * DeepSeek-V3-like (56 and 32 steps at T = 1) or Mixtral-like (64 and 28) */
    assert_true(plan_stream_rolled(8, 128, 2 * 768 / 128, 2048 / 64));
    assert_true(plan_stream_rolled(8, 128, 2048 / 128, 768 / 64));
    assert_true(plan_stream_rolled(1024, 128, 2048 / 128, 768 / 64));
    assert_false(plan_stream_rolled(64, 128, 2 * 768 / 128, 2048 / 64));
    assert_false(plan_stream_rolled(8, 256, 2 * 2048 / 128, 7168 / 64));
    assert_false(plan_stream_rolled(8, 256, 7168 / 128, 2048 / 64));
    assert_false(plan_stream_rolled(2, 8, 2 * 14336 / 128, 4096 / 64));
    assert_false(plan_stream_rolled(2, 8, 4096 / 128, 14336 / 64));
}

static void wgmma_case(int E, int K, int H, int I, long slots, int y, int nkc) {
    (void)K, (void)H, (void)I, (void)y;
    const int wy = y * 128 / MM_WGMMA_ROWS; /* for_each_case passes 128-row slabs */
    if (wy < 1) return;
    const splitk_plan p = plan_wgmma_splits(slots, E, wy, nkc);
    assert_true(p.splits >= 1 && p.splits <= 8);
    assert_true(p.splits <= wgmma_splits_wanted(slots, E, wy, nkc));
    const long active = slots < E ? slots : E;
    assert_true(p.ws_tiles >= active + slots / MM_TILE_TOKENS);
    if (p.splits > 1) {
        assert_true(nkc / p.splits >= 8);
        assert_true(2L * wy * p.ws_tiles * p.splits <= MM_SPLITK_ENTRIES); /* 64 KB per block and split */
    }
    /* NCCL: the splits wanted never grow with the slot count, so a rank's own count bounds the group's */
    assert_true(wgmma_splits_wanted(slots * 2, E, wy, nkc) <= wgmma_splits_wanted(slots, E, wy, nkc));
}

static void test_wgmma_splits_fit_the_workspace(void **state) {
    (void)state;
    for_each_case(wgmma_case);
    /* Mixtral-like T = 128 (256 slots): the down projection (16 row blocks x 8 tiles) in 2 splits */
    assert_int_equal(plan_wgmma_splits(256, 8, 4096 / MM_WGMMA_ROWS, 14336 / 64).splits, 2);
    assert_int_equal(plan_wgmma_splits(256, 8, 2 * 14336 / MM_WGMMA_ROWS, 4096 / 64).splits, 1);
}

static void mma_case(int E, int K, int H, int I, long slots, int y, int nkc) {
    (void)K, (void)H, (void)I;
    const splitk_plan p = plan_splitk(slots, E, y, nkc);
    assert_true(p.splits >= 1 && p.splits <= 8);
    if (p.splits > 1) {
        assert_true(nkc / p.splits >= 8);
        assert_true((long)y * p.ws_tiles * p.splits <= MM_SPLITK_ENTRIES); /* entries of 128 x 64 f32 */
    }
    /* A rank's tiles: at most one partial tile per active expert plus the full ones. */
    const long active = slots < E ? slots : E;
    assert_true(p.ws_tiles >= active + slots / MM_TILE_TOKENS);
}

static void test_mma_splits_fit_the_workspace(void **state) {
    (void)state;
    for_each_case(mma_case);
}

/* The NCCL host launches the splits wanted at its own count and each kernel its count does not rule
 * out; the group's count (never smaller) must stay within what was launched. */
static void nccl_bound_case(int E, int K, int H, int I, long slots, int y, int nkc) {
    (void)K;
    for (long local = 0; local <= slots; local += slots / 7 + 1) {
        const int wanted = splitk_wanted(local, E, y, nkc), launched = wanted > 1 ? wanted : 1;
        assert_true(plan_splitk(slots, E, y, nkc).splits <= launched);
        for (int nvfp4 = 0; nvfp4 <= 1; nvfp4++) {
            const int mk = H < I ? H : I;
            const int mine = gemm_choice(0, local, E, launched, nvfp4, mk);
            const int group = gemm_choice(0, slots, E, plan_splitk(slots, E, y, nkc).splits, nvfp4, mk);
            /* The host launches the kernels from its own choice up (gemm_rank): the group's is one. */
            assert_true(gemm_rank(group) >= gemm_rank(mine));
            if (gemm_rank(group) == 0) assert_int_equal(group, mine);
        }
    }
}

static void test_nccl_launch_bounds_hold(void **state) {
    (void)state;
    for_each_case(nccl_bound_case);
}

/* The workspace the plans above assume is the one the device buffer layout reserves. */
static void test_layout_reserves_the_workspace(void **state) {
    (void)state;
    mm_buffer_layout l;
    mm_buffer_layout_compute(64, 8, 7168, 1, 1, 2, 128, 2048, &l);
    assert_true(l.splitk_counters - l.splitk_ws >= (uint64_t)MM_SPLITK_ENTRIES * 128 * 64 * 4);
    assert_true(l.barrier - l.splitk_counters >= (uint64_t)(MM_WS_COUNTERS + 2) * 4);
    /* The gathered gate/up input: a 16-bit row of H per slot row it holds, min(R, MM_GATHER_CAP) *
     * T_max * K of them (the scales are the routing's slot_scale, one per slot row of the rank). */
    const uint64_t rows = (uint64_t)(2 < MM_GATHER_CAP ? 2 : MM_GATHER_CAP) * 64 * 8;
    assert_true(l.xg > 0 && l.xg_rows == (int)rows);
    assert_true(l.error - l.xg >= rows * 7168 * 2);
    assert_true(l.expert_count - l.slot_scale >=
                (uint64_t)2 * 64 * 8 * 4); /* a scale per slot row of the rank */
    mm_buffer_layout ep8;
    mm_buffer_layout_compute(64, 8, 7168, 1, 1, 8, 32, 2048, &ep8); /* EP8: capped, not 8 T_max K */
    assert_int_equal(ep8.xg_rows, MM_GATHER_CAP * 64 * 8);
    assert_true(ep8.error - ep8.xg >= (uint64_t)ep8.xg_rows * 7168 * 2);
    mm_buffer_layout one;
    mm_buffer_layout_compute(64, 8, 7168, 1, 0, 2, 128, 2048, &one); /* one process: no gathered copy */
    assert_true(one.xg == 0 && one.xg_rows == 0 && one.total < l.total);
    /* The chunked routing's counts: a row of E_r per (home rank, chunk of MM_ROUTE_CHUNK slots). */
    mm_buffer_layout big;
    mm_buffer_layout_compute(8192, 8, 2048, 1, 0, 2, 128, 768, &big);
    assert_int_equal(big.route_chunks_per_src, (8192 * 8 + MM_ROUTE_CHUNK - 1) / MM_ROUTE_CHUNK);
    assert_true(big.route_chunks > 0 &&
                big.error - big.route_chunks >= (uint64_t)2 * big.route_chunks_per_src * 128 * 4);
    mm_buffer_layout many;
    mm_buffer_layout_compute(64, 8, 256, 1, 0, 1, MM_ROUTE_CHUNK_EXPERTS + 1, 256,
                             &many); /* routed per expert */
    assert_true(many.route_chunks == 0 && many.route_chunks_per_src == 0);
}

/* The warp-specialized kernel's items 0 .. nrb * tiles - 1 place every (tile, row block) exactly once,
 * tiles within a group being consecutive, whatever the tile count (a persistent version that counted
 * items from the rank's own tiles instead of the launched bound lost the last group's high row
 * blocks). */
static void test_ws_items_cover_every_block_once(void **state) {
    (void)state;
    static unsigned char seen[300 * 112];
    const int nrbs[] = {1, 2, 6, 16, 28, 112}, tile_counts[] = {1, 2, 15, 16, 17, 33, 64, 100, 264, 300};
    for (int a = 0; a < N(nrbs); a++)
        for (int b = 0; b < N(tile_counts); b++) {
            const int nrb = nrbs[a], tiles = tile_counts[b];
            memset(seen, 0, sizeof seen);
            for (int item = 0; item < nrb * tiles; item++) {
                int tile = -1, rb = -1;
                ws_item_place(item, nrb, tiles, &tile, &rb);
                assert_true(tile >= 0 && tile < tiles && rb >= 0 && rb < nrb);
                assert_int_equal(tile / MM_WS_GROUP, item / (MM_WS_GROUP * nrb)); /* its group */
                assert_int_equal(seen[tile * nrb + rb], 0);
                seen[tile * nrb + rb] = 1;
            }
        }
}

/* The streaming kernel's tile order (tile_order_before, summed over a rank's experts as
 * sm90_route_small_kernel does): a permutation of the tiles, by tokens, most first, ties by (expert,
 * tile). Over token counts with empty experts, full tiles and several per expert. */
static void test_tile_order_is_a_sorted_permutation(void **state) {
    (void)state;
    enum { E = 40, MAXT = 400 };
    static int hist[E], pos_seen[MAXT], cols_at[MAXT], expert_at[MAXT], index_at[MAXT];
    uint64_t rng = 12345;
    for (int round = 0; round < 50; round++) {
        int tiles = 0;
        for (int x = 0; x < E; x++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            const int r = (int)(rng >> 33) % 100;
            hist[x] = r < 20 ? 0 : r < 30 ? 64 * (1 + r % 3) : r < 40 ? 64 + r % 64 : 1 + r % 70;
            tiles += (hist[x] + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS;
        }
        assert_true(tiles <= MAXT);
        memset(pos_seen, 0, sizeof pos_seen);
        for (int e = 0; e < E; e++)
            for (int i = 0; i * MM_TILE_TOKENS < hist[e]; i++) {
                const int left = hist[e] - i * MM_TILE_TOKENS,
                          c = left < MM_TILE_TOKENS ? left : MM_TILE_TOKENS;
                int at = 0;
                for (int x = 0; x < E; x++)
                    at += tile_order_before(hist[x], x, e, i, c);
                assert_true(at >= 0 && at < tiles);
                assert_int_equal(pos_seen[at], 0);
                pos_seen[at] = 1, cols_at[at] = c, expert_at[at] = e, index_at[at] = i;
            }
        for (int k = 1; k < tiles; k++) {
            assert_true(cols_at[k - 1] >= cols_at[k]);
            if (cols_at[k - 1] == cols_at[k])
                assert_true(expert_at[k - 1] < expert_at[k] ||
                            (expert_at[k - 1] == expert_at[k] && index_at[k - 1] < index_at[k]));
        }
    }
}

/* gemm_choice at each threshold, with the reason the threshold sits there. */
static void test_gemm_choice_rules(void **state) {
    (void)state;
    /* A forced kernel (tests, benchmarks) for every count; the streaming kernel is NVFP4 only. */
    for (int k = GEMM_MMA; k <= GEMM_WGMMA; k++)
        assert_int_equal(gemm_choice(k, 5, 256, 4, 1, 2048), k);
    assert_int_equal(gemm_choice(GEMM_WS, 5, 256, 4, 0, 2048), GEMM_WS);
    assert_int_equal(gemm_choice(GEMM_WS64, 5, 256, 4, 1, 2048), GEMM_WS64);
    assert_int_equal(gemm_choice(GEMM_STREAM, 5, 256, 4, 1, 2048), GEMM_STREAM);
    assert_int_equal(gemm_choice(GEMM_STREAM, 5, 256, 4, 0, 2048),
                     GEMM_MMA); /* BF16 has no streaming kernel */
    /* NVFP4: streaming up to MM_STREAM_MAX_AVG (16) slots per expert: bound by the weights' bandwidth. */
    assert_int_equal(MM_STREAM_MAX_AVG, 16);
    assert_int_equal(gemm_choice(0, 8L * 256 + 1, 256, 1, 1, 2048), GEMM_STREAM);
    assert_int_equal(gemm_choice(0, 16L * 256, 256, 1, 1, 2048), GEMM_STREAM);
    assert_int_equal(gemm_choice(0, 16L * 256 + 1, 256, 1, 1, 2048), GEMM_WGMMA);
    assert_int_equal(gemm_choice(0, 8L * 8, 8, 1, 1, 4096), GEMM_STREAM);
    assert_int_equal(gemm_choice(0, (long)MM_STREAM_MAX_AVG * 8, 8, 1, 1, 4096), GEMM_STREAM);
    /* NVFP4 with both K >= MM_WS64_MIN_K (4096): ws64 above the streaming kernel (long items amortize
     * its fill), up to MM_WS_MIN_TOKENS; with a K of 2048 never ws64 (wgmma there). */
    assert_int_equal(MM_WS64_MIN_K, 4096);
    assert_int_equal(gemm_choice(0, 16L * 8 + 1, 8, 1, 1, 4096), GEMM_WS64);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 8 - 1, 8, 1, 1, 4096), GEMM_WS64);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 8, 8, 1, 1, 4096), GEMM_WS);
    assert_int_equal(gemm_choice(0, 17L * 8, 8, 1, 1, 4095), GEMM_WGMMA);
    for (long slots = 1; slots <= 1L << 20; slots *= 4)
        assert_true(gemm_choice(0, slots, 256, 1, 1, 2048) != GEMM_WS64);
    /* ws from MM_WS_MIN_TOKENS (64) per expert: its walking grid beats wgmma even at a short K
     * (Qwen3-like I = 768); NVFP4 at any K, BF16 only where mma.sync plans no K split. */
    assert_int_equal(MM_WS_MIN_TOKENS, 64);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256, 256, 1, 1, 2048), GEMM_WS);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256 - 1, 256, 1, 1, 2048), GEMM_WGMMA);
    assert_int_equal(gemm_choice(0, 64L * 128 - 1, 128, 1, 1, 768), GEMM_WGMMA);
    assert_int_equal(gemm_choice(0, 64L * 128, 128, 1, 1, 768), GEMM_WS);
    assert_int_equal(gemm_choice(0, 256L * 128, 128, 1, 0, 768), GEMM_WS);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256, 256, 1, 0, 2048), GEMM_WS);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256, 256, 2, 0, 2048),
                     GEMM_WS64); /* split: 64-token */
    /* BF16: ws64 from MM_BF16_WS64_MIN_AVG (4) per expert, split planned or not (in place of wgmma and
     * mma.sync split-K); mma.sync below, where the tiles are too few for the warp-specialized blocks. */
    assert_int_equal(MM_BF16_WS64_MIN_AVG, 4);
    assert_int_equal(gemm_choice(0, 4L * 256, 256, 1, 0, 2048), GEMM_WS64);
    assert_int_equal(gemm_choice(0, 4L * 256, 256, 1, 0, 768), GEMM_WS64);
    assert_int_equal(gemm_choice(0, 4L * 256, 256, 2, 0, 2048), GEMM_WS64);
    assert_int_equal(gemm_choice(0, 4L * 256 - 1, 256, 1, 0, 2048), GEMM_MMA);
    assert_int_equal(gemm_choice(0, 4L * 256 - 1, 256, 2, 0, 2048), GEMM_MMA);
    /* The order along the count (gemm_rank), which the NCCL plan's superset relies on: never down. */
    for (int nvfp4 = 0; nvfp4 <= 1; nvfp4++)
        for (int mk = 768; mk <= 8192; mk *= 2)
            for (long slots = 1; slots < 1L << 20; slots = slots * 3 / 2 + 1)
                assert_true(gemm_rank(gemm_choice(0, slots, 64, 1, nvfp4, mk)) <=
                            gemm_rank(gemm_choice(0, slots * 3 / 2 + 1, 64, 1, nvfp4, mk)));
}

/* The warp-specialized kernel walks across GPUs, for gate/up, and for the NVFP4 down projection
 * below MM_WS_DOWN_WALK_MAX_K; its NVFP4 128-token form splits N below MM_WS_SPLIT_N_BELOW per expert. */
static void test_ws_rules(void **state) {
    (void)state;
    for (int phase = PHASE_GATE_UP; phase <= PHASE_DOWN; phase++)
        for (int nvfp4 = 0; nvfp4 <= 1; nvfp4++)
            assert_true(ws_walks(1, phase, nvfp4, 14336)); /* NCCL: a bound only */
    assert_true(ws_walks(0, PHASE_GATE_UP, 0, 14336));     /* gate/up: its epilogue overlaps the next fill */
    assert_true(ws_walks(0, PHASE_DOWN, 1, 768));          /* Qwen3-like down: short items, fill-bound */
    assert_false(ws_walks(0, PHASE_DOWN, 1, MM_WS_DOWN_WALK_MAX_K)); /* from 2048: one block per item */
    assert_false(ws_walks(0, PHASE_DOWN, 1, 14336));                 /* Mixtral-like down: the walk lost */
    assert_false(ws_walks(0, PHASE_DOWN, 0, 768));                   /* BF16 down: one block per item */
    assert_int_equal(MM_WS_SPLIT_N_BELOW, 128);
    assert_true(ws_split_n(127L * 16, 16));  /* most items hold 40-90 tokens: the parts past them skipped */
    assert_false(ws_split_n(128L * 16, 16)); /* full items: one m64n128 (the split costs 3-5%) */
    assert_false(ws_split_n(1100 * 8, 16));
    assert_true(ws_split_n(200 * 2, 8));
}

/* Across GPUs a rank gathers from MM_GATHER_MIN_SLOTS slot rows on; in one process always. The
 * combine takes a cluster of 8 blocks per token up to 16 tokens of a rank, a block above. */
static void test_gather_and_combine_rules(void **state) {
    (void)state;
    assert_true(plan_rank_gathers(1, 1));                        /* one process: the TMA box */
    assert_false(plan_rank_gathers(0, MM_GATHER_MIN_SLOTS - 1)); /* decode: remote reads are cheaper */
    assert_true(plan_rank_gathers(0, MM_GATHER_MIN_SLOTS));
    const int Hs[] = {256, 2048, 7168, 16384};
    for (int h = 0; h < N(Hs); h++)
        for (int T = 0; T <= 64; T++) {
            const combine_plan c = plan_combine(T, 8, Hs[h]);
            assert_int_equal(c.cluster,
                             T <= MM_COMBINE_CLUSTER_TOKENS); /* a token's p over 8 SMs at decode */
            assert_int_equal(c.blocks, (T > 0 ? T : 1) * (c.cluster ? MM_COMBINE_CLUSTER : 1));
            assert_true(c.threads >= 32 && c.threads <= 1024 && c.threads % 32 == 0);
            assert_int_equal(c.smem, 8 * (Hs[h] / 128) * 4);
            /* a warp per chunk: the cluster's blocks hold every 128-column chunk of the token */
            if (c.cluster)
                assert_true(c.threads / 32 * MM_COMBINE_CLUSTER >= Hs[h] / 128 || c.threads == 1024);
            else
                assert_true(c.threads * 16 >= Hs[h] || c.threads == 1024);
        }
    assert_int_equal(plan_combine(1, 8, 7168).threads,
                     224); /* DSv3-like: 56 chunks over 8 blocks of 7 warps */
    assert_int_equal(plan_combine(17, 8, 7168).threads, 448); /* a thread per 16 columns */
}

/* The streaming kernel's resident blocks per SM: 4, one more for STREAM_MORE_BLOCKS, 3 for the wide one. */
static void test_stream_blocks(void **state) {
    (void)state;
    for (int v = 0; v < STREAM_VARIANTS; v++)
        assert_int_equal(plan_stream_blocks_per_sm(v), v == STREAM_WIDE          ? MM_STREAM_WIDE_BLOCKS
                                                       : v == STREAM_MORE_BLOCKS ? MM_STREAM_BLOCKS_PER_SM + 1
                                                                                 : MM_STREAM_BLOCKS_PER_SM);
    assert_int_equal(MM_STREAM_WIDE_BLOCKS, 3);
    assert_int_equal(MM_STREAM_BLOCKS_PER_SM, 4);
}

/* ---- the plan as a value (plan_gemm) ---------------------------------------------------------- */

/* A forward of `slots` slots (NCCL: this rank's) on a group of R ranks, `local` of them driven here. */
static gemm_desc desc_of(int E, int K, int H, int I, int R, int local, int T_max, long slots, int nvfp4,
                         int override_kernel) {
    gemm_desc d;
    memset(&d, 0, sizeof d);
    mm_buffer_layout l;
    mm_buffer_layout_compute(T_max, K, H, 1, local == 1, R, E / R, I, &l);
    d.slots = slots;
    d.max_slots = (long)R * T_max * K;
    d.R = R;
    d.local_ranks = local;
    d.E = E, d.E_r = E / R, d.K = K, d.H = H, d.I = I;
    d.nvfp4 = nvfp4;
    d.bf16_act = nvfp4;
    d.max_tiles = l.max_tiles;
    d.has_xg = l.xg != 0;
    d.sms = MM_PLAN_SMS;
    d.override_kernel = override_kernel;
    return d;
}

/* A launch's instance row matches its fields, and the build holds it (or it is a forced-only one). */
static void check_instance(const gemm_desc *d, const gemm_launch *g) {
    switch (g->kernel) {
    case GEMM_MMA:
        assert_int_equal(g->instance, mma_instance(g->phase, d->nvfp4, g->splits > 1));
        assert_int_equal(mma_instance_built(d->nvfp4), MM_FORCED_KERNELS || !d->nvfp4);
        break;
    case GEMM_WGMMA:
        assert_int_equal(g->instance, wgmma_instance(g->phase, d->nvfp4, g->splits > 1, g->walk));
        assert_true(d->nvfp4 || g->splits == 1); /* split-K: NVFP4 only */
        assert_int_equal(wgmma_instance_built(d->nvfp4, g->splits > 1), MM_FORCED_KERNELS || d->nvfp4);
        break;
    case GEMM_STREAM:
        assert_true(d->nvfp4);
        assert_true(g->instance >= 0 && g->instance < STREAM_VARIANTS);
        break;
    default:
        assert_true(g->kernel == GEMM_WS || g->kernel == GEMM_WS64);
        assert_int_equal(g->instance,
                         ws_instance(g->phase, d->nvfp4, g->kernel == GEMM_WS, g->walk, g->split_n));
        assert_true(ws_instance_built(g->phase, d->nvfp4, g->kernel == GEMM_WS, g->walk, g->split_n));
        assert_true(!g->split_n || (d->nvfp4 && g->kernel == GEMM_WS));
    }
    assert_true(g->instance >= 0 && g->instance < WS_INSTANCES);
    assert_true(g->grid[0] >= 1 && g->grid[1] >= 1 && g->grid[2] >= 1);
    assert_int_equal(g->rule.override_kernel, d->override_kernel);
}

/* One process: each phase runs the one kernel plan_gemm_phase chooses, with its family's plan. */
static void check_one_process(const gemm_desc *d) {
    const gemm_plan p = plan_gemm(d);
    const gemm_rule rule = {d->override_kernel};
    const gemm_phase_choice gu = plan_gemm_phase(rule, d->slots, d->E, d->H, d->I, PHASE_GATE_UP, d->nvfp4);
    const int bound = gu.mma.ws_tiles; /* a rank's tiles at most, not the T_max bound */
    assert_int_equal(p.tiles, d->max_tiles < bound ? d->max_tiles : bound);
    assert_int_equal(p.gathered, d->has_xg && (gu.kernel == GEMM_WS || gu.kernel == GEMM_WS64));
    assert_int_equal(p.act_f16, d->bf16_act);
    assert_true(p.act_rows == d->slots);
    for (int phase = PHASE_GATE_UP; phase <= PHASE_DOWN; phase++) {
        const gemm_phase_choice c = plan_gemm_phase(rule, d->slots, d->E, d->H, d->I, phase, d->nvfp4);
        const gemm_phase_plan *pp = &p.phase[phase];
        const int rows = gemm_phase_rows(phase, d->H, d->I), nkc = gemm_phase_nkc(phase, d->H, d->I);
        assert_int_equal(pp->kernel, c.kernel);
        assert_int_equal(pp->num_launches, 1);
        const gemm_launch *g = &pp->launch[0];
        assert_int_equal(g->kernel, c.kernel);
        assert_int_equal(g->phase, phase);
        assert_int_equal(g->tiles, p.tiles);
        check_instance(d, g);
        if (d->override_kernel == GEMM_AUTO)
            assert_false(gemm_forced_only(g->kernel, d->nvfp4));
        else
            assert_int_equal(g->kernel,
                             d->override_kernel == GEMM_STREAM && !d->nvfp4 ? GEMM_MMA : d->override_kernel);
        assert_false(g->walk && g->kernel != GEMM_WS &&
                     g->kernel != GEMM_WS64); /* wgmma walks with NCCL only */
        if (g->kernel == GEMM_MMA) {
            assert_int_equal(g->splits, c.mma.splits);
            assert_int_equal(g->grid[0], p.tiles);
            assert_int_equal(g->grid[1], rows / MM_MMA_ROWS);
            assert_int_equal(g->grid[2], d->local_ranks * g->splits);
        } else if (g->kernel == GEMM_WGMMA) {
            const int sp = plan_wgmma_splits(d->slots, d->E, rows / MM_WGMMA_ROWS, nkc).splits;
            assert_int_equal(g->splits, d->nvfp4 ? sp : 1);
            assert_int_equal(g->grid[0], p.tiles);
            assert_int_equal(g->grid[2], d->local_ranks * g->splits);
        } else if (g->kernel == GEMM_STREAM) {
            assert_int_equal(g->instance, plan_stream_variant(d->slots, d->E, d->E, rows / 128, nkc, d->sms));
            assert_int_equal(g->host_splits, plan_stream_splits(d->slots, d->E, rows / 128, nkc));
            assert_true(g->host_slots == d->slots);
            assert_true(g->grid[0] <= plan_stream_blocks_per_sm(g->instance) * d->sms); /* persistent */
            const int route = plan_route(1, d->R, d->slots / d->K, d->K, d->E_r, d->H);
            assert_int_equal(g->ordered, plan_route_orders_tiles(route, 1, d->slots, d->E));
        } else {
            assert_int_equal(g->walk, ws_walks(0, phase, d->nvfp4, d->I));
            assert_int_equal(g->split_n, d->nvfp4 && g->kernel == GEMM_WS && ws_split_n(d->slots, d->E));
            assert_int_equal(g->tma, d->local_ranks == 1 && (phase == PHASE_DOWN || p.gathered));
            const int items = rows / MM_WS_ROWS * p.tiles;
            assert_int_equal(g->grid[0], g->walk && items > ((d->sms - 1) | 1) ? (d->sms - 1) | 1 : items);
            assert_int_equal(g->grid[2], d->local_ranks);
        }
    }
}

/* NCCL: for every group count from this rank's to the bound, the kernel the device will choose is
 * launched, in the form the device will pick, with at least the splits it will plan. */
static void check_nccl(const gemm_desc *d) {
    const gemm_plan p = plan_gemm(d);
    const gemm_rule rule = {d->override_kernel};
    assert_int_equal(p.tiles, d->max_tiles);
    assert_int_equal(p.gathered, d->has_xg);
    assert_true(p.act_rows == d->max_slots);
    for (int phase = PHASE_GATE_UP; phase <= PHASE_DOWN; phase++) {
        const gemm_phase_plan *pp = &p.phase[phase];
        const int rows = gemm_phase_rows(phase, d->H, d->I), nkc = gemm_phase_nkc(phase, d->H, d->I);
        assert_true(pp->num_launches >= 1 && pp->num_launches <= GEMM_MAX_LAUNCHES);
        for (int i = 0; i < pp->num_launches; i++) {
            check_instance(d, &pp->launch[i]);
            if (pp->launch[i].kernel == GEMM_WGMMA || pp->launch[i].kernel == GEMM_WS ||
                pp->launch[i].kernel == GEMM_WS64)
                assert_true(pp->launch[i].walk); /* a grid of about one wave over the T_max bound */
            if (pp->launch[i].kernel == GEMM_STREAM) assert_int_equal(pp->launch[i].host_splits, 0);
        }
        for (long S = d->slots; S <= d->max_slots; S += (d->max_slots - d->slots) / 9 + 1) {
            const gemm_phase_choice c = plan_gemm_phase(rule, S, d->E, d->H, d->I, phase, d->nvfp4);
            int found = 0;
            for (int i = 0; i < pp->num_launches; i++) {
                const gemm_launch *g = &pp->launch[i];
                if (g->kernel != c.kernel) continue;
                if (g->kernel == GEMM_MMA) assert_true(c.mma.splits <= g->splits);
                if (g->kernel == GEMM_WGMMA && d->nvfp4)
                    assert_true(plan_wgmma_splits(S, d->E, rows / MM_WGMMA_ROWS, nkc).splits <= g->splits);
                if (g->kernel == GEMM_WS && g->split_n != (d->nvfp4 && ws_split_n(S, d->E))) continue;
                found = 1;
            }
            assert_true(found);
        }
    }
}

static const int k_overrides[] = {GEMM_AUTO, GEMM_MMA, GEMM_WGMMA, GEMM_STREAM, GEMM_WS, GEMM_WS64};

static void test_plan_one_process(void **state) {
    (void)state;
    for (int a = 0; a < N(k_E); a++)
        for (int b = 0; b < N(k_K); b++)
            for (int c = 0; c < N(k_HI); c++)
                for (int t = 0; t < N(k_T); t++)
                    for (int R = 1; R <= 8; R *= 2)
                        for (int nvfp4 = 0; nvfp4 <= 1; nvfp4++)
                            for (int o = 0; o < N(k_overrides); o++) {
                                const int T_max = k_T[N(k_T) - 1];
                                const gemm_desc d =
                                    desc_of(k_E[a], k_K[b], k_HI[c][0], k_HI[c][1], R, R, T_max,
                                            (long)R * k_T[t] * k_K[b], nvfp4, k_overrides[o]);
                                if (d.slots == 0) {
                                    assert_int_equal(plan_gemm(&d).tiles, 0); /* no tile: nothing runs */
                                    continue;
                                }
                                check_one_process(&d);
                            }
}

static void test_plan_nccl_holds_the_groups_launch(void **state) {
    (void)state;
    for (int a = 0; a < N(k_E); a++)
        for (int b = 0; b < N(k_K); b++)
            for (int c = 0; c < N(k_HI); c++)
                for (int R = 2; R <= 8; R *= 2)
                    for (int t = 0; t < N(k_T); t += 3)
                        for (int nvfp4 = 0; nvfp4 <= 1; nvfp4++)
                            for (int o = 0; o < N(k_overrides); o++) {
                                const int T_max = 512, T = k_T[t] < T_max ? k_T[t] : T_max;
                                const gemm_desc d = desc_of(k_E[a], k_K[b], k_HI[c][0], k_HI[c][1], R, 1,
                                                            T_max, (long)T * k_K[b], nvfp4, k_overrides[o]);
                                check_nccl(&d);
                            }
}

/* The compiled set: the rules never choose a forced-only instance (NVFP4 on mma.sync, BF16 on wgmma),
 * so a release build (MEGAMOE_FORCED_KERNELS off) runs every forward it does not refuse at finalize. */
static void test_forced_only_instances(void **state) {
    (void)state;
    for (int nvfp4 = 0; nvfp4 <= 1; nvfp4++) {
        assert_int_equal(gemm_forced_only(GEMM_MMA, nvfp4), nvfp4);
        assert_int_equal(gemm_forced_only(GEMM_WGMMA, nvfp4), !nvfp4);
        assert_false(gemm_forced_only(GEMM_STREAM, nvfp4) || gemm_forced_only(GEMM_WS, nvfp4) ||
                     gemm_forced_only(GEMM_WS64, nvfp4));
        for (int o = 0; o < N(k_overrides); o++) {
            const int k = k_overrides[o];
            const int forced_only = (k == GEMM_MMA && nvfp4) || (k == GEMM_WGMMA && !nvfp4);
            assert_int_equal(gemm_override_built(k, nvfp4), MM_FORCED_KERNELS || !forced_only);
        }
        for (int a = 0; a < N(k_E); a++)
            for (int c = 0; c < N(k_HI); c++)
                for (long slots = 0; slots <= 1L << 20; slots = slots * 2 + 1)
                    for (int split = 1; split <= 8; split++) {
                        const int mk = k_HI[c][0] < k_HI[c][1] ? k_HI[c][0] : k_HI[c][1];
                        assert_false(
                            gemm_forced_only(gemm_choice(GEMM_AUTO, slots, k_E[a], split, nvfp4, mk), nvfp4));
                    }
    }
    /* The rows' bits: each family's table indexes every combination once. */
    assert_int_equal(mma_instance(PHASE_DOWN, 1, 1), MMA_INSTANCES - 1);
    assert_int_equal(wgmma_instance(PHASE_DOWN, 1, 1, 1), WGMMA_INSTANCES - 1);
    assert_int_equal(ws_instance(PHASE_DOWN, 1, 1, 1, 1), WS_INSTANCES - 1);
    assert_false(ws_instance_built(PHASE_GATE_UP, 1, 1, 0, 0)); /* gate/up always walks */
    assert_false(ws_instance_built(PHASE_DOWN, 0, 1, 1, 1));    /* split_n: the NVFP4 128-token form's */
    assert_false(ws_instance_built(PHASE_DOWN, 1, 0, 1, 1));
}

/* The routing (dispatch.cu's table): the warp for one token of one rank in one process only, the one
 * kernel up to MM_ROUTE_ONE_KERNEL_SLOTS in one process only, never across GPUs; the chunks exactly
 * where the buffer layout holds their counts; the tile order only on the one kernel. */
static void test_route_rules(void **state) {
    (void)state;
    assert_int_equal(plan_route(1, 1, 1, 8, 256, 7168), ROUTE_WARP);
    assert_int_equal(plan_route(1, 1, 0, 8, 256, 7168),
                     ROUTE_WARP); /* no token: the warp writes empty tables */
    assert_int_equal(plan_route(1, 1, 2, 8, 256, 7168), ROUTE_ONE_KERNEL);
    assert_int_equal(plan_route(1, 2, 1, 8, 128, 7168), ROUTE_ONE_KERNEL); /* two ranks in one process */
    assert_int_equal(plan_route(1, 1, 1, 8, MM_ROUTE_WARP_EXPERTS + 1, 7168), ROUTE_ONE_KERNEL);
    assert_int_equal(plan_route(1, 1, 1, 8, 256, 16384), ROUTE_ONE_KERNEL); /* no room for a warp more */
    assert_int_equal(plan_route(1, 1, MM_ROUTE_ONE_KERNEL_SLOTS / 8, 8, 256, 7168), ROUTE_ONE_KERNEL);
    assert_int_equal(plan_route(1, 1, MM_ROUTE_ONE_KERNEL_SLOTS / 8 + 1, 8, 256, 7168), ROUTE_CHUNKS);
    assert_int_equal(plan_route(1, 1, 4, 8, MM_ROUTE_ONE_KERNEL_EXPERTS + 1, 7168), ROUTE_PER_EXPERT);
    for (int E_r = 1; E_r <= 4 * MM_ROUTE_CHUNK_EXPERTS; E_r = E_r * 3 + 1)
        for (long T = 0; T <= 4096; T = T * 4 + 1) {
            assert_int_not_equal(plan_route(0, 2, T, 8, E_r, 7168), ROUTE_WARP); /* across GPUs: the counts */
            assert_int_not_equal(plan_route(0, 2, T, 8, E_r, 7168),
                                 ROUTE_ONE_KERNEL); /* are not the host's */
            for (int one = 0; one <= 1; one++) {
                const int route = plan_route(one, 1, T, 8, E_r, 7168);
                mm_buffer_layout l;
                mm_buffer_layout_compute(64, 8, 7168, 1, 0, 1, E_r, 2048, &l);
                if (route == ROUTE_CHUNKS) assert_true(l.route_chunks_per_src > 0);
                if (route == ROUTE_PER_EXPERT) assert_int_equal(l.route_chunks_per_src, 0);
                if (plan_route_orders_tiles(route, 1, T * 8, E_r)) assert_int_equal(route, ROUTE_ONE_KERNEL);
            }
        }
    assert_true(plan_route_orders_tiles(ROUTE_ONE_KERNEL, 1, 128, 256));
    assert_false(plan_route_orders_tiles(ROUTE_ONE_KERNEL, 1, 127, 256));
    assert_false(plan_route_orders_tiles(ROUTE_ONE_KERNEL, 0, 128, 256)); /* BF16: no streaming kernel */
    assert_true(plan_route_orders_tiles(ROUTE_ONE_KERNEL, 1, 16L * 16, 16));
    assert_false(
        plan_route_orders_tiles(ROUTE_ONE_KERNEL, 1, 16L * 16 + 1, 16)); /* past the streaming regime */
    assert_false(plan_route_orders_tiles(ROUTE_CHUNKS, 1, 256, 256));
}

/* The streaming kernel's instantiation: the wide one exactly above 8 slots per expert on average,
 * the grouped layout from 4 up to there; the other three only below, in their order of precedence. */
static void test_stream_variants(void **state) {
    (void)state;
    assert_int_equal(MM_STREAM_GROUPED_MIN_AVG,
                     4); /* the grouped layout: faster from ~4 per expert, slower at ~1 */
    assert_int_equal(MM_STREAM_WIDE_ABOVE,
                     8); /* 32-token chunks: a tile's weights streamed once, not twice */
    assert_int_equal(MM_STREAM_ROLL_BELOW, 16); /* Qwen3-like: 8 and 12 steps rolled, 28 and more unrolled */
    const int Es[] = {8, 64, 128, 256}, ys[] = {2, 12, 16, 56}, nkcs[] = {8, 12, 32, 112};
    for (int a = 0; a < N(Es); a++)
        for (int b = 0; b < N(ys); b++)
            for (int c = 0; c < N(nkcs); c++)
                for (long slots = 1; slots <= 24L * Es[a]; slots += 1 + slots / 3) {
                    const int E = Es[a], y = ys[b], nkc = nkcs[c];
                    const int v = plan_stream_variant(slots, E, E, y, nkc, MM_PLAN_SMS);
                    assert_true(v >= 0 && v < STREAM_VARIANTS);
                    assert_int_equal(v == STREAM_WIDE, slots > (long)MM_STREAM_WIDE_ABOVE * E);
                    assert_int_equal(v == STREAM_GROUPED, slots >= (long)MM_STREAM_GROUPED_MIN_AVG * E &&
                                                              slots <= (long)MM_STREAM_WIDE_ABOVE * E);
                    if (v == STREAM_MORE_BLOCKS)
                        assert_true(plan_stream_more_blocks(slots, E, E, y, nkc, MM_PLAN_SMS));
                    if (v == STREAM_ROLLED) assert_true(plan_stream_rolled(slots, E, y, nkc));
                    if (v == STREAM_PER_SLOT)
                        assert_true(!plan_stream_more_blocks(slots, E, E, y, nkc, MM_PLAN_SMS) &&
                                    !plan_stream_rolled(slots, E, y, nkc));
                }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_splits_fit_the_workspace),
        cmocka_unit_test(test_wgmma_splits_fit_the_workspace),
        cmocka_unit_test(test_mma_splits_fit_the_workspace),
        cmocka_unit_test(test_nccl_launch_bounds_hold),
        cmocka_unit_test(test_layout_reserves_the_workspace),
        cmocka_unit_test(test_gemm_choice_rules),
        cmocka_unit_test(test_tile_order_is_a_sorted_permutation),
        cmocka_unit_test(test_ws_items_cover_every_block_once),
        cmocka_unit_test(test_route_rules),
        cmocka_unit_test(test_stream_variants),
        cmocka_unit_test(test_ws_rules),
        cmocka_unit_test(test_gather_and_combine_rules),
        cmocka_unit_test(test_stream_blocks),
        cmocka_unit_test(test_plan_one_process),
        cmocka_unit_test(test_plan_nccl_holds_the_groups_launch),
        cmocka_unit_test(test_forced_only_instances),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
