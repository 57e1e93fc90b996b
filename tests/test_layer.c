/*
 * test_layer.c -- the layer API on the CPU backend: SPEC §1 rules, loading and validation, finalize,
 * forward edge cases, and y bitwise independent of R. (The numbers themselves are checked against an
 * independent float64 reference in tests/py/test_layer_reference.py.)
 */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "test_util.h"
#include "weight_layout.h"

static megamoe_layer_config small_config(megamoe_weight_format f) {
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "test.mlp";
    c.num_experts = 8, c.top_k = 4, c.hidden_size = 256, c.intermediate_size = 256, c.max_tokens = 40;
    c.format = f;
    return c;
}

static void expect_create_error(int R, megamoe_layer_config c, const char *s1, const char *s2) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = R;
    megamoe_group *g = NULL;
    megamoe_layer *l = NULL;
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_create(g, &c, &l), MEGAMOE_ERR_INVALID_ARGUMENT);
    const char *msg = megamoe_layer_last_error(l);
    if (!strstr(msg, s1) || !strstr(msg, s2)) fail_msg("message '%s' lacks '%s' / '%s'", msg, s1, s2);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
}

static void test_size_rules(void **state) {
    (void)state;
    megamoe_layer_config c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.num_experts = 6;
    expect_create_error(4, c, "E=6", "R=4");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.hidden_size = 1000;
    expect_create_error(1, c, "H=1000", "multiple of 256");
    c = small_config(MEGAMOE_FORMAT_BF16);
    c.intermediate_size = 96;
    expect_create_error(1, c, "I=96", "multiple of 64");
    c.intermediate_size = 0;
    expect_create_error(1, c, "I=0", "multiple of 64");
    c.intermediate_size = (1 << 20) + 64;
    expect_create_error(1, c, "I=1048640", "at most 1048576");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.top_k = 33;
    expect_create_error(1, c, "K=33", "1..32");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.max_tokens = 0;
    expect_create_error(1, c, "T_max=0", ">= 1");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.norm_eps = 0.0f;
    expect_create_error(1, c, "norm_eps", "> 0");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.gemm_kernel = 6;
    expect_create_error(1, c, "gemm_kernel=6", "64-token");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.timeout_ms = 0;
    expect_create_error(1, c, "timeout_ms=0", ">= 1");
    /* SPEC §3b: a BF16-weight layer takes BF16 activations only; the setting has two values. */
    c = small_config(MEGAMOE_FORMAT_BF16);
    c.activations = MEGAMOE_ACTIVATIONS_NVFP4;
    expect_create_error(1, c, "activations=NVFP4", "BF16-weight layer accepts only BF16");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.activations = (megamoe_activations)2;
    expect_create_error(1, c, "activations 2", "BF16 (0) nor NVFP4 (1)");
    megamoe_layer_config d;
    megamoe_layer_config_init(&d);
    assert_int_equal(d.activations, MEGAMOE_ACTIVATIONS_BF16); /* the default */
    /* R outside 1..72 is refused by the group. */
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = 73;
    megamoe_group *g = NULL;
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(megamoe_group_last_error(g), "R=73"));
    megamoe_group_destroy(g);
    /* NCCL: one rank per process, and a communicator is needed (or the build has no NCCL backend). */
    gc.backend = MEGAMOE_BACKEND_NCCL;
    gc.num_ranks = 2;
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(megamoe_group_last_error(g), "num_ranks must be 1"));
    megamoe_group_destroy(g);
    gc.num_ranks = 1;
#ifdef MEGAMOE_HAVE_NCCL
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(megamoe_group_last_error(g), "nccl_comm"));
#else
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_ERR_UNSUPPORTED);
#endif
    megamoe_group_destroy(g);
    megamoe_group_destroy(NULL);
    megamoe_layer_destroy(NULL);
    megamoe_checkpoint_close(NULL);
}

/* Creates an unfinalized layer over R ranks. */
static void make_empty(const megamoe_layer_config *c, int R, megamoe_group **g, megamoe_layer **l) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = R;
    assert_int_equal(megamoe_group_create(&gc, g), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_create(*g, c, l), MEGAMOE_OK);
}

static void expect_msg(megamoe_layer *l, const char *s1, const char *s2) {
    const char *msg = megamoe_layer_last_error(l);
    if (!strstr(msg, s1) || (s2 && !strstr(msg, s2)))
        fail_msg("message '%s' lacks '%s' / '%s'", msg, s1, s2 ? s2 : "");
    assert_non_null(strstr(msg, "test.mlp")); /* every message names the layer */
}

