/*
 * test_gpu.c -- the CUDA backend against the CPU backend on fresh random data. Exits 77 (ctest:
 * skipped, and said so) when this machine has no usable sm_90 GPU or the build has no CUDA.
 *   - quantized activation bytes bit-identical to the CPU's;
 *   - y within relative L2 1e-3 of the CPU over a grid of shapes (T = 1, T not a multiple of the
 *     tile, T = T_max, experts with no tokens, all tokens on one expert, -1 slots, padding, NaN/Inf
 *     tokens, K = 1 and 8, E from 8 to 256, H/I at 256 and at 7168/2048), NaN and zero rows exact;
 *   - one token with each of those edge cases (its staging and routing take their own path on one
 *     rank: the stage block routes it);
 *   - y bitwise identical for R = 1, 2, 4, 8 ranks on one GPU;
 *   - a forward captured in a CUDA graph and replayed on new inputs;
 *   - bad expert ids reported by megamoe_layer_check; memory accounting;
 *   - a forward finishes while a kernel on another stream holds part of every SM.
 * MEGAMOE_TEST_SEED=N runs every case on other random data (the seeds offset by N).
 * Outputs are poisoned (0xFFFF) before every run so unwritten elements are caught, and so are the
 * intermediate p and act buffers (NaN), so a row read but not written this forward shows in y.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "cuda/gemm_plan.h" /* which GEMM kernel a forward takes */
#include "gpu_occupier.h"
#include "internal.h"
#include "test_util.h"

#ifdef MEGAMOE_HAVE_NCCL
#include <nccl.h>
/* A 1-rank communicator: the NCCL backend runs the same cases as the CUDA backend (issue 4 item 3). */
static ncclComm_t g_comm;
static int g_have_comm;
#endif

#define CK(call)                                                                                             \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(e_));                            \
    } while (0)

/* Device copies of a tu_inputs and a y buffer. */
typedef struct dev_inputs {
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    uint8_t *pad;
} dev_inputs;

static void dev_upload(dev_inputs *d, const tu_inputs *in) {
    const size_t T = (size_t)in->T, H = (size_t)in->H, K = (size_t)in->K;
    CK(cudaMalloc((void **)&d->x, T * H * 2 + 16));
    CK(cudaMalloc((void **)&d->y, T * H * 2 + 16));
    CK(cudaMalloc((void **)&d->ids, T * K * 4 + 16));
    CK(cudaMalloc((void **)&d->w, T * K * 4 + 16));
    CK(cudaMalloc((void **)&d->pad, T + 16));
    CK(cudaMemcpy(d->x, in->x, T * H * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d->ids, in->ids, T * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d->w, in->weights, T * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d->pad, in->padding, T, cudaMemcpyHostToDevice));
}

static void dev_free(dev_inputs *d) {
    cudaFree(d->x), cudaFree(d->y), cudaFree(d->ids), cudaFree(d->w), cudaFree(d->pad);
}

/* The expert GEMM kernel of every device layer: MEGAMOE_GEMM=mma|wgmma|stream|ws|ws64 forces one (the suite
 * runs once per kernel on the GPU machine: bench/device/check.sh tests), else chosen per forward. */
static int g_gemm_kernel;
/* The activation modes the NVFP4 grid cases run in (SPEC §3b): bit 0 bf16 (W4A16), bit 1 nvfp4;
 * MEGAMOE_TEST_ACTIVATIONS=bf16|nvfp4 takes one (the suite runs both by default). */
static int g_act_modes = 3;
/* "nvfp4" (NVFP4 weights and activations), "w4a16" (NVFP4 weights, bf16 activations) or "bf16 " */
static const char *mode_name(const megamoe_layer_config *c) {
    return c->format == MEGAMOE_FORMAT_BF16              ? "bf16 "
           : c->activations == MEGAMOE_ACTIVATIONS_NVFP4 ? "nvfp4"
                                                         : "w4a16";
}

static void make_layer(const tu_model *m, megamoe_backend backend, int R, megamoe_group **g,
                       megamoe_layer **l) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.backend = backend;
    gc.num_ranks = R;
#ifdef MEGAMOE_HAVE_NCCL
    if (backend == MEGAMOE_BACKEND_NCCL) gc.nccl_comm = g_comm;
#endif
    megamoe_status st = megamoe_group_create(&gc, g);
    if (st) fail_msg("group: %s", megamoe_group_last_error(*g));
    megamoe_layer_config cfg = m->cfg;
    cfg.gemm_kernel = g_gemm_kernel;
    st = megamoe_layer_create(*g, &cfg, l);
    if (st == MEGAMOE_OK) st = tu_model_load(m, *l);
    if (st == MEGAMOE_OK) st = megamoe_layer_finalize(*l);
    if (st) fail_msg("layer: %s", megamoe_layer_last_error(*l));
}

