/*
 * test_safetensors.c -- the reader and writer: round trips, shards, and every malformed file
 * giving an error that names the file and the tensor, never a crash.
 * (tests/py/test_checkpoints.py cross-checks against the Python safetensors package.) And weight-only
 * NVFP4 exports loaded from files the writer made.
 */
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

/* A file image: 8-byte length, the header text, then `data_len` bytes of data. */
static char *write_image(const char *dir, const char *name, const char *header, size_t data_len) {
    const size_t hl = strlen(header), n = 8 + hl + data_len;
    uint8_t *buf = calloc(1, n);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    for (size_t i = 0; i < data_len; i++)
        buf[8 + hl + i] = (uint8_t)i;
    char *path = tu_write_file(dir, name, buf, n);
    free(buf);
    return path;
}

/* Opens path, expects `want` and a message containing each of the given substrings. */
static void expect_open_error(const char *path, megamoe_status want, const char *s1, const char *s2) {
    megamoe_checkpoint *ck = NULL;
    megamoe_status st = megamoe_checkpoint_open(path, &ck);
    const char *msg = megamoe_checkpoint_last_error(ck);
    if (st != want || (s1 && !strstr(msg, s1)) || (s2 && !strstr(msg, s2)))
        fail_msg("open(%s): status %d (want %d), message '%s' (want '%s', '%s')", path, st, want, msg,
                 s1 ? s1 : "", s2 ? s2 : "");
    megamoe_checkpoint_close(ck);
}

static void test_round_trip(void **state) {
    (void)state;
    char *dir = tu_tmpdir();
    float f[6] = {1, 2, 3, 4, 5, 6}, s = 7.5f;
    uint16_t b[4] = {0x3F80, 0xBF80, 0x0001, 0x7FC0};
    uint8_t u[3] = {1, 2, 3};
    megamoe_named_tensor ts[] = {
        {"zeta.f32", {MEGAMOE_DTYPE_F32, 2, {2, 3}, f}}, {"alpha.bf16", {MEGAMOE_DTYPE_BF16, 1, {4}, b}},
        {"scalar", {MEGAMOE_DTYPE_F32, 0, {0}, &s}},     {"odd.u8", {MEGAMOE_DTYPE_U8, 1, {3}, u}},
        {"empty", {MEGAMOE_DTYPE_I32, 2, {0, 5}, NULL}},
    };
    char path[4096], err[256];
    snprintf(path, sizeof path, "%s/a.safetensors", dir);
    assert_int_equal(megamoe_safetensors_write(path, ts, 5, err, sizeof err), MEGAMOE_OK);
    megamoe_checkpoint *ck = NULL;
    assert_int_equal(megamoe_checkpoint_open(path, &ck), MEGAMOE_OK);
    assert_int_equal(megamoe_checkpoint_num_tensors(ck), 5);
    const char *name;
    megamoe_checkpoint_tensor(ck, 0, &name, NULL);
    assert_string_equal(name, "alpha.bf16"); /* sorted by name */
    for (int i = 0; i < 5; i++) {
        megamoe_tensor t;
        assert_int_equal(megamoe_checkpoint_find(ck, ts[i].name, &t), MEGAMOE_OK);
        assert_int_equal(t.dtype, ts[i].tensor.dtype);
        assert_int_equal(t.ndim, ts[i].tensor.ndim);
        for (int d = 0; d < t.ndim; d++)
            assert_int_equal(t.shape[d], ts[i].tensor.shape[d]);
        const size_t n = (size_t)megamoe_tensor_numel(&t) * megamoe_dtype_size(t.dtype);
        if (n) assert_memory_equal(t.data, ts[i].tensor.data, n);
    }
    assert_int_equal(megamoe_checkpoint_find(ck, "nope", NULL), MEGAMOE_ERR_BAD_WEIGHT);
    megamoe_checkpoint_close(ck);
    /* A folder holding one file opens that file. */
    assert_int_equal(megamoe_checkpoint_open(dir, &ck), MEGAMOE_OK);
    assert_int_equal(megamoe_checkpoint_num_tensors(ck), 5);
    megamoe_checkpoint_close(ck);
    free(dir);
}

