/*
 * quantize.c -- BF16 expert weights to NVFP4, the ModelOpt way (SPEC §2-3): the block quantizer and
 * the calibration of static input scales (the checkpoint converter is checkpoint/convert.c).
 *
 * Weights: alpha = amax / (6 * 448) per tensor (gate and up are separate tensors, so each keeps its
 * own), E4M3 block scales per 16, E2M1 codes, all through the one block quantizer of formats.h.
 * Static input scales need activation statistics that a weight file does not hold; they are
 * estimated from seeded N(0, 1) tokens run through the BF16 expert (documented in docs/).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "internal.h"

megamoe_status megamoe_quantize_nvfp4(const uint16_t *w, int64_t rows, int64_t cols, uint8_t *codes,
                                      uint8_t *scales, float *global_scale) {
    if (!w || !codes || !scales || !global_scale || rows < 0 || cols <= 0 || cols % 16)
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    float amax = 0.0f;
    for (int64_t i = 0; i < rows * cols; i++) {
        const float v = mm_bf16_to_f32(w[i]);
        if (!mm_isfinite(v)) return MEGAMOE_ERR_BAD_WEIGHT;
        amax = mm_max_nan(amax, mm_fabs(v));
    }
    const float alpha = mm_activation_scale(amax); /* amax / 2688, 1 for an all-zero tensor */
    *global_scale = alpha;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float block[16];
        for (int64_t b = 0; b < cols / 16; b++) {
            for (int i = 0; i < 16; i++)
                block[i] = mm_bf16_to_f32(w[r * cols + b * 16 + i]);
            scales[r * (cols / 16) + b] = mm_quantize_block16(block, alpha, codes + r * (cols / 2) + b * 8);
        }
    }
    return MEGAMOE_OK;
}

void megamoe_quantize_options_init(megamoe_quantize_options *o) {
    memset(o, 0, sizeof *o);
    o->calib_tokens = 64;
    o->calib_seed = 0x5EED;
}

/* ---- Calibration ----------------------------------------------------------------------------- */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_normal(rng *r) { /* Box-Muller */
    const double u1 = ((double)(rng_next(r) >> 11) + 1.0) / 9007199254740993.0;
    const double u2 = (double)(rng_next(r) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

megamoe_status megamoe_calibrate_expert_bf16(const uint16_t *w13, int H, int I, int tokens, uint64_t seed,
                                             float clamp, float *x_amax, float *a_amax) {
    if (!w13 || H <= 0 || I <= 0 || tokens <= 0 || !x_amax || !a_amax) return MEGAMOE_ERR_INVALID_ARGUMENT;
    float *x = malloc((size_t)tokens * (size_t)H * sizeof *x);       /* [tokens, H] bf16 values */
    float *gu = malloc((size_t)tokens * 2 * (size_t)I * sizeof *gu); /* [tokens, 2I] */
    if (!x || !gu) {
        free(x);
        free(gu);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    rng r = {seed};
    float xa = 0.0f;
    for (size_t i = 0; i < (size_t)tokens * (size_t)H; i++) {
        x[i] = mm_bf16_to_f32(mm_f32_to_bf16((float)rng_normal(&r)));
        xa = fmaxf(xa, fabsf(x[i]));
    }
#pragma omp parallel for schedule(static)
    for (int j = 0; j < 2 * I; j++) {
        for (int t = 0; t < tokens; t++) {
            float acc = 0.0f;
            for (int h = 0; h < H; h++)
                acc += x[(size_t)t * H + h] * mm_bf16_to_f32(w13[(size_t)j * H + h]);
            gu[(size_t)t * 2 * I + j] = acc;
        }
    }
    float aa = 0.0f;
    for (int t = 0; t < tokens; t++) {
        for (int n = 0; n < I; n++) {
            float g = gu[(size_t)t * 2 * I + n], u = gu[(size_t)t * 2 * I + I + n];
            if (clamp > 0.0f) {
                g = fminf(g, clamp);
                u = fminf(fmaxf(u, -clamp), clamp);
            }
            aa = fmaxf(aa, fabsf(g / (1.0f + expf(-g)) * u));
        }
    }
    free(x);
    free(gu);
    *x_amax = xa;
    *a_amax = aa;
    return MEGAMOE_OK;
}