/* Splits the tokens over the R ranks like tu_forward, with device pointers. */
static megamoe_status gpu_forward(megamoe_group *g, megamoe_layer *l, const tu_inputs *in,
                                  const dev_inputs *d, cudaStream_t s) {
    megamoe_forward_args args[72];
    tu_split_args(in, megamoe_group_local_ranks(g), d->x, d->ids, d->w, d->pad, d->y, args);
    return megamoe_layer_forward(l, args, s);
}

/* Every local rank's expert outputs p [T_max, K, H] f32 and down-projection input act [R T_max K, I]
 * 16-bit set to NaN, so a forward that reads a row of either it did not write this forward (a bulk
 * or scattered store left out, a split-K finisher that never ran) gives NaN in y, and the stale
 * values of the case before cannot stand in for it. Only rows past a tile's tokens are read without
 * being written, and they feed token columns the epilogues drop. */
static void poison_buffers(megamoe_layer *l) {
    const mm_buffer *b = l->buffer;
    const uint64_t T = (uint64_t)b->key[1], K = (uint64_t)b->key[2], H = (uint64_t)b->key[3],
                   I = (uint64_t)b->key[4], R = (uint64_t)l->group->world_size;
    for (int r = 0; r < l->group->local_ranks; r++) {
        uint8_t *base = b->rank_base[r];
        CK(cudaMemset(base + b->layout.p, 0xFF, T * K * H * 4));
        CK(cudaMemset(base + b->layout.act, 0xFF, R * T * K * I * 2));
    }
}

static uint16_t *gpu_run(megamoe_group *g, megamoe_layer *l, const tu_inputs *in, dev_inputs *d) {
    const size_t n = (size_t)in->T * in->H;
    CK(cudaMemset(d->y, 0xFF, n * 2 + 2));
    poison_buffers(l);
    megamoe_status st = gpu_forward(g, l, in, d, NULL);
    if (st) fail_msg("forward: %s", megamoe_layer_last_error(l));
    st = megamoe_layer_check(l);
    if (st) fail_msg("check: %s", megamoe_layer_last_error(l));
    uint16_t *y = malloc(n * 2 + 2);
    CK(cudaMemcpy(y, d->y, n * 2, cudaMemcpyDeviceToHost));
    return y;
}

/* Every case's data seed, offset by MEGAMOE_TEST_SEED (default 0: the seeds the recorded runs used),
 * so the suite can be run on other fresh data: MEGAMOE_TEST_SEED=N test_gpu. */
static uint64_t g_seed_offset;
static uint64_t seed(uint64_t s) { return s + g_seed_offset * 0x9E3779B97F4A7C15ull; }

/* y_gpu against y_cpu: tu_compare_y's rules (every element written, the CPU's NaN and zero rows),
 * then relative L2 <= tol (tu_device_tol: test_util.h says why those bounds). */
static double compare(const tu_inputs *in, const uint16_t *y_gpu, const uint16_t *y_cpu, const char *what,
                      double tol) {
    char why[160];
    const double rel = tu_compare_y(in, y_gpu, y_cpu, why, sizeof why);
    if (rel < 0) fail_msg("%s: %s", what, why);
    printf("  %-58s rel L2 vs CPU %.2e\n", what, rel);
    if (!(rel <= tol)) fail_msg("%s: relative L2 %.3e over %.0e", what, rel, tol);
    return rel;
}

typedef struct grid_case {
    int E, K, H, I, T, T_max;
    int one_expert; /* every token's first slot on expert 1, the others empty */
    int edge1;      /* T = 1: one edge case on the only token (one_token_edge) */
} grid_case;

/* The edge cases of tu_inputs_edge_cases (tokens 1-7 of T >= 8) on a forward of one token, whose
 * staging and routing take their own path on one rank (the stage block routes it). */
static void one_token_edge(tu_inputs *in, int v) {
    const int K = in->K, H = in->H;
    switch (v) {
    case 1: in->padding[0] = 1; break;
    case 2: in->x[7] = 0x7FC0; break;       /* NaN */
    case 3: in->x[100 % H] = 0x7F80; break; /* +Inf */
    case 4:
        for (int k = 0; k < K; k++)
            in->ids[k] = -1;
        break;
    case 5: in->ids[K - 1] = -1; break;
    case 6:
        if (K >= 2) in->ids[1] = in->ids[0]; /* one expert twice */
        break;
    case 7:
        for (int h = 0; h < H; h++)
            in->x[h] = 0;
        break;
    default: break;
    }
}