static void test_malformed_files(void **state) {
    (void)state;
    char *dir = tu_tmpdir();
    char *p;
    p = tu_write_file(dir, "short.safetensors", "abc", 3);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "short.safetensors", "too short");
    free(p);
    uint8_t huge[16] = {0xFF, 0xFF, 0, 0, 0, 0, 0, 0, '{', '}'};
    p = tu_write_file(dir, "len.safetensors", huge, sizeof huge);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "len.safetensors", "runs past the end");
    free(p);
    p = write_image(dir, "json.safetensors", "{\"a\": {\"dtype\": ", 0);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "json.safetensors", "not valid JSON");
    free(p);
    p = write_image(dir, "array.safetensors", "[1, 2]", 0);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "array.safetensors", "not a JSON object");
    free(p);
    p = write_image(dir, "dtype.safetensors",
                    "{\"w\": {\"dtype\": \"Q7\", \"shape\": [2], \"data_offsets\": [0, 2]}}", 2);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "'w'", "unknown dtype");
    free(p);
    p = write_image(dir, "size.safetensors",
                    "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 8);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "'w'", "needs 8 bytes");
    free(p);
    p = write_image(dir, "range.safetensors",
                    "{\"w\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [4, 8]}}", 6);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "'w'", "run past the end");
    free(p);
    p = write_image(dir, "overlap.safetensors",
                    "{\"a\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [0, 4]},"
                    " \"b\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [2, 6]}}",
                    8);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "'a'", "overlap");
    free(p);
    p = write_image(dir, "dup.safetensors",
                    "{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]},"
                    " \"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}",
                    2);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "dup.safetensors", "duplicate");
    free(p);
    p = write_image(dir, "neg.safetensors",
                    "{\"w\": {\"dtype\": \"U8\", \"shape\": [-1], \"data_offsets\": [0, 1]}}", 1);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "'w'", "shape");
    free(p);
    p = write_image(dir, "order.safetensors",
                    "{\"w\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [3, 1]}}", 4);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "'w'", "begin <= end");
    free(p);
    p = write_image(dir, "meta.safetensors", "{\"__metadata__\": 5}", 0);
    expect_open_error(p, MEGAMOE_ERR_FORMAT, "meta.safetensors", "__metadata__");
    free(p);
    expect_open_error("/nonexistent/x.safetensors", MEGAMOE_ERR_IO, "/nonexistent/x.safetensors", NULL);
    free(dir);
}