static void test_weight_validation(void **state) {
    (void)state;
    megamoe_layer_config c = small_config(MEGAMOE_FORMAT_NVFP4);
    tu_model m;
    tu_model_random(&m, &c, 1, 11);
    megamoe_group *g;
    megamoe_layer *l;
    make_empty(&c, 2, &g, &l);
    const int64_t E = 8, H = 256, I = 256;
    megamoe_tensor t = {MEGAMOE_DTYPE_U8, 3, {E, 2 * I, H / 2}, m.w13};
    assert_int_equal(megamoe_layer_load_weight(l, "w13_bias", &t), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "unexpected expert weight", "w13_bias");
    t.shape[1] = I;
    assert_int_equal(megamoe_layer_load_weight(l, "w13_weight", &t), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "w13_weight", "expected [8, 512, 128]");
    t.shape[1] = 2 * I;
    t.dtype = MEGAMOE_DTYPE_I8;
    assert_int_equal(megamoe_layer_load_weight(l, "w13_weight", &t), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "dtype I8", "expected U8");
    /* A good load, then bad scales must leave it in place. */
    assert_int_equal(tu_model_load(&m, l), MEGAMOE_OK);
    uint8_t *sf = malloc((size_t)(E * H * I / 16));
    memcpy(sf, m.w2_sf, (size_t)(E * H * I / 16));
    sf[5 * H * I / 16 + 3] = 0x7F; /* NaN in expert 5 */
    megamoe_tensor ts = {MEGAMOE_DTYPE_F8_E4M3, 3, {E, H, I / 16}, sf};
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight_scale", &ts), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "w2_weight_scale of expert 5", "NaN");
    sf[5 * H * I / 16 + 3] = 0xB8; /* -1.0 */
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight_scale", &ts), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "expert 5", "negative");
    float s2[8];
    memcpy(s2, m.w2_s2, sizeof s2);
    const float bad_globals[3] = {0.0f, NAN, INFINITY};
    for (int i = 0; i < 3; i++) {
        s2[6] = bad_globals[i];
        megamoe_tensor tg = {MEGAMOE_DTYPE_F32, 1, {E}, s2};
        assert_int_equal(megamoe_layer_load_weight(l, "w2_weight_scale_2", &tg), MEGAMOE_ERR_BAD_WEIGHT);
        expect_msg(l, "w2_weight_scale_2 of expert 6", "finite and > 0");
        assert_int_equal(megamoe_layer_load_weight(l, "w2_input_scale", &tg), MEGAMOE_ERR_BAD_WEIGHT);
        expect_msg(l, "w2_input_scale of expert 6", "finite and > 0");
    }
    /* [E, 1] is accepted for per-expert scalars. */
    megamoe_tensor tg1 = {MEGAMOE_DTYPE_F32, 2, {E, 1}, m.w2_s2};
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight_scale_2", &tg1), MEGAMOE_OK);
    /* Per-expert loading: id out of range, wrong shape, bad scalar. */
    float bad = -1.0f;
    megamoe_tensor sc = {MEGAMOE_DTYPE_F32, 0, {0}, &bad};
    assert_int_equal(
        megamoe_layer_load_expert_weight(l, 8, MEGAMOE_PROJ_GATE, MEGAMOE_FIELD_WEIGHT_SCALE_2, &sc),
        MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "expert id 8", "[0, 8)");
    assert_int_equal(
        megamoe_layer_load_expert_weight(l, 3, MEGAMOE_PROJ_UP, MEGAMOE_FIELD_WEIGHT_SCALE_2, &sc),
        MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "experts.3.up_proj.weight_scale_2", "expert 3");
    megamoe_tensor gate = {MEGAMOE_DTYPE_U8, 2, {I, H}, m.w13};
    assert_int_equal(megamoe_layer_load_expert_weight(l, 3, MEGAMOE_PROJ_GATE, MEGAMOE_FIELD_WEIGHT, &gate),
                     MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "experts.3.gate_proj.weight", "expected [256, 128]");
    /* The earlier good state survived: finalize works and forward runs. */
    assert_int_equal(megamoe_layer_finalize(l), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_load_weight(l, "w13_weight", &t), MEGAMOE_ERR_INVALID_ARGUMENT);
    expect_msg(l, "finalized", NULL);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    free(sf);
    tu_model_free(&m);
}