static void run_case_act(megamoe_weight_format fmt, megamoe_activations act, const grid_case *gc,
                         const int *Rs, int nR) {
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "gpu.test";
    c.num_experts = gc->E, c.top_k = gc->K, c.hidden_size = gc->H, c.intermediate_size = gc->I;
    c.max_tokens = gc->T_max, c.format = fmt, c.activations = act;
    tu_model m;
    tu_model_random(&m, &c, 1, seed((uint64_t)(gc->E * 131 + gc->H + gc->T + fmt)));
    tu_inputs in;
    tu_inputs_edge_cases(&in, gc->T, &c, seed((uint64_t)gc->T * 7 + 1));
    if (gc->one_expert)
        for (int t = 0; t < gc->T; t++)
            for (int k = 0; k < gc->K; k++)
                in.ids[t * gc->K + k] = k == 0 ? 1 : -1;
    if (gc->edge1 && gc->T == 1) one_token_edge(&in, gc->edge1);
    megamoe_group *g;
    megamoe_layer *l;
    /* CPU reference: one rank holding all tokens. */
    megamoe_layer_config cc = c;
    cc.max_tokens = gc->T > 0 ? gc->T : 1;
    tu_model mc = m;
    mc.cfg = cc;
    make_layer(&mc, MEGAMOE_BACKEND_CPU, 1, &g, &l);
    uint16_t *y_cpu = malloc((size_t)gc->T * gc->H * 2 + 2);
    assert_int_equal(tu_forward(g, l, &in, y_cpu), MEGAMOE_OK);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    dev_inputs d;
    dev_upload(&d, &in);
    uint16_t *y_first = NULL;
    for (int i = 0; i < nR; i++) {
        const int R = Rs[i];
        if (gc->E % R || (gc->T + R - 1) / R > gc->T_max) continue;
        make_layer(&m, MEGAMOE_BACKEND_CUDA, R, &g, &l);
        uint16_t *y = gpu_run(g, l, &in, &d);
        char what[160];
        snprintf(what, sizeof what, "%s E=%d K=%d H=%d I=%d T=%d T_max=%d R=%d%s edge %d", mode_name(&c),
                 gc->E, gc->K, gc->H, gc->I, gc->T, gc->T_max, R, gc->one_expert ? " one-expert" : "",
                 gc->edge1);
        compare(&in, y, y_cpu, what, tu_device_tol(&c));
        if (!y_first)
            y_first = y;
        else {
            if (memcmp(y, y_first, (size_t)gc->T * gc->H * 2) != 0)
                fail_msg("%s: y differs from R=%d", what, Rs[0]);
            free(y);
        }
        megamoe_layer_destroy(l);
        megamoe_group_destroy(g);
    }
#ifdef MEGAMOE_HAVE_NCCL
    if (g_have_comm && y_first &&
        gc->T <= gc->T_max) { /* the NCCL backend, one rank: bitwise equal to the CUDA backend */
        make_layer(&m, MEGAMOE_BACKEND_NCCL, 1, &g, &l);
        uint16_t *y = gpu_run(g, l, &in, &d);
        char what[160];
        snprintf(what, sizeof what, "%s E=%d K=%d H=%d I=%d T=%d NCCL 1 rank", mode_name(&c), gc->E, gc->K,
                 gc->H, gc->I, gc->T);
        compare(&in, y, y_cpu, what, tu_device_tol(&c));
        if (memcmp(y, y_first, (size_t)gc->T * gc->H * 2) != 0)
            fail_msg("%s: y differs from the CUDA backend", what);
        free(y);
        megamoe_layer_destroy(l);
        megamoe_group_destroy(g);
    }
#endif
    free(y_first);
    free(y_cpu);
    dev_free(&d);
    tu_inputs_free(&in);
    tu_model_free(&m);
}

/* A grid case in each activation mode enabled (NVFP4; a BF16 layer has bf16 activations only). The
 * same model and inputs in both modes. */
static void run_case(megamoe_weight_format fmt, const grid_case *gc, const int *Rs, int nR) {
    if (fmt == MEGAMOE_FORMAT_BF16) {
        run_case_act(fmt, MEGAMOE_ACTIVATIONS_BF16, gc, Rs, nR);
        return;
    }
    if (g_act_modes & 2) run_case_act(fmt, MEGAMOE_ACTIVATIONS_NVFP4, gc, Rs, nR);
    if (g_act_modes & 1) run_case_act(fmt, MEGAMOE_ACTIVATIONS_BF16, gc, Rs, nR);
}

static const int k_ranks[] = {1, 2, 4, 8};

/* One token with each edge case, both formats, on one rank (the stage block routes it) and two (one
 * rank empty; the last of the stage blocks routes). Among the --quick tests: kept small. */
static void test_one_token(void **state) {
    (void)state;
    static const int ranks[] = {1, 2};
    for (int f = 0; f < 2; f++)
        for (int v = 0; v <= 7; v++) {
            const grid_case gc = {16, 4, 256, 256, 1, 4, 0, v};
            run_case((megamoe_weight_format)f, &gc, ranks, 2);
        }
}