static void test_sharded_index(void **state) {
    (void)state;
    char *dir = tu_tmpdir();
    float a[2] = {1, 2}, b[3] = {3, 4, 5};
    megamoe_named_tensor ta = {"layer.a", {MEGAMOE_DTYPE_F32, 1, {2}, a}};
    megamoe_named_tensor tb = {"layer.b", {MEGAMOE_DTYPE_F32, 1, {3}, b}};
    char path[4096];
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    assert_int_equal(megamoe_safetensors_write(path, &ta, 1, NULL, 0), MEGAMOE_OK);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    assert_int_equal(megamoe_safetensors_write(path, &tb, 1, NULL, 0), MEGAMOE_OK);
    const char *index =
        "{\"metadata\": {}, \"weight_map\": {\"layer.a\": \"model-00001-of-00002.safetensors\","
        " \"layer.b\": \"model-00002-of-00002.safetensors\"}}";
    free(tu_write_file(dir, "model.safetensors.index.json", index, strlen(index)));
    megamoe_checkpoint *ck = NULL;
    assert_int_equal(megamoe_checkpoint_open(dir, &ck), MEGAMOE_OK);
    assert_int_equal(megamoe_checkpoint_num_files(ck), 2);
    megamoe_tensor t;
    assert_int_equal(megamoe_checkpoint_find(ck, "layer.b", &t), MEGAMOE_OK);
    assert_memory_equal(t.data, b, sizeof b);
    megamoe_checkpoint_close(ck);

    /* The index names a tensor its shard does not hold. */
    const char *bad = "{\"weight_map\": {\"layer.a\": \"model-00002-of-00002.safetensors\"}}";
    free(tu_write_file(dir, "model.safetensors.index.json", bad, strlen(bad)));
    expect_open_error(dir, MEGAMOE_ERR_FORMAT, "'layer.a'", "does not hold");
    /* A shard that is missing. */
    const char *gone = "{\"weight_map\": {\"layer.c\": \"model-00003-of-00003.safetensors\"}}";
    free(tu_write_file(dir, "model.safetensors.index.json", gone, strlen(gone)));
    expect_open_error(dir, MEGAMOE_ERR_IO, "model-00003-of-00003.safetensors", "cannot open");
    /* A tensor in two shards. */
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    assert_int_equal(megamoe_safetensors_write(path, &ta, 1, NULL, 0), MEGAMOE_OK);
    const char *both = "{\"weight_map\": {\"layer.a\": \"model-00001-of-00002.safetensors\","
                       " \"x\": \"model-00002-of-00002.safetensors\"}}";
    free(tu_write_file(dir, "model.safetensors.index.json", both, strlen(both)));
    expect_open_error(dir, MEGAMOE_ERR_FORMAT, "'layer.a'", "appears in both");
    /* Not JSON, and a path outside the folder. */
    free(tu_write_file(dir, "model.safetensors.index.json", "{", 1));
    expect_open_error(dir, MEGAMOE_ERR_FORMAT, "index.json", "not valid JSON");
    const char *escape = "{\"weight_map\": {\"a\": \"../x.safetensors\"}}";
    free(tu_write_file(dir, "model.safetensors.index.json", escape, strlen(escape)));
    expect_open_error(dir, MEGAMOE_ERR_FORMAT, "index.json", "inside the folder");
    free(dir);
}

/* Every truncation of a valid file is rejected cleanly (and never read past its end: ASan). */
static void test_every_truncation(void **state) {
    (void)state;
    char *dir = tu_tmpdir();
    float f[4] = {1, 2, 3, 4};
    megamoe_named_tensor t = {"w", {MEGAMOE_DTYPE_F32, 1, {4}, f}};
    char path[4096];
    snprintf(path, sizeof path, "%s/full.safetensors", dir);
    assert_int_equal(megamoe_safetensors_write(path, &t, 1, NULL, 0), MEGAMOE_OK);
    FILE *fp = fopen(path, "rb");
    uint8_t buf[4096];
    const size_t n = fread(buf, 1, sizeof buf, fp);
    fclose(fp);
    for (size_t cut = 0; cut < n; cut++) {
        mm_st_entry *e = NULL;
        int ne = 0;
        uint64_t off;
        char err[MM_ERR_LEN];
        uint8_t *copy = malloc(cut ? cut : 1);
        memcpy(copy, buf, cut);
        megamoe_status st = mm_safetensors_parse(copy, cut, "cut", &e, &ne, &off, err);
        assert_int_equal(st, MEGAMOE_ERR_FORMAT);
        assert_non_null(strstr(err, "cut"));
        free(copy);
    }
    free(dir);
}

/* The tensors of NVFP4 model m (stacked layout) under the prefix "moe", in a naming of SPEC §6: 0
 * stacked, 1 per expert (ModelOpt), 2 per expert compressed-tensors (global scales stored as
 * reciprocals, in inv[]); the input scales only when with_inputs. Names go to names[][96]. Returns the
 * count. */