static void test_bf16_rejects_nvfp4_names(void **state) {
    (void)state;
    megamoe_layer_config c = small_config(MEGAMOE_FORMAT_BF16);
    megamoe_group *g;
    megamoe_layer *l;
    make_empty(&c, 1, &g, &l);
    float s[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    megamoe_tensor t = {MEGAMOE_DTYPE_F32, 1, {8}, s};
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight_scale_2", &t), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "w2_weight_scale_2", "BF16");
    megamoe_tensor sc = {MEGAMOE_DTYPE_F32, 0, {0}, s};
    assert_int_equal(
        megamoe_layer_load_expert_weight(l, 0, MEGAMOE_PROJ_DOWN, MEGAMOE_FIELD_INPUT_SCALE, &sc),
        MEGAMOE_ERR_BAD_WEIGHT);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
}

static void test_finalize_and_forward_order(void **state) {
    (void)state;
    megamoe_layer_config c = small_config(MEGAMOE_FORMAT_NVFP4);
    tu_model m;
    tu_model_random(&m, &c, 0, 12);
    megamoe_group *g;
    megamoe_layer *l;
    make_empty(&c, 1, &g, &l);
    tu_inputs in;
    tu_inputs_random(&in, 4, c.top_k, c.hidden_size, c.num_experts, 3);
    uint16_t *y = malloc((size_t)4 * c.hidden_size * 2);
    assert_int_equal(tu_forward(g, l, &in, y), MEGAMOE_ERR_NOT_FINALIZED);
    expect_msg(l, "forward before", NULL);
    /* Everything but w2_input_scale: finalize names what is missing. */
    megamoe_tensor w2_in = {MEGAMOE_DTYPE_F32, 1, {8}, m.w2_in};
    m.w2_in = NULL;
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight",
                                               &(megamoe_tensor){MEGAMOE_DTYPE_U8, 3, {8, 256, 128}, m.w2}),
                     MEGAMOE_OK);
    assert_int_equal(megamoe_layer_finalize(l), MEGAMOE_ERR_NOT_FINALIZED);
    expect_msg(l, "expert 0", "gate_proj.weight");
    m.w2_in = (float *)w2_in.data;
    tu_model_load(&m, l);
    assert_int_equal(megamoe_layer_finalize(l), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_finalize(l), MEGAMOE_OK); /* idempotent */
    megamoe_memory_info mi;
    assert_int_equal(megamoe_layer_memory(l, &mi), MEGAMOE_OK);
    assert_true(mi.weight_bytes == 8ull * (3 * 256 * 256 / 2 + 3 * 256 * 256 / 16 + 24));
    assert_true(mi.checkpoint_bytes == 0 && mi.buffer_bytes > 0 && mi.finalize_peak_bytes >= mi.weight_bytes);
    assert_int_equal(tu_forward(g, l, &in, y), MEGAMOE_OK);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    tu_inputs_free(&in);
    free(y);
    tu_model_free(&m);
}

static void check_edge_rows(const tu_inputs *in, const uint16_t *y) {
    const int H = in->H;
    for (int t = 0; t < in->T; t++) {
        for (int h = 0; h < H; h++) {
            const uint16_t v = y[(size_t)t * H + h];
            const int is_nan = (v & 0x7FFF) > 0x7F80;
            if (t == 3 || t == 4 || t == 7)
                assert_int_equal(v & 0x7FFF, 0); /* zero rows */
            else if (t == 5 || t == 6)
                assert_true(is_nan);
            else if (is_nan || v == 0xFFFF)
                fail_msg("token %d element %d not written or NaN: 0x%04x", t, h, v);
        }
    }
    /* Token 7 is all zeros: every expert maps 0 to 0 (no bias), so its row is zero too. */
}

/* y bitwise equal for R = 1, 2, 4 at intermediate size I; returns y of R = 1 (the caller frees it). */
static uint16_t *run_r_invariance_shape(megamoe_weight_format f, megamoe_activations act, int with_norm,
                                        float clamp, int I) {
    megamoe_layer_config c = small_config(f);
    c.intermediate_size = I;
    c.activation_clamp = clamp;
    c.activations = act;
    tu_model m;
    tu_model_random(&m, &c, with_norm, 21 + f);
    const int T = 37; /* not a multiple of any R */
    tu_inputs in;
    tu_inputs_edge_cases(&in, T, &c, 99);
    uint16_t *y[3];
    const int Rs[3] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        megamoe_group *g;
        megamoe_layer *l;
        tu_layer_make(&m, Rs[i], &g, &l);
        y[i] = malloc((size_t)T * c.hidden_size * 2);
        megamoe_status st = tu_forward(g, l, &in, y[i]);
        if (st) fail_msg("%s", megamoe_layer_last_error(l));
        check_edge_rows(&in, y[i]);
        megamoe_layer_destroy(l);
        megamoe_group_destroy(g);
    }
    assert_memory_equal(y[0], y[1], (size_t)T * c.hidden_size * 2);
    assert_memory_equal(y[0], y[2], (size_t)T * c.hidden_size * 2);
    for (int i = 1; i < 3; i++)
        free(y[i]);
    tu_inputs_free(&in);
    tu_model_free(&m);
    return y[0];
}

