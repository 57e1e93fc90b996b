/*
 * test_formats.c -- the codecs and the block quantizer of src/formats.h against SPEC §2-3.
 * (tests/py/test_formats.py checks the same functions against ml_dtypes on millions of values.)
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "formats.h"
#include "internal.h"
#include "weight_layout.h"

static const float k_e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static void test_e2m1_decode_all_codes(void **state) {
    (void)state;
    for (int c = 0; c < 16; c++) {
        const float v = mm_e2m1_to_f32((uint8_t)c);
        assert_true(v == (c & 8 ? -k_e2m1[c & 7] : k_e2m1[c & 7]));
        assert_int_equal(signbit(v) != 0, (c & 8) != 0);
        assert_int_equal(mm_e2m1_rn(v), c); /* every code round-trips, -0 included */
    }
}

static void test_e2m1_spec_ties_and_saturation(void **state) {
    (void)state;
    const struct {
        float v;
        uint8_t code;
    } cases[] = {{0.25f, 0}, {0.75f, 2},  {1.25f, 2},      {1.75f, 4},    {2.5f, 4},
                 {3.5f, 6},  {5.0f, 6},   {0.2499f, 0},    {0.2501f, 1},  {5.001f, 7},
                 {6.0f, 7},  {7.0f, 7},   {1e30f, 7},      {INFINITY, 7}, {-0.1f, 8},
                 {-0.0f, 8}, {-5.0f, 14}, {-INFINITY, 15}, {1e-40f, 0},   {-2.75f, 13}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (mm_e2m1_rn(cases[i].v) != cases[i].code)
            fail_msg("e2m1_rn(%g) = %d, expected %d", (double)cases[i].v, mm_e2m1_rn(cases[i].v),
                     cases[i].code);
    }
}

static void test_e4m3_all_codes_round_trip(void **state) {
    (void)state;
    for (int b = 0; b < 256; b++) {
        const float v = mm_e4m3_to_f32((uint8_t)b);
        if ((b & 0x7F) == 0x7F) {
            assert_true(isnan(v));
            continue;
        }
        assert_int_equal(mm_e4m3_rn(v), b);
    }
    /* Every code's f32 bits against the definition: (-1)^s 2^(e-7) (1 + m/8), subnormal m 2^-9, NaN
     * the quiet NaN of the code's sign. */
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float want = e == 15 && m == 7 ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        uint32_t got, ref;
        if (b & 0x80) want = -want;
        const float v = mm_e4m3_to_f32((uint8_t)b);
        memcpy(&got, &v, 4);
        memcpy(&ref, &want, 4);
        if (got != ref) fail_msg("e4m3 0x%02x: bits 0x%08x, expected 0x%08x", b, got, ref);
    }
    assert_true(mm_e4m3_to_f32(0x7E) == 448.0f);
    assert_true(mm_e4m3_to_f32(0x01) == ldexpf(1.0f, -9));
    assert_true(mm_e4m3_to_f32(0x08) == ldexpf(1.0f, -6));
}

static void test_e4m3_ties_subnormals_saturation(void **state) {
    (void)state;
    assert_int_equal(mm_e4m3_rn(ldexpf(1.0f, -10)), 0x00);  /* tie 0 | 2^-9 -> even 0 */
    assert_int_equal(mm_e4m3_rn(ldexpf(3.0f, -10)), 0x02);  /* tie 1 | 2 -> even 2 */
    assert_int_equal(mm_e4m3_rn(ldexpf(5.0f, -10)), 0x02);  /* tie 2 | 3 -> 2 */
    assert_int_equal(mm_e4m3_rn(ldexpf(15.0f, -10)), 0x08); /* tie 7 | 8 -> 8 = 2^-6 */
    assert_int_equal(mm_e4m3_rn(1.0625f), 0x38);            /* tie 1 | 1.125 -> 1 */
    assert_int_equal(mm_e4m3_rn(1.1875f), 0x3A);            /* tie 1.125 | 1.25 -> 1.25 */
    assert_int_equal(mm_e4m3_rn(449.0f), 0x7E);
    assert_int_equal(mm_e4m3_rn(480.0f), 0x7E);
    assert_int_equal(mm_e4m3_rn(-1e20f), 0xFE);
    assert_int_equal(mm_e4m3_rn(INFINITY), 0x7E);
    assert_int_equal(mm_e4m3_rn(NAN) & 0x7F, 0x7F);
    assert_int_equal(mm_e4m3_rn(-0.0f), 0x80);
    assert_int_equal(mm_e4m3_rn(1e-30f), 0x00);
    assert_true(mm_e4m3_scale_valid(0x00) && mm_e4m3_scale_valid(0x7E));
    assert_false(mm_e4m3_scale_valid(0x7F) || mm_e4m3_scale_valid(0xFF) || mm_e4m3_scale_valid(0x80) ||
                 mm_e4m3_scale_valid(0xB8));
}