static int export_tensors(const tu_model *m, int naming, int with_inputs, megamoe_named_tensor *ts,
                          char (*names)[96], float *inv) {
    const int64_t E = m->cfg.num_experts, H = m->cfg.hidden_size, I = m->cfg.intermediate_size;
    int n = 0;
    if (naming == 0) {
        const megamoe_named_tensor all[8] = {
            {"moe.w13_weight", {MEGAMOE_DTYPE_U8, 3, {E, 2 * I, H / 2}, m->w13}},
            {"moe.w13_weight_scale", {MEGAMOE_DTYPE_F8_E4M3, 3, {E, 2 * I, H / 16}, m->w13_sf}},
            {"moe.w13_weight_scale_2", {MEGAMOE_DTYPE_F32, 2, {E, 2}, m->w13_s2}},
            {"moe.w2_weight", {MEGAMOE_DTYPE_U8, 3, {E, H, I / 2}, m->w2}},
            {"moe.w2_weight_scale", {MEGAMOE_DTYPE_F8_E4M3, 3, {E, H, I / 16}, m->w2_sf}},
            {"moe.w2_weight_scale_2", {MEGAMOE_DTYPE_F32, 1, {E}, m->w2_s2}},
            {"moe.w13_input_scale", {MEGAMOE_DTYPE_F32, 2, {E, 2}, m->w13_in}},
            {"moe.w2_input_scale", {MEGAMOE_DTYPE_F32, 1, {E}, m->w2_in}},
        };
        for (; n < (with_inputs ? 8 : 6); n++)
            ts[n] = all[n];
        return n;
    }
    static const char *const proj[3] = {"gate_proj", "up_proj", "down_proj"};
    const int ct = naming == 2;
    const char *const field[4] = {ct ? "weight_packed" : "weight", "weight_scale",
                                  ct ? "weight_global_scale" : "weight_scale_2",
                                  ct ? "input_global_scale" : "input_scale"};
    for (int e = 0; e < E; e++) {
        for (int p = 0; p < 3; p++) {
            const int down = p == 2;
            const int64_t rows = down ? H : I, cols = down ? I : H;
            const size_t first = down ? (size_t)(e * H) : (size_t)((2 * e + p) * I); /* first row */
            const float s2 = down ? m->w2_s2[e] : m->w13_s2[2 * e + p];
            const float in = down ? m->w2_in[e] : m->w13_in[2 * e + p];
            float *sc = inv + (size_t)(e * 3 + p) * 2;
            sc[0] = ct ? 1.0f / s2 : s2;
            sc[1] = ct ? 1.0f / in : in;
            const uint8_t *codes = (down ? m->w2 : m->w13) + first * (size_t)cols / 2;
            const uint8_t *sf = (down ? m->w2_sf : m->w13_sf) + first * (size_t)cols / 16;
            const megamoe_tensor t[4] = {{MEGAMOE_DTYPE_U8, 2, {rows, cols / 2}, codes},
                                         {MEGAMOE_DTYPE_F8_E4M3, 2, {rows, cols / 16}, sf},
                                         {MEGAMOE_DTYPE_F32, 0, {0}, &sc[0]},
                                         {MEGAMOE_DTYPE_F32, 1, {1}, &sc[1]}};
            for (int f = 0; f < (with_inputs ? 4 : 3); f++) {
                snprintf(names[n], 96, "moe.experts.%d.%s.%s", e, proj[p], field[f]);
                ts[n].name = names[n];
                ts[n].tensor = t[f];
                n++;
            }
        }
    }
    return n;
}

/* Loads the checkpoint at path into a new layer (2 CPU ranks) and runs it; returns the finalize status
 * (on success y holds the forward's output), with the layer's message in msg. */