static uint16_t *run_r_invariance_act(megamoe_weight_format f, megamoe_activations act, int with_norm,
                                      float clamp) {
    return run_r_invariance_shape(f, act, with_norm, clamp, 256);
}

static void run_r_invariance(megamoe_weight_format f, int with_norm, float clamp) {
    free(run_r_invariance_act(f, MEGAMOE_ACTIVATIONS_BF16, with_norm, clamp));
    if (f == MEGAMOE_FORMAT_NVFP4) free(run_r_invariance_act(f, MEGAMOE_ACTIVATIONS_NVFP4, with_norm, clamp));
}

static void test_r_invariance_nvfp4(void **state) {
    (void)state;
    run_r_invariance(MEGAMOE_FORMAT_NVFP4, 1, 0.0f);
}

/* The two activation modes of an NVFP4 layer compute different things (SPEC §3 vs §3b): y differs
 * in most live elements, and each mode is R-invariant on its own (above). */
static void test_activation_modes_differ(void **state) {
    (void)state;
    uint16_t *yb = run_r_invariance_act(MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_BF16, 1, 0.0f);
    uint16_t *yn = run_r_invariance_act(MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_NVFP4, 1, 0.0f);
    const size_t n = (size_t)37 * 256;
    size_t differ = 0, live = 0;
    for (size_t i = 0; i < n; i++) {
        if (yb[i] == 0 || (yb[i] & 0x7FFF) > 0x7F80) continue; /* zero and NaN edge-case rows */
        live++;
        differ += yb[i] != yn[i];
    }
    if (!(live > n / 2 && differ > live / 2)) fail_msg("%zu of %zu live elements differ", differ, live);
    free(yb), free(yn);
}
static void test_r_invariance_bf16(void **state) {
    (void)state;
    run_r_invariance(MEGAMOE_FORMAT_BF16, 1, 0.0f);
}
static void test_r_invariance_clamp_no_norm(void **state) {
    (void)state;
    run_r_invariance(MEGAMOE_FORMAT_NVFP4, 0, 0.5f);
    run_r_invariance(MEGAMOE_FORMAT_BF16, 0, 0.5f);
}

static void test_token_counts_and_bad_ids(void **state) {
    (void)state;
    megamoe_layer_config c = small_config(MEGAMOE_FORMAT_NVFP4);
    tu_model m;
    tu_model_random(&m, &c, 1, 31);
    megamoe_group *g;
    megamoe_layer *l;
    tu_layer_make(&m, 2, &g, &l);
    const int H = c.hidden_size, K = c.top_k;
    /* T = 0 on every rank. */
    tu_inputs in;
    tu_inputs_random(&in, 0, K, H, c.num_experts, 1);
    uint16_t dummy;
    assert_int_equal(tu_forward(g, l, &in, &dummy), MEGAMOE_OK);
    tu_inputs_free(&in);
    /* T = T_max on both ranks, then T_max + 1 on one: refused, y untouched. */
    tu_inputs_random(&in, 2 * c.max_tokens, K, H, c.num_experts, 2);
    uint16_t *y = malloc((size_t)(2 * c.max_tokens + 2) * H * 2);
    assert_int_equal(tu_forward(g, l, &in, y), MEGAMOE_OK);
    tu_inputs_free(&in);
    tu_inputs_random(&in, 2 * c.max_tokens + 1, K, H, c.num_experts, 2);
    memset(y, 0x5A, (size_t)(2 * c.max_tokens + 1) * H * 2);
    megamoe_forward_args args[2] = {{c.max_tokens + 1, in.x, in.ids, in.weights, NULL, y},
                                    {c.max_tokens, in.x, in.ids, in.weights, NULL, y}};
    assert_int_equal(megamoe_layer_forward(l, args, NULL), MEGAMOE_ERR_BAD_INPUT);
    expect_msg(l, "41 tokens", "max_tokens=40");
    for (size_t i = 0; i < (size_t)(c.max_tokens + 1) * H * 2; i++)
        assert_int_equal(((uint8_t *)y)[i], 0x5A);
    tu_inputs_free(&in);
    /* Bad ids: skipped, reported, and y equals the run with those slots set to -1. */
    tu_inputs_random(&in, 9, K, H, c.num_experts, 5);
    in.ids[2 * K + 1] = 8; /* == E */
    in.ids[6 * K + 3] = -7;
    uint16_t *y_bad = malloc((size_t)9 * H * 2), *y_ref = malloc((size_t)9 * H * 2);
    assert_int_equal(tu_forward(g, l, &in, y_bad), MEGAMOE_ERR_BAD_INPUT);
    expect_msg(l, "token 2 slot 1", "expert id 8 is outside [-1, 8)");
    assert_non_null(strstr(megamoe_layer_last_error(l), "2 bad slots"));
    in.ids[2 * K + 1] = -1;
    in.ids[6 * K + 3] = -1;
    assert_int_equal(tu_forward(g, l, &in, y_ref), MEGAMOE_OK);
    assert_memory_equal(y_bad, y_ref, (size_t)9 * H * 2);
    free(y_bad), free(y_ref), free(y);
    tu_inputs_free(&in);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    tu_model_free(&m);
}