static void test_bf16_rounding(void **state) {
    (void)state;
    assert_int_equal(mm_f32_to_bf16(1.0f), 0x3F80);
    assert_int_equal(mm_f32_to_bf16(mm_f32_from_bits(0x3F808000u)), 0x3F80); /* tie -> even */
    assert_int_equal(mm_f32_to_bf16(mm_f32_from_bits(0x3F818000u)), 0x3F82); /* tie -> even */
    assert_int_equal(mm_f32_to_bf16(mm_f32_from_bits(0x3F808001u)), 0x3F81);
    assert_int_equal(mm_f32_to_bf16(INFINITY), 0x7F80);
    assert_int_equal(mm_f32_to_bf16(mm_f32_from_bits(0x7F7FFFFFu)), 0x7F80); /* overflows to inf */
    assert_true(isnan(mm_bf16_to_f32(mm_f32_to_bf16(NAN))));
}

static void test_block_quantizer(void **state) {
    (void)state;
    float v[16];
    uint8_t codes[8];
    /* All-zero block: scale byte 0 and all codes 0. */
    memset(v, 0, sizeof v);
    assert_int_equal(mm_quantize_block16(v, 1.0f, codes), 0);
    for (int j = 0; j < 8; j++)
        assert_int_equal(codes[j], 0);
    /* A block whose max maps to exactly 6 * sf: max 6 with scale 1 -> sf = e4m3(1) = 0x38, codes = values. */
    for (int i = 0; i < 16; i++)
        v[i] = k_e2m1[i % 8] * (i & 8 ? -1.0f : 1.0f);
    assert_int_equal(mm_quantize_block16(v, 1.0f, codes), 0x38);
    for (int i = 0; i < 16; i++)
        assert_int_equal((codes[i / 2] >> (4 * (i & 1))) & 15, i);
    /* SPEC: A / 2688, and 1 for A == 0. */
    assert_true(mm_activation_scale(0.0f) == 1.0f);
    assert_true(mm_activation_scale(2688.0f) == 1.0f);
    /* Dequantized values stay within half a step of the input. */
    for (int i = 0; i < 16; i++)
        v[i] = (float)(i * 37 % 11) - 5.3f;
    const float s = 0.013f;
    const uint8_t sf = mm_quantize_block16(v, s, codes);
    const float step = mm_e4m3_to_f32(sf) * s;
    for (int i = 0; i < 16; i++) {
        const float q = mm_e2m1_to_f32((codes[i / 2] >> (4 * (i & 1))) & 15) * step;
        assert_true(fabsf(q - v[i]) <= 1.0f * step + 1e-6f);
    }
}

/* The kernel layout of weight_layout.h: packing then unpacking gives the checkpoint bytes back, and
 * the fragment positions are the ones the header documents. */
