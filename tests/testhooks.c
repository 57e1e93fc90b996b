/*
 * testhooks.c -- src/formats.h and the public quantizer behind a plain C ABI, loaded by
 * tests/py/test_formats.py through ctypes and checked against ml_dtypes and numpy.
 */
#include <stddef.h>
#include <stdint.h>

#include "formats.h"
#include "megamoe.h"

void th_e2m1_rn(const float *v, uint8_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = mm_e2m1_rn(v[i]);
}
void th_e4m3_rn(const float *v, uint8_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = mm_e4m3_rn(v[i]);
}
void th_e2m1_decode(const uint8_t *c, float *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = mm_e2m1_to_f32(c[i]);
}
void th_e4m3_decode(const uint8_t *c, float *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = mm_e4m3_to_f32(c[i]);
}
void th_f32_to_bf16(const float *v, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = mm_f32_to_bf16(v[i]);
}

/* SPEC §3 activation quantization of T tokens [T, H] bf16: codes [T, H/2], sf [T, H/16], s [T].
 * Non-finite tokens get s = NaN and untouched codes. */
void th_quantize_activations(const uint16_t *x, size_t T, size_t H, uint8_t *codes, uint8_t *sf, float *s) {
    for (size_t t = 0; t < T; t++) {
        float amax = 0.0f, block[16];
        int finite = 1;
        for (size_t h = 0; h < H; h++) {
            const float v = mm_bf16_to_f32(x[t * H + h]);
            finite &= mm_isfinite(v);
            amax = mm_max_nan(amax, mm_fabs(v));
        }
        if (!finite) {
            s[t] = mm_f32_from_bits(0x7FC00000u);
            continue;
        }
        s[t] = mm_activation_scale(amax);
        for (size_t b = 0; b < H / 16; b++) {
            for (int i = 0; i < 16; i++)
                block[i] = mm_bf16_to_f32(x[t * H + b * 16 + i]);
            sf[t * H / 16 + b] = mm_quantize_block16(block, s[t], codes + t * H / 2 + b * 8);
        }
    }
}

/* The down projection's input quantization with the static a2: a [n] f32, n % 16 == 0. */
void th_quantize_static(const float *a, size_t n, float a2, uint8_t *codes, uint8_t *sf) {
    for (size_t b = 0; b < n / 16; b++)
        sf[b] = mm_quantize_block16(a + b * 16, a2, codes + b * 8);
}

int th_quantize_weight(const uint16_t *w, int64_t rows, int64_t cols, uint8_t *codes, uint8_t *sf,
                       float *alpha) {
    return (int)megamoe_quantize_nvfp4(w, rows, cols, codes, sf, alpha);
}