/* Issue 25's library rules: bounded threads and sizes, a global scale whose 6 x 448 multiple overflows,
 * non-finite BF16 weights, non-finite routing weights on the CPU backend. Each is refused with a message
 * naming the value. */
static void test_hostile_values(void **state) {
    (void)state;
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    megamoe_group *g = NULL;
    gc.num_threads = MEGAMOE_MAX_THREADS + 1;
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(megamoe_group_last_error(g), "num_threads=1025"));
    megamoe_group_destroy(g);
    megamoe_layer_config c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.num_experts = 65536 * 2;
    expect_create_error(1, c, "E=131072", "1..65536");
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.hidden_size = 1 << 21;
    expect_create_error(1, c, "H=2097152", "multiple of 256");

    /* NVFP4: weight_scale_2 and w2_input_scale up to FLT_MAX / 2688. */
    c = small_config(MEGAMOE_FORMAT_NVFP4);
    tu_model m;
    tu_model_random(&m, &c, 1, 12);
    megamoe_layer *l;
    make_empty(&c, 1, &g, &l);
    float s2[8];
    memcpy(s2, m.w2_s2, sizeof s2);
    megamoe_tensor tg = {MEGAMOE_DTYPE_F32, 1, {8}, s2};
    s2[2] = 3e38f;
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight_scale_2", &tg), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "w2_weight_scale_2 of expert 2", "6 x 448");
    assert_int_equal(megamoe_layer_load_weight(l, "w2_input_scale", &tg), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "w2_input_scale of expert 2", "6 x 448");
    s2[2] = FLT_MAX / 2688.0f; /* the largest accepted */
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight_scale_2", &tg), MEGAMOE_OK);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    tu_model_free(&m);

    /* BF16: a NaN or infinity anywhere in the weights, stacked or per expert. */
    c = small_config(MEGAMOE_FORMAT_BF16);
    tu_model_random(&m, &c, 1, 13);
    make_empty(&c, 2, &g, &l);
    const size_t w2n = (size_t)8 * 256 * 256;
    uint16_t *w2 = malloc(w2n * 2);
    memcpy(w2, m.w2_bf16, w2n * 2);
    w2[6 * 256 * 256 + 77] = 0x7FC0; /* NaN in expert 6 (rank 1's) */
    megamoe_tensor tw = {MEGAMOE_DTYPE_BF16, 3, {8, 256, 256}, w2};
    assert_int_equal(megamoe_layer_load_weight(l, "w2_weight", &tw), MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "w2_weight of expert 6", "NaN");
    megamoe_tensor te = {MEGAMOE_DTYPE_BF16, 2, {256, 256}, w2 + 6 * 256 * 256};
    w2[6 * 256 * 256 + 77] = 0xFF80; /* -inf */
    assert_int_equal(megamoe_layer_load_expert_weight(l, 6, MEGAMOE_PROJ_DOWN, MEGAMOE_FIELD_WEIGHT, &te),
                     MEGAMOE_ERR_BAD_WEIGHT);
    expect_msg(l, "experts.6.down_proj.weight", "an infinity");
    free(w2);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);

    /* Routing weights: a non-finite one in a slot that counts is bad input; in a -1 slot or on a padding
     * token it is ignored. */
    tu_layer_make(&m, 2, &g, &l);
    tu_inputs in;
    tu_inputs_random(&in, 10, c.top_k, c.hidden_size, c.num_experts, 7);
    uint16_t *y = malloc((size_t)10 * 256 * 2);
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3; i++) {
        in.weights[7 * c.top_k + 2] = bad[i]; /* token 7: rank 1's token 2 (chunks of 5) */
        assert_int_equal(tu_forward(g, l, &in, y), MEGAMOE_ERR_BAD_INPUT);
        expect_msg(l, "rank 1 token 2 slot 2", "topk_weights");
    }
    in.ids[7 * c.top_k + 2] = -1;
    assert_int_equal(tu_forward(g, l, &in, y), MEGAMOE_OK);
    free(y);
    tu_inputs_free(&in);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    tu_model_free(&m);
}