static void test_weight_layout_round_trip(void **state) {
    (void)state;
    enum { ROWS = 256, KD = 192 }; /* 16 groups in 2 slabs, 3 K steps; as gate/up: I = 128 */
    const int64_t rows = ROWS, K = KD;
    static uint8_t codes[ROWS * KD / 2], sf[ROWS * KD / 16], pc[ROWS * KD / 2], ps[ROWS * KD / 16],
        uc[ROWS * KD / 2], us[ROWS * KD / 16];
    static uint16_t w[ROWS * KD], pw[ROWS * KD], uw[ROWS * KD];
    for (int i = 0; i < ROWS * KD / 2; i++)
        codes[i] = (uint8_t)(i * 37 + 11);
    for (int i = 0; i < ROWS * KD / 16; i++)
        sf[i] = (uint8_t)(i * 13 + 5);
    for (int i = 0; i < ROWS * KD; i++)
        w[i] = (uint16_t)(i * 7919);
    for (int gate_up = 0; gate_up < 2; gate_up++) {
        mm_layout_pack_nvfp4(codes, sf, rows, K, gate_up, pc, ps);
        mm_layout_unpack_nvfp4(pc, ps, rows, K, gate_up, uc, us);
        assert_memory_equal(codes, uc, sizeof codes);
        assert_memory_equal(sf, us, sizeof sf);
        mm_layout_pack_bf16(w, rows, K, gate_up, pw);
        mm_layout_unpack_bf16(pw, rows, K, gate_up, uw);
        assert_memory_equal(w, uw, sizeof w);
    }
    /* Spot check (gate_up = 1, still packed from the last pass): group 9 (slab 1, place 1), step 2,
     * lane 13 (g = 3, c = 1), k16 step 3, register 1: row g + 8 = up row 8 * 9 + 3 of I = 128, so
     * checkpoint row 128 + 75, k = 128 + 48 + 2; unit (1 * 3 + 2) * 8 + 1 = 41. */
    const int64_t row = 128 + 75, k = 128 + 48 + 2, unit = 41;
    assert_int_equal(mm_layout_unit(9, 2, 3), unit);
    /* BF16: the slab step (units 40..47) in core-matrix order: group 9 is place 1 of slab 1, so its
     * 8-row blocks are positions 4 * 1 + 0 = 4 (x2, + half); register 1 = half 1, k half 0; lane 13 =
     * g 3, c 1: element ((3 * 2 + 0) * 16 + 4 * 2 + 1) * 64 + 8 * 3 + 2 * 1 of the slab step. */
    const int64_t piece = (int64_t)(unit - 1) * 1024 + ((3 * 2 + 0) * 16 + 4 * 2 + 1) * 64;
    assert_int_equal(mm_layout_bf16_piece(9, 2, 3, 3, 0, 1), piece);
    assert_int_equal(pw[piece + 8 * 3 + 2 * 1 + 0], w[row * K + k]);
    assert_int_equal(pw[piece + 8 * 3 + 2 * 1 + 1], w[row * K + k + 1]);
    /* Its scale: byte 2s + h = 7 (row g + 8) of g = 3 in the unit's 64 = checkpoint block 4 * 2 + 3. */
    assert_int_equal(ps[(unit * 8 + 3) * 8 + 7], sf[row * (K / 16) + 4 * 2 + 3]);
}

/* mm_layout_pack_experts (finalize's in-place repack where I is a multiple of the kernels' tile,
 * experts on several threads) gives every expert exactly the bytes of the one-matrix packers, both
 * formats, with more threads than experts too. */
static void test_pack_experts_in_place(void **state) {
    (void)state;
    enum { E = 5, H = 256, I = 256 }; /* w13 [E, 512, 256], w2 [E, 256, 256] */
    const size_t n13 = 2 * I * H, n2 = (size_t)H * I;
    uint8_t *c13 = malloc(E * n13 / 2), *s13 = malloc(E * n13 / 16), *c2 = malloc(E * n2 / 2), *s2 = malloc(E * n2 / 16);
    uint16_t *b13 = malloc(E * n13 * 2), *b2 = malloc(E * n2 * 2);
    assert_non_null(c13 && s13 && c2 && s2 && b13 && b2);
    assert_int_equal(mm_layout_intermediate_padded(I), I);
    for (int threads = 1; threads <= 8; threads += 7) {
        uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)threads;
        const size_t nbytes[6] = {E * n13 / 2, E * n13 / 16, E * n2 / 2, E * n2 / 16, E * n13 * 2, E * n2 * 2};
        uint8_t *arrays[6] = {c13, s13, c2, s2, (uint8_t *)b13, (uint8_t *)b2};
        for (int a = 0; a < 6; a++)
            for (size_t i = 0; i < nbytes[a]; i++) {
                x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
                arrays[a][i] = (uint8_t)((x * 0x2545F4914F6CDD1Dull) >> 56);
            }
        /* Expert e's expected bytes, packed one matrix at a time before the in-place pass. */
        uint8_t *want = malloc(E * (n13 / 2 + n13 / 16 + n2 / 2 + n2 / 16 + n13 * 2 + n2 * 2));
        assert_non_null(want);
        uint8_t *p = want;
        for (int e = 0; e < E; e++) {
            mm_layout_pack_nvfp4(c13 + e * n13 / 2, s13 + e * n13 / 16, 2 * I, H, 1, p, p + n13 / 2);
            p += n13 / 2 + n13 / 16;
            mm_layout_pack_nvfp4(c2 + e * n2 / 2, s2 + e * n2 / 16, H, I, 0, p, p + n2 / 2);
            p += n2 / 2 + n2 / 16;
            mm_layout_pack_bf16(b13 + e * n13, 2 * I, H, 1, (uint16_t *)p);
            p += n13 * 2;
            mm_layout_pack_bf16(b2 + e * n2, H, I, 0, (uint16_t *)p);
            p += n2 * 2;
        }
        const uint8_t *before[6] = {c13, s13, c2, s2, (uint8_t *)b13, (uint8_t *)b2};
        uint8_t *none = NULL;
        uint16_t *none16 = NULL;
        assert_int_equal(mm_layout_pack_experts(&c13, &s13, &c2, &s2, &none16, &none16, E, H, I, threads), 1);
        assert_int_equal(mm_layout_pack_experts(&none, &none, &none, &none, &b13, &b2, E, H, I, threads), 1);
        const uint8_t *after[6] = {c13, s13, c2, s2, (uint8_t *)b13, (uint8_t *)b2};
        assert_memory_equal(before, after, sizeof before); /* in place: the same arrays */
        p = want;
        for (int e = 0; e < E; e++) {
            assert_memory_equal(c13 + e * n13 / 2, p, n13 / 2);
            assert_memory_equal(s13 + e * n13 / 16, p + n13 / 2, n13 / 16);
            p += n13 / 2 + n13 / 16;
            assert_memory_equal(c2 + e * n2 / 2, p, n2 / 2);
            assert_memory_equal(s2 + e * n2 / 16, p + n2 / 2, n2 / 16);
            p += n2 / 2 + n2 / 16;
            assert_memory_equal(b13 + e * n13, p, n13 * 2);
            p += n13 * 2;
            assert_memory_equal(b2 + e * n2, p, n2 * 2);
            p += n2 * 2;
        }
        free(want);
    }
    free(c13), free(s13), free(c2), free(s2), free(b13), free(b2);
}