static megamoe_status load_and_run(const char *path, megamoe_layer_config c, const tu_inputs *in, uint16_t *y,
                                   char *msg) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = 2;
    megamoe_group *g = NULL;
    megamoe_layer *l = NULL;
    megamoe_checkpoint *ck = NULL;
    assert_int_equal(megamoe_group_create(&gc, &g), MEGAMOE_OK);
    assert_int_equal(megamoe_layer_create(g, &c, &l), MEGAMOE_OK);
    assert_int_equal(megamoe_checkpoint_open(path, &ck), MEGAMOE_OK);
    megamoe_status st = megamoe_layer_load_checkpoint(l, ck, "moe", NULL, NULL);
    if (st == MEGAMOE_OK) st = megamoe_layer_finalize(l);
    if (st == MEGAMOE_OK) assert_int_equal(tu_forward(g, l, in, y), MEGAMOE_OK);
    snprintf(msg, MM_ERR_LEN, "%s", megamoe_layer_last_error(l));
    megamoe_checkpoint_close(ck);
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
    return st;
}

/* SPEC §6: weight-only NVFP4 exports (compressed-tensors NVFP4A16, ModelOpt W4A16) carry no input
 * scales. Written by the C writer in the stacked, per-expert and compressed-tensors per-expert
 * namings (I = 192, a multiple of 64 the kernels pad): a layer with activations=bf16 loads each and
 * its y is bitwise the y of the same export with input scales; a layer with activations=nvfp4 refuses
 * each, naming the missing input scale of the down projection and activations=bf16. */
static void test_weight_only_exports(void **state) {
    (void)state;
    char *dir = tu_tmpdir();
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "wo";
    c.num_experts = 4, c.top_k = 2, c.hidden_size = 256, c.intermediate_size = 192, c.max_tokens = 20;
    tu_model m;
    tu_model_random(&m, &c, 0, 91);
    tu_inputs in;
    tu_inputs_edge_cases(&in, 20, &c, 92);
    const size_t ybytes = (size_t)20 * 256 * 2;
    uint16_t *want = malloc(ybytes), *y = malloc(ybytes);
    megamoe_named_tensor *ts = calloc(64, sizeof *ts);
    char(*names)[96] = calloc(64, 96);
    float inv[4 * 3 * 2];
    char path[4096], err[256], msg[MM_ERR_LEN];
    static const char *const missing[3] = {"moe.w2_input_scale", "moe.experts.0.down_proj.input_scale",
                                           "moe.experts.0.down_proj.input_global_scale"};
    for (int naming = 0; naming < 3; naming++) {
        for (int with_inputs = 1; with_inputs >= 0; with_inputs--) {
            snprintf(path, sizeof path, "%s/n%d_i%d.safetensors", dir, naming, with_inputs);
            const int n = export_tensors(&m, naming, with_inputs, ts, names, inv);
            assert_int_equal(megamoe_safetensors_write(path, ts, n, err, sizeof err), MEGAMOE_OK);
            c.activations = MEGAMOE_ACTIVATIONS_BF16;
            megamoe_status st = load_and_run(path, c, &in, with_inputs ? want : y, msg);
            if (st) fail_msg("naming %d, input scales %d: %s", naming, with_inputs, msg);
            if (!with_inputs) assert_memory_equal(y, want, ybytes);
            c.activations = MEGAMOE_ACTIVATIONS_NVFP4;
            st = load_and_run(path, c, &in, y, msg);
            if (with_inputs) {
                if (st) fail_msg("naming %d: %s", naming, msg);
                continue;
            }
            assert_int_equal(st, MEGAMOE_ERR_BAD_WEIGHT);
            if (!strstr(msg, missing[naming]) || !strstr(msg, "activations=bf16") ||
                !strstr(msg, "weight-only"))
                fail_msg("naming %d: message '%s' lacks '%s' / activations=bf16 / weight-only", naming, msg,
                         missing[naming]);
        }
    }
    free(ts), free(names), free(want), free(y);
    tu_inputs_free(&in);
    tu_model_free(&m);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_sharded_index),
        cmocka_unit_test(test_every_truncation),
        cmocka_unit_test(test_weight_only_exports),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