/* SPEC §1: I is any multiple of 64 (real models use 1408). Layers of I = 64, 192 and 320 create, load,
 * finalize and run in both formats and both activation modes, y bitwise the same for R = 1, 2, 4 with
 * the edge-case rows of SPEC §5. (Their numbers against the float64 reference:
 * tests/py/test_layer_reference.py.) */
static void test_intermediate_multiple_of_64(void **state) {
    (void)state;
    const int sizes[3] = {64, 192, 320};
    for (int i = 0; i < 3; i++) {
        free(run_r_invariance_shape(MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_BF16, 1, 0.0f, sizes[i]));
        free(run_r_invariance_shape(MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_NVFP4, 1, 0.0f, sizes[i]));
        free(run_r_invariance_shape(MEGAMOE_FORMAT_BF16, MEGAMOE_ACTIVATIONS_BF16, 0, 0.0f, sizes[i]));
    }
}

/* Runs model m on a 2-rank CPU group; returns y (the caller frees it). */
static uint16_t *forward_of(const tu_model *m, const tu_inputs *in) {
    megamoe_group *g;
    megamoe_layer *l;
    tu_layer_make(m, 2, &g, &l);
    uint16_t *y = malloc((size_t)in->T * in->H * 2);
    assert_non_null(y);
    if (tu_forward(g, l, in, y) != MEGAMOE_OK) fail_msg("%s", megamoe_layer_last_error(l));
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    return y;
}

/* The device backends compute at I padded to MM_LAYOUT_I_TILE (weight_layout.h). Here on the CPU: the
 * experts of an I = 192 layer, packed as finalize packs them and unpacked at the padded I = 256, make
 * an I = 256 layer whose y is bitwise the I = 192 layer's, in both formats and both activation modes
 * (with a clamp): the zero gate/up rows give a = silu(0) * 0 = 0, which the down projection's input
 * quantization (SPEC §3) turns into block scale 0 and codes 0, against zero columns of block scale 0. */
static void padded_layer_same_y(megamoe_weight_format f, megamoe_activations act, float clamp,
                                uint64_t seed) {
    enum { E = 8, H = 256, I = 192 };
    const int64_t IP = mm_layout_intermediate_padded(I);
    assert_int_equal(IP, 256);
    megamoe_layer_config c = small_config(f), cp;
    c.intermediate_size = I;
    c.activations = act;
    c.activation_clamp = clamp;
    cp = c;
    cp.intermediate_size = (int)IP;
    tu_model m, mp;
    tu_model_random(&m, &c, 1, seed);
    tu_model_random(&mp, &cp, 1, seed); /* its weights are replaced below, its scales and norm copied */
    const int nvfp4 = f == MEGAMOE_FORMAT_NVFP4;
    const size_t n13 = 2 * I * H, n2 = (size_t)H * I, p13 = (size_t)(2 * IP * H), p2 = (size_t)(H * IP);
    if (nvfp4) {
        uint8_t *k13 = malloc(E * n13 / 2), *ks13 = malloc(E * n13 / 16), *k2 = malloc(E * n2 / 2),
                *ks2 = malloc(E * n2 / 16);
        uint16_t *none = NULL;
        assert_non_null(k13 && ks13 && k2 && ks2);
        memcpy(k13, m.w13, E * n13 / 2), memcpy(ks13, m.w13_sf, E * n13 / 16);
        memcpy(k2, m.w2, E * n2 / 2), memcpy(ks2, m.w2_sf, E * n2 / 16);
        assert_int_equal(mm_layout_pack_experts(&k13, &ks13, &k2, &ks2, &none, &none, E, H, I, 2), 1);
        for (int e = 0; e < E; e++) {
            mm_layout_unpack_nvfp4(k13 + e * p13 / 2, ks13 + e * p13 / 16, 2 * IP, H, 1, mp.w13 + e * p13 / 2,
                                   mp.w13_sf + e * p13 / 16);
            mm_layout_unpack_nvfp4(k2 + e * p2 / 2, ks2 + e * p2 / 16, H, IP, 0, mp.w2 + e * p2 / 2,
                                   mp.w2_sf + e * p2 / 16);
        }
        free(k13), free(ks13), free(k2), free(ks2);
        memcpy(mp.w13_s2, m.w13_s2, E * 2 * 4), memcpy(mp.w13_in, m.w13_in, E * 2 * 4);
        memcpy(mp.w2_s2, m.w2_s2, E * 4), memcpy(mp.w2_in, m.w2_in, E * 4);
    } else {
        uint16_t *k13 = malloc(E * n13 * 2), *k2 = malloc(E * n2 * 2);
        uint8_t *none = NULL;
        assert_non_null(k13 && k2);
        memcpy(k13, m.w13_bf16, E * n13 * 2), memcpy(k2, m.w2_bf16, E * n2 * 2);
        assert_int_equal(mm_layout_pack_experts(&none, &none, &none, &none, &k13, &k2, E, H, I, 2), 1);
        for (int e = 0; e < E; e++) {
            mm_layout_unpack_bf16(k13 + e * p13, 2 * IP, H, 1, mp.w13_bf16 + e * p13);
            mm_layout_unpack_bf16(k2 + e * p2, H, IP, 0, mp.w2_bf16 + e * p2);
        }
        free(k13), free(k2);
    }
    memcpy(mp.norm, m.norm, H * 4);
    tu_inputs in;
    tu_inputs_edge_cases(&in, 37, &c, seed + 1);
    uint16_t *y = forward_of(&m, &in), *yp = forward_of(&mp, &in);
    check_edge_rows(&in, y);
    assert_memory_equal(y, yp, (size_t)in.T * H * 2);
    free(y), free(yp);
    tu_inputs_free(&in);
    tu_model_free(&m);
    tu_model_free(&mp);
}