static uint8_t *random_bytes(size_t n, uint64_t seed) {
    uint8_t *b = malloc(n);
    assert_non_null(b);
    uint64_t x = seed;
    for (size_t i = 0; i < n; i++) {
        x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
        b[i] = (uint8_t)((x * 0x2545F4914F6CDD1Dull) >> 56);
    }
    return b;
}

static uint8_t *copy_of(const void *src, size_t n) {
    uint8_t *c = malloc(n);
    assert_non_null(c);
    memcpy(c, src, n);
    return c;
}

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

/* Gate/up [2 IP, row] unpacked at the padded I against the checkpoint [2I, row]: gate rows, zero rows
 * up to IP, up rows, zero rows. */
static void check_gate_up_padded(const uint8_t *got, const uint8_t *ckpt, int64_t I, int64_t IP, size_t row) {
    assert_memory_equal(got, ckpt, (size_t)I * row);
    assert_true(all_zero(got + (size_t)I * row, (size_t)(IP - I) * row));
    assert_memory_equal(got + (size_t)IP * row, ckpt + (size_t)I * row, (size_t)I * row);
    assert_true(all_zero(got + (size_t)(IP + I) * row, (size_t)(IP - I) * row));
}

/* Down [rows, IP cols] unpacked at the padded I against the checkpoint [rows, I cols] (bytes per row). */
static void check_down_padded(const uint8_t *got, const uint8_t *ckpt, int64_t rows, size_t row,
                              size_t row_padded) {
    for (int64_t r = 0; r < rows; r++) {
        assert_memory_equal(got + (size_t)r * row_padded, ckpt + (size_t)r * row, row);
        assert_true(all_zero(got + (size_t)r * row_padded + row, row_padded - row));
    }
}

/* SPEC §1 allows any I that is a multiple of 64; the kernels compute at I padded to MM_LAYOUT_I_TILE.
 * Finalize's packer pads: unpacked at the padded I, every expert is its checkpoint weights plus zero
 * gate and up rows [I, I_padded) and zero down columns [I, I_padded) -- E2M1 code 0 with block scale
 * 0 (NVFP4), so a padded weight decodes to exactly 0 (and an all-zero block of the padded a = 0
 * quantizes to scale 0, codes 0: SPEC §3) -- in arrays of the padded size that replace the
 * checkpoint ones. */