static void test_grid_small(void **state) {
    (void)state;
    const grid_case cases[] = {
        {8, 2, 256, 256, 1, 1, 0, 0},
        {8, 2, 256, 256, 77, 128, 0, 0},
        {8, 2, 256, 256, 128, 128, 0, 0},
        {8, 4, 256, 512, 0, 16, 0, 0},
        {16, 1, 512, 768, 33, 40, 0, 0},
        {8, 8, 256, 256, 50, 64, 0, 0},
        {8, 2, 256, 256, 200, 200, 1, 0},
        {256, 8, 256, 256, 64, 64, 0, 0},
        /* Every token of R = 4, 8 ranks on rank 0's expert 1: 256 slot rows, more than the gathered
         * copy holds (MM_GATHER_CAP * T_max * K = 128), so a gathering build reads them in place. */
        {8, 1, 256, 256, 256, 64, 1, 0},
        /* 192 slots on 256 experts (~135 reached, ~540 gate/up items): the streaming kernel's
         * instantiation with one block per SM more (plan_stream_more_blocks) */
        {256, 4, 256, 256, 48, 48, 0, 0},
        /* More than MM_ROUTE_ONE_KERNEL_SLOTS (1024) slots: the chunked routing (chunks of MM_ROUTE_CHUNK
         * slots per home rank, the last partial); and 600 rows on one expert through it. */
        {16, 8, 256, 256, 1100, 1100, 0, 0},
        {8, 8, 256, 256, 600, 600, 1, 0},
        /* A split of an odd number of K steps: the gate/up projection's 36 steps (H = 2304) in 4
         * splits of 9 on the streaming kernel, whose per-slot ring holds two steps a slot, so each
         * split ends on a half-used slot. */
        {8, 2, 2304, 256, 1, 1, 0, 0},
        /* The same splits of 9 K steps in the grouped ring layout (34 slots on 8 experts: 4 or more
         * per expert), every token on one expert: each split walks chunks of 16, 16 and 1-2 tokens
         * (padding), so a chunk ends on a half-used slot, the next starts in the middle of a group
         * of slots its token rows share, and the last copies its rows per slot (fewer than 3). */
        {8, 1, 2304, 256, 34, 34, 1, 0},
        /* Over 8 slots per expert: the streaming kernel's wide instantiation (32-token chunks, 3
         * blocks per SM). 192 slots on 16 experts: chunks of up to 32 tokens, 4 or 2 n-tiles; and 80
         * tokens on one expert with gate/up in 4 splits of 9 K steps: a 64-token tile as two chunks
         * of 32 in the consumers and in the split-K finisher, then a tile of 16. */
        {16, 4, 256, 512, 48, 48, 0, 0},
        {8, 1, 2304, 256, 80, 80, 1, 0},
    };
    /* Under MEGAMOE_GEMM=ws: the NVFP4 128-token blocks' m64n128 form (1100 and 600 rows) and their
     * split form (the rest; 400 rows on one expert: full items, every part). */
    assert_false(ws_split_n(1100 * 8, 16));
    assert_false(ws_split_n(600 * 8, 8));
    assert_true(ws_split_n(200 * 2, 8));
    assert_true(plan_stream_more_blocks(48 * 4, 256, 256, 2 * 256 / 128, 256 / 64, MM_PLAN_SMS));
    assert_int_equal(plan_stream_splits(2, 8, 2 * 256 / 128, 2304 / 64), 4);
    assert_int_equal(plan_stream_variant(34, 8, 8, 2 * 256 / 128, 2304 / 64, MM_PLAN_SMS), STREAM_GROUPED);
    assert_int_equal(plan_stream_splits(34, 8, 2 * 256 / 128, 2304 / 64), 4);
    assert_int_equal(plan_stream_variant(48 * 4, 16, 16, 2 * 512 / 128, 256 / 64, MM_PLAN_SMS), STREAM_WIDE);
    assert_int_equal(plan_stream_variant(80, 8, 8, 2 * 256 / 128, 2304 / 64, MM_PLAN_SMS), STREAM_WIDE);
    assert_int_equal(plan_stream_splits(80, 8, 2 * 256 / 128, 2304 / 64), 4);
    for (int f = 0; f < 2; f++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            run_case((megamoe_weight_format)f, &cases[i], k_ranks, 4);
}

static void test_grid_large(void **state) {
    (void)state;
    /* The third: one token on 5 experts splits the gate/up projection's 112 K steps 3 ways (37, 37,
     * 38) on the streaming kernel's unrolled loop, two of them ending on a half-used ring slot. */
    const grid_case cases[] = {
        {8, 8, 7168, 2048, 20, 20, 0, 0}, {16, 4, 2048, 768, 300, 300, 0, 0}, {8, 5, 7168, 2048, 1, 1, 0, 0}};
    assert_int_equal(plan_stream_splits(5, 8, 2 * 2048 / 128, 7168 / 64), 3);
    for (int f = 0; f < 2; f++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            run_case((megamoe_weight_format)f, &cases[i], k_ranks, 2);
}

/* The quantized activations the GPU stages are the CPU's bytes. */
static void test_activation_bytes(void **state) {
    (void)state;
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "gpu.bytes";
    c.num_experts = 8, c.top_k = 2, c.hidden_size = 1024, c.intermediate_size = 256, c.max_tokens = 300;
    c.activations = MEGAMOE_ACTIVATIONS_NVFP4; /* the quantized bytes of SPEC §3 */
    tu_model m;
    tu_model_random(&m, &c, 0, seed(5));
    tu_inputs in;
    tu_inputs_edge_cases(&in, 300, &c, seed(6));
    for (int t = 8; t < 300; t++) /* scales over many decades */
        for (int h = 0; h < c.hidden_size; h++)
            in.x[(size_t)t * c.hidden_size + h] =
                tu_bf16(tu_f32(in.x[(size_t)t * c.hidden_size + h]) * ldexpf(1.0f, t % 120 - 60));
    megamoe_group *gc, *gg;
    megamoe_layer *lc, *lg;
    make_layer(&m, MEGAMOE_BACKEND_CPU, 1, &gc, &lc);
    make_layer(&m, MEGAMOE_BACKEND_CUDA, 1, &gg, &lg);
    uint16_t *y = malloc((size_t)300 * c.hidden_size * 2);
    assert_int_equal(tu_forward(gc, lc, &in, y), MEGAMOE_OK);
    dev_inputs d;
    dev_upload(&d, &in);
    free(gpu_run(gg, lg, &in, &d));
    const mm_buffer_layout *L = &lg->buffer->layout;
    const uint8_t *cpu = lc->buffer->rank_base[0];
    const size_t bytes = L->x_scale + 300 * 4 - L->x;
    uint8_t *gpu = malloc(bytes + L->x - L->token_state);
    CK(cudaMemcpy(gpu, (const uint8_t *)lg->buffer->rank_base[0] + L->token_state,
                  bytes + L->x - L->token_state, cudaMemcpyDeviceToHost));
    int checked = 0;
    for (int t = 0; t < 300; t++) {
        const uint8_t st = cpu[L->token_state + t];
        assert_int_equal(gpu[t], st);
        if (st != MM_TOKEN_LIVE) continue;
        const uint8_t *g0 = gpu + (L->x - L->token_state);
        assert_memory_equal(g0 + (size_t)t * 512, cpu + L->x + (size_t)t * 512, 512);
        assert_memory_equal(g0 + (L->x_sf - L->x) + (size_t)t * 64, cpu + L->x_sf + (size_t)t * 64, 64);
        assert_memory_equal(g0 + (L->x_scale - L->x) + (size_t)t * 4, cpu + L->x_scale + (size_t)t * 4, 4);
        checked++;
    }
    printf("  quantized activations of %d tokens bit-identical to the CPU\n", checked);
    assert_true(checked > 290);
    free(gpu), free(y);
    dev_free(&d);
    megamoe_layer_destroy(lc), megamoe_group_destroy(gc);
    megamoe_layer_destroy(lg), megamoe_group_destroy(gg);
    tu_inputs_free(&in);
    tu_model_free(&m);
}

/* An f16 bit pattern's value (finite). */
static double f16_value(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return h >> 15 ? -v : v;
}

/* W4A16 (SPEC §3b): the gate/up operand the GPU stages is x itself -- x_f16 * x_scale * 2^14 == x
 * exactly for every element of every live token, with the token's largest |x_f16| in [2^15, 2^16)
 * -- on tokens whose scales span 2^-100 .. 2^99. */
static void test_w4a16_staging(void **state) {
    (void)state;
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "gpu.w4a16";
    c.num_experts = 8, c.top_k = 2, c.hidden_size = 1024, c.intermediate_size = 256, c.max_tokens = 300;
    c.activations = MEGAMOE_ACTIVATIONS_BF16;
    tu_model m;
    tu_model_random(&m, &c, 0, seed(7));
    tu_inputs in;
    tu_inputs_edge_cases(&in, 300, &c, seed(8));
    const int H = c.hidden_size;
    for (int t = 8; t < 300; t++)
        for (int h = 0; h < H; h++)
            in.x[(size_t)t * H + h] = tu_bf16(tu_f32(in.x[(size_t)t * H + h]) * ldexpf(1.0f, t % 200 - 100));
    megamoe_group *gg;
    megamoe_layer *lg;
    make_layer(&m, MEGAMOE_BACKEND_CUDA, 1, &gg, &lg);
    dev_inputs d;
    dev_upload(&d, &in);
    free(gpu_run(gg, lg, &in, &d));
    const mm_buffer_layout *L = &lg->buffer->layout;
    const uint8_t *b = lg->buffer->rank_base[0];
    uint8_t *state_t = malloc(300);
    uint16_t *x16 = malloc((size_t)300 * H * 2);
    float *xs = malloc(300 * sizeof *xs);
    CK(cudaMemcpy(state_t, b + L->token_state, 300, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(x16, b + L->x_f16, (size_t)300 * H * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(xs, b + L->x_scale, 300 * sizeof *xs, cudaMemcpyDeviceToHost));
    int checked = 0;
    for (int t = 0; t < 300; t++) {
        if (state_t[t] != MM_TOKEN_LIVE) continue;
        double amax = 0;
        for (int h = 0; h < H; h++) {
            const double v = f16_value(x16[(size_t)t * H + h]), want = tu_f32(in.x[(size_t)t * H + h]);
            if (v * (double)xs[t] * 16384.0 != want)
                fail_msg("token %d element %d: x_f16 %g * scale %g * 2^14 != x %g", t, h, v, (double)xs[t],
                         want);
            amax = fmax(amax, fabs(v));
        }
        if (amax != 0 && !(amax >= 32768.0 && amax < 65536.0)) fail_msg("token %d: max |x_f16| %g", t, amax);
        checked++;
    }
    printf("  W4A16 staged activations of %d tokens exact\n", checked);
    assert_true(checked > 290);
    free(state_t), free(x16), free(xs);
    dev_free(&d);
    megamoe_layer_destroy(lg), megamoe_group_destroy(gg);
    tu_inputs_free(&in);
    tu_model_free(&m);
}

static void graph_case(megamoe_activations act) {
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "gpu.graph";
    c.activations = act;
    printf("  NVFP4, %s activations:\n", act == MEGAMOE_ACTIVATIONS_BF16 ? "bf16" : "nvfp4");
    c.num_experts = 16, c.top_k = 4, c.hidden_size = 512, c.intermediate_size = 256, c.max_tokens = 64;
    tu_model m;
    tu_model_random(&m, &c, 1, seed(9));
    megamoe_group *gc, *gg;
    megamoe_layer *lc, *lg;
    make_layer(&m, MEGAMOE_BACKEND_CPU, 2, &gc, &lc);
    make_layer(&m, MEGAMOE_BACKEND_CUDA, 2, &gg, &lg);
    megamoe_memory_info mi;
    assert_int_equal(megamoe_layer_memory(lg, &mi), MEGAMOE_OK);
    const uint64_t packed = 16ull * (3ull * 512 * 256 / 2 + 3ull * 512 * 256 / 16 + 16);
    printf("  resident %llu bytes (packed %llu), finalize peak %llu, buffer %llu per rank\n",
           (unsigned long long)mi.weight_bytes, (unsigned long long)packed,
           (unsigned long long)mi.finalize_peak_bytes, (unsigned long long)mi.buffer_bytes);
    assert_true(mi.weight_bytes >= packed && mi.weight_bytes < packed + 4096 && mi.checkpoint_bytes == 0);
    tu_inputs in;
    tu_inputs_edge_cases(&in, 100, &c, seed(10));
    dev_inputs d;
    dev_upload(&d, &in);
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    assert_int_equal(gpu_forward(gg, lg, &in, &d, s), MEGAMOE_OK);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    uint16_t *y_cpu = malloc((size_t)100 * 512 * 2), *y_gpu = malloc((size_t)100 * 512 * 2);
    for (int rep = 0; rep < 3; rep++) {
        tu_inputs fresh;
        tu_inputs_edge_cases(&fresh, 100, &c, seed(100 + rep)); /* new data in the same device buffers */
        CK(cudaMemcpy(d.x, fresh.x, (size_t)100 * 512 * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d.ids, fresh.ids, (size_t)100 * 4 * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d.w, fresh.weights, (size_t)100 * 4 * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(d.y, 0xFF, (size_t)100 * 512 * 2));
        CK(cudaGraphLaunch(exec, s));
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(y_gpu, d.y, (size_t)100 * 512 * 2, cudaMemcpyDeviceToHost));
        assert_int_equal(tu_forward(gc, lc, &fresh, y_cpu), MEGAMOE_OK);
        char what[64];
        snprintf(what, sizeof what, "graph replay %d", rep);
        compare(&fresh, y_gpu, y_cpu, what, tu_device_tol(&c));
        tu_inputs_free(&fresh);
    }
    /* Bad ids: skipped, then reported by megamoe_layer_check. */
    in.ids[9 * 4 + 2] = 16;
    CK(cudaMemcpy(d.ids, in.ids, (size_t)100 * 4 * 4, cudaMemcpyHostToDevice));
    assert_int_equal(gpu_forward(gg, lg, &in, &d, s), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_check(lg), MEGAMOE_ERR_BAD_INPUT);
    const char *msg = megamoe_layer_last_error(lg);
    if (!strstr(msg, "token 9 slot 2") || !strstr(msg, "expert id 16")) fail_msg("message: %s", msg);
    assert_int_equal(megamoe_layer_check(lg), MEGAMOE_OK); /* reported once */
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(s));
    free(y_cpu), free(y_gpu);
    dev_free(&d);
    megamoe_layer_destroy(lc), megamoe_group_destroy(gc);
    megamoe_layer_destroy(lg), megamoe_group_destroy(gg);
    tu_inputs_free(&in);
    tu_model_free(&m);
}

static void test_graph_capture_and_errors(void **state) {
    (void)state;
    if (g_act_modes & 2) graph_case(MEGAMOE_ACTIVATIONS_NVFP4);
    if (g_act_modes & 1) graph_case(MEGAMOE_ACTIVATIONS_BF16);
}

/* Polls stream s every millisecond for up to ms milliseconds; its last status. */
static cudaError_t wait_stream(cudaStream_t s, int ms) {
    cudaError_t q = cudaErrorNotReady;
    for (int i = 0; i < ms && (q = cudaStreamQuery(s)) == cudaErrorNotReady; i++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return q;
}

/* Whether a forward of `slots` slots of layer c takes a warp-specialized kernel (gemm_rank 2 or 3) in
 * either phase, as the plan chooses it (gemm_plan.h plan_gemm_phase, the suite's forced kernel as the
 * override). */
static int takes_ws(const megamoe_layer_config *c, long slots, int nvfp4) {
    const gemm_rule rule = {g_gemm_kernel};
    for (int phase = PHASE_GATE_UP; phase <= PHASE_DOWN; phase++) {
        const gemm_phase_choice k =
            plan_gemm_phase(rule, slots, c->num_experts, c->hidden_size, c->intermediate_size, phase, nvfp4);
        if (gemm_rank(k.kernel) >= 2) return 1;
    }
    return 0;
}

/* A forward on one stream finishes, and is right, while a kernel on another stream holds part of
 * every SM until released (issue 3: no kernel may need all of its blocks resident at once; the
 * streaming kernel's persistent grid then has 3 of its 4 blocks per SM). Not under --quick:
 * compute-sanitizer runs the two streams' kernels one after the other. */
static void test_other_stream_holds_sms(void **state) {
    (void)state;
    /* NVFP4 with nvfp4, then bf16 activations (those enabled), then BF16 */
    for (int mode = 0; mode < 3; mode++) {
        if ((mode == 0 && !(g_act_modes & 2)) || (mode == 1 && !(g_act_modes & 1))) continue;
        const int f = mode == 2; /* the format: 0 NVFP4, 1 BF16 */
        megamoe_layer_config c;
        megamoe_layer_config_init(&c);
        c.name = "gpu.shared";
        c.format = (megamoe_weight_format)f;
        c.activations = mode == 0 ? MEGAMOE_ACTIVATIONS_NVFP4 : MEGAMOE_ACTIVATIONS_BF16;
        c.num_experts = 16, c.top_k = 4, c.hidden_size = 512, c.intermediate_size = 256, c.max_tokens = 256;
        tu_model m;
        tu_model_random(&m, &c, 1, seed(21 + f));
        megamoe_group *gc, *gg;
        megamoe_layer *lc, *lg;
        make_layer(&m, MEGAMOE_BACKEND_CPU, 1, &gc, &lc);
        make_layer(&m, MEGAMOE_BACKEND_CUDA, 1, &gg, &lg);
        const int tokens[] = {8, 256}; /* 2 and 64 tokens per expert: the decode and the prefill kernels */
        for (int i = 0; i < 2; i++) {
            const int T = tokens[i];
            tu_inputs in;
            tu_inputs_edge_cases(&in, T, &c, seed(30 + i));
            uint16_t *y_cpu = malloc((size_t)T * c.hidden_size * 2),
                     *y_gpu = malloc((size_t)T * c.hidden_size * 2);
            assert_int_equal(tu_forward(gc, lc, &in, y_cpu), MEGAMOE_OK);
            dev_inputs d;
            dev_upload(&d, &in);
            CK(cudaMemset(d.y, 0xFF, (size_t)T * c.hidden_size * 2));
            CK(cudaDeviceSynchronize()); /* the forward's stream does not wait for the legacy one */
            cudaStream_t s;
            CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            tu_occupier o;
            const int started = tu_occupier_start(&o);
            if (started != 0) fail_msg("occupier kernel did not start on every SM (%d)", started);
            /* A warp-specialized kernel's block takes 63K of an SM's 64K registers (3 warps of 168 on
             * each quarter of the register file), so it cannot share an SM with the occupier; it waits
             * for one. Its blocks never wait for each other (DECISIONS 38), so a forward taking it must
             * finish once the occupier has gone: held 0.2 s, then released, then up to 10 s to finish. */
            const int ws = takes_ws(&c, (long)T * c.top_k, f == 0);
            assert_int_equal(gpu_forward(gg, lg, &in, &d, s), MEGAMOE_OK);
            cudaError_t q = wait_stream(s, ws ? 200 : 10000);
            const int released = tu_occupier_release(&o);
            if (ws && q == cudaErrorNotReady) q = wait_stream(s, 10000);
            CK(cudaStreamSynchronize(s));
            if (q != cudaSuccess)
                fail_msg("%s T=%d: the forward %s", mode_name(&c), T,
                         q != cudaErrorNotReady ? cudaGetErrorString(q)
                         : ws                   ? "did not finish within 10 s of the occupier's release"
                              : "did not finish within 10 s while another stream held part of every SM");
            assert_int_equal(released, 0);
            assert_int_equal(megamoe_layer_check(lg), MEGAMOE_OK);
            CK(cudaMemcpy(y_gpu, d.y, (size_t)T * c.hidden_size * 2, cudaMemcpyDeviceToHost));
            char what[96];
            snprintf(what, sizeof what, "%s T=%d beside an occupying kernel", mode_name(&c), T);
            compare(&in, y_gpu, y_cpu, what, tu_device_tol(&c));
            CK(cudaStreamDestroy(s));
            free(y_cpu), free(y_gpu);
            dev_free(&d);
            tu_inputs_free(&in);
        }
        megamoe_layer_destroy(lc), megamoe_group_destroy(gc);
        megamoe_layer_destroy(lg), megamoe_group_destroy(gg);
        tu_model_free(&m);
    }
}

int main(int argc, char **argv) {
    if (!megamoe_backend_available(MEGAMOE_BACKEND_CUDA)) {
        printf("SKIPPED: no usable sm_90 GPU here, or this build has no CUDA backend\n");
        return 77;
    }
    const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0; /* for compute-sanitizer */
    const char *seed_env = getenv("MEGAMOE_TEST_SEED");
    g_seed_offset = seed_env ? strtoull(seed_env, NULL, 10) : 0;
    printf("data seeds: offset %llu (MEGAMOE_TEST_SEED)\n", (unsigned long long)g_seed_offset);
    const char *acts = getenv("MEGAMOE_TEST_ACTIVATIONS");
    g_act_modes = !acts ? 3 : strcmp(acts, "bf16") == 0 ? 1 : strcmp(acts, "nvfp4") == 0 ? 2 : 3;
    printf("NVFP4 activation modes: %s (MEGAMOE_TEST_ACTIVATIONS)\n", g_act_modes == 3
                                                                          ? "bf16 (W4A16) and nvfp4"
                                                                      : g_act_modes == 1 ? "bf16 (W4A16) only"
                                                                                         : "nvfp4 only");
    const char *gemm = getenv("MEGAMOE_GEMM");
    g_gemm_kernel = !gemm                         ? 0
                    : strcmp(gemm, "mma") == 0    ? 1
                    : strcmp(gemm, "wgmma") == 0  ? 2
                    : strcmp(gemm, "stream") == 0 ? 3
                    : strcmp(gemm, "ws") == 0     ? 4
                    : strcmp(gemm, "ws64") == 0   ? 5
                                                  : 0;
    printf("expert GEMM kernels: %s\n", g_gemm_kernel == 1   ? "mma.sync (forced)"
                                        : g_gemm_kernel == 2 ? "wgmma (forced)"
                                        : g_gemm_kernel == 3
                                            ? "streaming for NVFP4, mma.sync for BF16 (forced)"
                                        : g_gemm_kernel == 4 ? "warp-specialized (forced)"
                                        : g_gemm_kernel == 5 ? "warp-specialized, 64-token blocks (forced)"
                                                             : "chosen per forward");
#ifdef MEGAMOE_HAVE_NCCL
    ncclUniqueId id;
    g_have_comm = ncclGetUniqueId(&id) == ncclSuccess && ncclCommInitRank(&g_comm, 1, id, 0) == ncclSuccess;
    printf("NCCL backend: %s\n", g_have_comm ? "1-rank communicator, every grid case runs on it too"
                                             : "no communicator could be made: its cases are SKIPPED");
#endif
    const struct CMUnitTest all[] = {
        cmocka_unit_test(test_activation_bytes),
        cmocka_unit_test(test_graph_capture_and_errors),
        cmocka_unit_test(test_one_token),
        cmocka_unit_test(test_w4a16_staging),
        cmocka_unit_test(test_grid_small),
        cmocka_unit_test(test_grid_large),
        cmocka_unit_test(test_other_stream_holds_sms),
    };
    /* --quick (the sanitizers): the first four */
    const int n_all = (int)(sizeof all / sizeof all[0]);
    const int failed = _cmocka_run_group_tests("gpu", all, quick ? 4 : n_all, NULL, NULL);
#ifdef MEGAMOE_HAVE_NCCL
    if (g_have_comm) ncclCommDestroy(g_comm);
#endif
    return failed ? 1 : 0;
}