static void test_padded_layout_computes_the_same(void **state) {
    (void)state;
    padded_layer_same_y(MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_BF16, 0.0f, 71);
    padded_layer_same_y(MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_NVFP4, 0.0f, 72);
    padded_layer_same_y(MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_NVFP4, 0.5f, 73);
    padded_layer_same_y(MEGAMOE_FORMAT_BF16, MEGAMOE_ACTIVATIONS_BF16, 0.0f, 74);
}

/* Loads every weight of m but the input scales, per expert (the naming of a weight-only export). */
static megamoe_status load_weight_only(const tu_model *m, megamoe_layer *l) {
    const int64_t E = m->cfg.num_experts, H = m->cfg.hidden_size, I = m->cfg.intermediate_size;
    for (int e = 0; e < E; e++) {
        for (int proj = 0; proj < 3; proj++) {
            const int down = proj == MEGAMOE_PROJ_DOWN;
            const size_t rows = (size_t)(down ? H : I), cols = (size_t)(down ? I : H);
            const size_t first = down ? (size_t)e * rows : ((size_t)e * 2 + (size_t)proj) * rows; /* row */
            const uint8_t *codes = (down ? m->w2 : m->w13) + first * cols / 2;
            const uint8_t *sf = (down ? m->w2_sf : m->w13_sf) + first * cols / 16;
            const int64_t r = (int64_t)rows, k = (int64_t)cols;
            const megamoe_tensor t[3] = {
                {MEGAMOE_DTYPE_U8, 2, {r, k / 2}, codes},
                {MEGAMOE_DTYPE_F8_E4M3, 2, {r, k / 16}, sf},
                {MEGAMOE_DTYPE_F32, 0, {0}, down ? &m->w2_s2[e] : &m->w13_s2[2 * e + proj]}};
            for (int field = 0; field < 3; field++) {
                megamoe_status st = megamoe_layer_load_expert_weight(l, e, (megamoe_proj)proj,
                                                                     (megamoe_field)field, &t[field]);
                if (st) return st;
            }
        }
    }
    megamoe_tensor n = {MEGAMOE_DTYPE_F32, 1, {H}, m->norm};
    return megamoe_layer_load_norm_weight(l, &n);
}

/* SPEC §6: a weight-only NVFP4 export (compressed-tensors NVFP4A16, ModelOpt W4A16) has no input
 * scales. A layer with activations=bf16, where they are unused (§3b), finalizes without them and its
 * y is bitwise the y of the same weights loaded with them; a layer with activations=nvfp4 refuses to
 * finalize, naming the missing input scale and the mode that would take the export. */