static void test_pack_experts_pads_intermediate(void **state) {
    (void)state;
    assert_int_equal(MM_LAYOUT_I_TILE % 64, 0);
    const int64_t sizes[][2] = {{64, 256}, {192, 256}, {256, 256}, {320, 512}, {1408, 1536}, {2048, 2048}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        assert_int_equal(mm_layout_intermediate_padded(sizes[i][0]), sizes[i][1]);
    assert_true(mm_e2m1_to_f32(0) * mm_e4m3_to_f32(0) == 0.0f);
    enum { E = 3, H = 256, I = 192, IP = 256 };
    const size_t n13 = 2 * I * H, n2 = (size_t)H * I, p13 = 2 * IP * H, p2 = (size_t)H * IP;
    uint8_t *c13 = random_bytes(E * n13 / 2, 1), *s13 = random_bytes(E * n13 / 16, 2);
    uint8_t *c2 = random_bytes(E * n2 / 2, 3), *s2 = random_bytes(E * n2 / 16, 4);
    uint16_t *b13 = (uint16_t *)random_bytes(E * n13 * 2, 5), *b2 = (uint16_t *)random_bytes(E * n2 * 2, 6);
    uint8_t *uc = malloc(p13 / 2), *us = malloc(p13 / 16);
    uint16_t *ub = malloc(p13 * 2);
    assert_non_null(uc && us && ub);
    for (int threads = 1; threads <= 4; threads += 3) {
        uint8_t *k13 = copy_of(c13, E * n13 / 2), *ks13 = copy_of(s13, E * n13 / 16);
        uint8_t *k2 = copy_of(c2, E * n2 / 2), *ks2 = copy_of(s2, E * n2 / 16);
        uint16_t *kb13 = (uint16_t *)copy_of(b13, E * n13 * 2), *kb2 = (uint16_t *)copy_of(b2, E * n2 * 2);
        uint8_t *none = NULL;
        uint16_t *none16 = NULL;
        int ok = mm_layout_pack_experts(&k13, &ks13, &k2, &ks2, &none16, &none16, E, H, I, threads);
        ok = ok && mm_layout_pack_experts(&none, &none, &none, &none, &kb13, &kb2, E, H, I, threads);
        assert_int_equal(ok, 1);
        assert_null(none), assert_null(none16);
        for (int e = 0; e < E; e++) {
            mm_layout_unpack_nvfp4(k13 + e * p13 / 2, ks13 + e * p13 / 16, 2 * IP, H, 1, uc, us);
            check_gate_up_padded(uc, c13 + e * n13 / 2, I, IP, H / 2);
            check_gate_up_padded(us, s13 + e * n13 / 16, I, IP, H / 16);
            mm_layout_unpack_nvfp4(k2 + e * p2 / 2, ks2 + e * p2 / 16, H, IP, 0, uc, us);
            check_down_padded(uc, c2 + e * n2 / 2, H, I / 2, IP / 2);
            check_down_padded(us, s2 + e * n2 / 16, H, I / 16, IP / 16);
            mm_layout_unpack_bf16(kb13 + e * p13, 2 * IP, H, 1, ub);
            check_gate_up_padded((const uint8_t *)ub, (const uint8_t *)(b13 + e * n13), I, IP, H * 2);
            mm_layout_unpack_bf16(kb2 + e * p2, H, IP, 0, ub);
            check_down_padded((const uint8_t *)ub, (const uint8_t *)(b2 + e * n2), H, I * 2, IP * 2);
        }
        free(k13), free(ks13), free(k2), free(ks2), free(kb13), free(kb2);
    }
    free(uc), free(us), free(ub);
    free(c13), free(s13), free(c2), free(s2), free(b13), free(b2);
}

/* The CUDA backend sizes everything I-shaped at the padded I: its communication buffer (the act
 * region of [R*T_max*K, I] 16-bit rows and every offset after it) is the padded shape's, so a layer
 * of I = 1408 has the buffer of I = 1536 (the uploads and mm_dev_shape.I take the same
 * mm_layout_intermediate_padded). The CPU buffer has no I-shaped region. */
static void test_buffer_layout_padded_intermediate(void **state) {
    (void)state;
    for (int device = 0; device < 2; device++) {
        mm_buffer_layout a, b;
        mm_buffer_layout_compute(64, 8, 1024, device, device, 2, 16, 1408, &a);
        mm_buffer_layout_compute(64, 8, 1024, device, device, 2, 16, 1536, &b);
        assert_memory_equal(&a, &b, sizeof a);
    }
    mm_buffer_layout a;
    mm_buffer_layout_compute(64, 8, 1024, 1, 0, 2, 16, 192, &a);
    assert_true(a.error - a.act >= 2ull * 64 * 8 * 256 * 2); /* act: [R*T_max*K, 256] 16-bit rows */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e2m1_decode_all_codes),
        cmocka_unit_test(test_e2m1_spec_ties_and_saturation),
        cmocka_unit_test(test_e4m3_all_codes_round_trip),
        cmocka_unit_test(test_e4m3_ties_subnormals_saturation),
        cmocka_unit_test(test_bf16_rounding),
        cmocka_unit_test(test_block_quantizer),
        cmocka_unit_test(test_weight_layout_round_trip),
        cmocka_unit_test(test_pack_experts_in_place),
        cmocka_unit_test(test_pack_experts_pads_intermediate),
        cmocka_unit_test(test_buffer_layout_padded_intermediate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
