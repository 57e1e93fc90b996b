/*
 * test_plan.c -- the invariants of the expert GEMMs' plans (src/cuda/gemm_plan.h), on the host, over
 * a grid of shapes, token counts and rank counts: the partial sums every split-K plan asks for fit
 * the split-K workspace the buffer layout reserves (a plan past it would write into the next region),
 * splits keep 8 or more K steps, and the bounds the NCCL host launch relies on hold (a rank's own
 * count bounds what the group's count can plan and choose).
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
static const int k_T[] = {0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 100, 127, 128, 129, 500, 512, 1000, 2048, 4096, 8192};
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
    assert_true(l.expert_count - l.slot_scale >= (uint64_t)2 * 64 * 8 * 4); /* a scale per slot row of the rank */
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
    assert_true(big.route_chunks > 0 && big.error - big.route_chunks >= (uint64_t)2 * big.route_chunks_per_src * 128 * 4);
    mm_buffer_layout many;
    mm_buffer_layout_compute(64, 8, 256, 1, 0, 1, MM_ROUTE_CHUNK_EXPERTS + 1, 256, &many); /* routed per expert */
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
                const int left = hist[e] - i * MM_TILE_TOKENS, c = left < MM_TILE_TOKENS ? left : MM_TILE_TOKENS;
                int at = 0;
                for (int x = 0; x < E; x++) at += tile_order_before(hist[x], x, e, i, c);
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

static void test_gemm_choice_rules(void **state) {
    (void)state;
    for (int force = 1; force <= 2; force++) assert_int_equal(gemm_choice(force, 5, 256, 4, 1, 2048), force);
    assert_int_equal(gemm_choice(GEMM_WS, 5, 256, 4, 0, 2048), GEMM_WS);
    assert_int_equal(gemm_choice(GEMM_WS64, 5, 256, 4, 1, 2048), GEMM_WS64);
    for (long slots = 1; slots <= 1L << 20; slots *= 4) /* NVFP4 with K of 2048: never on 64-token blocks */
        assert_true(gemm_choice(0, slots, 256, 1, 1, 2048) != GEMM_WS64);
    /* NVFP4 with both K >= 4096: on 64-token blocks above 16 per expert, up to MM_WS_MIN_TOKENS. */
    assert_int_equal(gemm_choice(0, 16L * 8, 8, 1, 1, 4096), GEMM_STREAM); /* up to there streaming */
    assert_int_equal(gemm_choice(0, 16L * 8 + 1, 8, 1, 1, 4096), GEMM_WS64);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 8 - 1, 8, 1, 1, 4096), GEMM_WS64);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 8, 8, 1, 1, 4096), GEMM_WS);
    assert_int_equal(gemm_choice(0, 8L * 8, 8, 1, 1, 4096), GEMM_STREAM);
    assert_int_equal(gemm_choice(0, (long)MM_STREAM_MAX_AVG * 8, 8, 1, 1, 4096), GEMM_STREAM);
    /* The warp-specialized kernel from MM_WS_MIN_TOKENS per expert (NVFP4 at any K; BF16: unsplit only). */
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256, 256, 1, 1, 2048), GEMM_WS);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256 - 1, 256, 1, 1, 2048), GEMM_WGMMA);
    /* NVFP4 with a short K (Qwen3-like I = 768): ws from MM_WS_MIN_TOKENS (64) per expert as well. */
    assert_int_equal(MM_WS_MIN_TOKENS, 64);
    assert_int_equal(gemm_choice(0, 64L * 128 - 1, 128, 1, 1, 768), GEMM_WGMMA);
    assert_int_equal(gemm_choice(0, 64L * 128, 128, 1, 1, 768), GEMM_WS);
    assert_int_equal(gemm_choice(0, 256L * 128, 128, 1, 0, 768), GEMM_WS);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256, 256, 1, 0, 2048), GEMM_WS);
    assert_int_equal(gemm_choice(0, (long)MM_WS_MIN_TOKENS * 256, 256, 2, 0, 2048), GEMM_WS64); /* split: 64-token */
    assert_int_equal(gemm_choice(GEMM_STREAM, 5, 256, 4, 1, 2048), GEMM_STREAM);
    assert_int_equal(gemm_choice(GEMM_STREAM, 5, 256, 4, 0, 2048), GEMM_MMA); /* BF16 has no streaming kernel */
    /* NVFP4 (chosen): streaming up to MM_STREAM_MAX_AVG (16) slots per expert on average, wgmma above. */
    assert_int_equal(MM_STREAM_MAX_AVG, 16);
    assert_int_equal(gemm_choice(0, 8L * 256 + 1, 256, 1, 1, 2048), GEMM_STREAM);
    assert_int_equal(gemm_choice(0, 16L * 256, 256, 1, 1, 2048), GEMM_STREAM);
    assert_int_equal(gemm_choice(0, 16L * 256 + 1, 256, 1, 1, 2048), GEMM_WGMMA);
    /* BF16: the 64-token warp-specialized kernel from 4 per expert (split planned or not), mma.sync below. */
    assert_int_equal(gemm_choice(0, 4L * 256, 256, 1, 0, 2048), GEMM_WS64);
    assert_int_equal(gemm_choice(0, 4L * 256, 256, 1, 0, 768), GEMM_WS64);
    assert_int_equal(gemm_choice(0, 4L * 256, 256, 2, 0, 2048), GEMM_WS64);
    assert_int_equal(gemm_choice(0, 4L * 256 - 1, 256, 1, 0, 2048), GEMM_MMA);
    assert_int_equal(gemm_choice(0, 4L * 256 - 1, 256, 2, 0, 2048), GEMM_MMA);
}

/* The routing (dispatch.cu's table): the warp for one token of one rank in one process only, the one
 * kernel up to MM_ROUTE_ONE_KERNEL_SLOTS in one process only, never across GPUs; the chunks exactly
 * where the buffer layout holds their counts; the tile order only on the one kernel. */
static void test_route_rules(void **state) {
    (void)state;
    assert_int_equal(plan_route(1, 1, 1, 8, 256, 7168), ROUTE_WARP);
    assert_int_equal(plan_route(1, 1, 0, 8, 256, 7168), ROUTE_WARP);    /* no token: the warp writes empty tables */
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
            assert_int_not_equal(plan_route(0, 2, T, 8, E_r, 7168), ROUTE_ONE_KERNEL); /* are not the host's */
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
    assert_false(plan_route_orders_tiles(ROUTE_ONE_KERNEL, 1, 16L * 16 + 1, 16)); /* past the streaming regime */
    assert_false(plan_route_orders_tiles(ROUTE_CHUNKS, 1, 256, 256));
}

/* The streaming kernel's instantiation: the wide one exactly above 8 slots per expert on average,
 * the grouped layout from 4 up to there; the other three only below, in their order of precedence. */
static void test_stream_variants(void **state) {
    (void)state;
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
                    if (v == STREAM_MORE_BLOCKS) assert_true(plan_stream_more_blocks(slots, E, E, y, nkc, MM_PLAN_SMS));
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
