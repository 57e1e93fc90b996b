/*
 * test_safetensors.c -- the reader and writer: round trips, shards, and every malformed file
 * giving an error that names the file and the tensor, never a crash.
 * (tests/py/test_checkpoints.py cross-checks against the Python safetensors package.)
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_sharded_index),
        cmocka_unit_test(test_every_truncation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