static void test_weight_only_nvfp4(void **state) {
    (void)state;
    megamoe_layer_config c = small_config(MEGAMOE_FORMAT_NVFP4);
    c.intermediate_size = 192;
    tu_model m;
    tu_model_random(&m, &c, 1, 81);
    tu_inputs in;
    tu_inputs_edge_cases(&in, 37, &c, 82);
    uint16_t *want = forward_of(&m, &in), *y = malloc((size_t)37 * 256 * 2);
    megamoe_group *g;
    megamoe_layer *l;
    make_empty(&c, 2, &g, &l);
    assert_int_equal(load_weight_only(&m, l), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_finalize(l), MEGAMOE_OK);
    assert_int_equal(tu_forward(g, l, &in, y), MEGAMOE_OK);
    assert_memory_equal(y, want, (size_t)37 * 256 * 2);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);

    c.activations = MEGAMOE_ACTIVATIONS_NVFP4;
    make_empty(&c, 2, &g, &l);
    assert_int_equal(load_weight_only(&m, l), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_finalize(l), MEGAMOE_ERR_NOT_FINALIZED);
    expect_msg(l, "expert 0 has no down_proj.input_scale", "activations=bf16");
    expect_msg(l, "activations=nvfp4", "weight-only");
    /* Loading the input scales then completes it (the weights loaded before are kept). */
    megamoe_tensor w2_in = {MEGAMOE_DTYPE_F32, 1, {8}, m.w2_in};
    assert_int_equal(megamoe_layer_load_weight(l, "w2_input_scale", &w2_in), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_finalize(l), MEGAMOE_OK);
    assert_int_equal(tu_forward(g, l, &in, y), MEGAMOE_OK);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    free(want), free(y);
    tu_inputs_free(&in);
    tu_model_free(&m);
}

/* Layers of one shape share one buffer (both formats); interleaved forwards stay correct. */
static void test_buffer_sharing(void **state) {
    (void)state;
    megamoe_layer_config cn = small_config(MEGAMOE_FORMAT_NVFP4), cb = small_config(MEGAMOE_FORMAT_BF16);
    tu_model mn, mb;
    tu_model_random(&mn, &cn, 1, 41);
    tu_model_random(&mb, &cb, 0, 42);
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = 2;
    megamoe_group *g;
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_OK);
    megamoe_layer *ln, *lb;
    assert_int_equal(megamoe_layer_create(g, &cn, &ln), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_create(g, &cb, &lb), MEGAMOE_OK);
    assert_ptr_equal(ln->buffer, lb->buffer);
    uint64_t bytes;
    assert_int_equal(megamoe_group_buffer_bytes(g, 8, 40, 4, 256, 256, &bytes), MEGAMOE_OK);
    assert_true(bytes == ln->buffer->layout.total);
    assert_int_equal(tu_model_load(&mn, ln), MEGAMOE_OK);
    assert_int_equal(tu_model_load(&mb, lb), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_finalize(ln), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_finalize(lb), MEGAMOE_OK);
    tu_inputs in;
    tu_inputs_random(&in, 30, 4, 256, 8, 7);
    const size_t n = (size_t)30 * 256 * 2;
    uint16_t *a1 = malloc(n), *b1 = malloc(n), *a2 = malloc(n);
    assert_int_equal(tu_forward(g, ln, &in, a1), MEGAMOE_OK);
    assert_int_equal(tu_forward(g, lb, &in, b1), MEGAMOE_OK);
    assert_int_equal(tu_forward(g, ln, &in, a2), MEGAMOE_OK);
    assert_memory_equal(a1, a2, n);
    assert_memory_not_equal(a1, b1, n);
    megamoe_layer_destroy(ln);
    megamoe_layer_destroy(lb);
    assert_null(g->buffers); /* released with the last layer */
    megamoe_group_destroy(g);
    free(a1), free(b1), free(a2);
    tu_inputs_free(&in);
    tu_model_free(&mn);
    tu_model_free(&mb);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_size_rules),
        cmocka_unit_test(test_weight_validation),
        cmocka_unit_test(test_bf16_rejects_nvfp4_names),
        cmocka_unit_test(test_finalize_and_forward_order),
        cmocka_unit_test(test_r_invariance_nvfp4),
        cmocka_unit_test(test_activation_modes_differ),
        cmocka_unit_test(test_r_invariance_bf16),
        cmocka_unit_test(test_r_invariance_clamp_no_norm),
        cmocka_unit_test(test_token_counts_and_bad_ids),
        cmocka_unit_test(test_buffer_sharing),
        cmocka_unit_test(test_hostile_values),
        cmocka_unit_test(test_intermediate_multiple_of_64),
        cmocka_unit_test(test_padded_layout_computes_the_same),
        cmocka_unit_test(test_weight_only_nvfp4),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
