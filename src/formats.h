/*
 * formats.h -- the number formats of SPEC §2-3, defined once for host and device code.
 *
 * E2M1 (FP4) and E4M3 (float8_e4m3fn) codecs, bf16 rounding, and the one block quantizer that the
 * activation, down-projection and weight quantizers share. Everything here is integer bit work or
 * single IEEE float32 operations written so that neither the C compiler nor nvcc may contract or
 * reorder them: the CPU and the GPU produce the same bytes (SPEC §2: bit-exact across backends).
 * The build compiles every file with -ffp-contract=off (C) and --fmad=false is not needed here
 * because each device operation below is an explicit round-to-nearest intrinsic.
 */
#ifndef MEGAMOE_FORMATS_H
#define MEGAMOE_FORMATS_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MM_HD __host__ __device__ __forceinline__
#else
#define MM_HD static inline
#endif

#define MM_E4M3_MAX 448.0f
#define MM_E2M1_MAX 6.0f
#define MM_NVFP4_BLOCK 16 /* elements per E4M3 block scale */

/* ---- IEEE float32 operations that stay single, rounded, uncontracted operations -------------- */

#if defined(__CUDA_ARCH__)
MM_HD float mm_mul(float a, float b) { return __fmul_rn(a, b); }
MM_HD float mm_div(float a, float b) { return __fdiv_rn(a, b); }
MM_HD float mm_add(float a, float b) { return __fadd_rn(a, b); }
MM_HD uint32_t mm_f32_bits(float f) { return __float_as_uint(f); }
MM_HD float mm_f32_from_bits(uint32_t u) { return __uint_as_float(u); }
#else
MM_HD float mm_mul(float a, float b) { return a * b; }
MM_HD float mm_div(float a, float b) { return a / b; }
MM_HD float mm_add(float a, float b) { return a + b; }
MM_HD uint32_t mm_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
MM_HD float mm_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

MM_HD float mm_fabs(float f) { return mm_f32_from_bits(mm_f32_bits(f) & 0x7FFFFFFFu); }
MM_HD int mm_isfinite(float f) { return (mm_f32_bits(f) & 0x7F800000u) != 0x7F800000u; }
/* max that ignores nothing: a NaN in either argument gives NaN (fmaxf would drop it). */
MM_HD float mm_max_nan(float a, float b) { return (a != a || a > b) ? a : b; }

/* ---- bf16 -------------------------------------------------------------------------------------- */

MM_HD float mm_bf16_to_f32(uint16_t h) { return mm_f32_from_bits((uint32_t)h << 16); }

/* Round to nearest, ties to even; NaN stays a (quiet) NaN of the same sign. */
MM_HD uint16_t mm_f32_to_bf16(float f) {
    uint32_t u = mm_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- E2M1 (FP4) -------------------------------------------------------------------------------- */

/* Code 0..15: bit 3 = sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Codes 2..7 are
 * 2^(e-1) (1 + m/2), e = bits 1-2, m = bit 0, whose f32 bits are (c + 252) << 22 (e lands in the
 * exponent, m in the top mantissa bit); code 1 is 0.5. Bit operations and selects only (no integer
 * to float conversion): the GPU's quantizing epilogue decodes two values per lane and column. */
MM_HD float mm_e2m1_to_f32(uint8_t code) {
    const uint32_t c = code & 7u;
    const uint32_t mag = c >= 2u ? (c + 252u) << 22 : c == 1u ? 0x3F000000u : 0u;
    return mm_f32_from_bits(mag | (uint32_t)(code & 8u) << 28);
}

/* Nearest E2M1 value, ties to the even code, |v| > 6 saturates; the sign bit is v's sign, also when
 * the magnitude rounds to 0. A NaN gives the zero code of its sign bit. */
MM_HD uint8_t mm_e2m1_rn(float v) {
    uint32_t sign = (mm_f32_bits(v) >> 28) & 8u;
    float a = mm_fabs(v);
    uint32_t code = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) +
                    (uint32_t)(a >= 1.75f) + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) +
                    (uint32_t)(a > 5.0f);
    return (uint8_t)(sign | code);
}

/* ---- E4M3 (float8_e4m3fn) ---------------------------------------------------------------------- */

/* 2^(e-7) (1 + m/8), e = bits 3-6, m = bits 0-2; e = 0 is subnormal, m 2^-9 = 2^-6 (1 + m/8) - 2^-6
 * (exact); e = 15, m = 7 is NaN. */
MM_HD float mm_e4m3_to_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (uint32_t)(b & 0x80u) << 24;
    if (e == 15u && m == 7u) return mm_f32_from_bits(sign | 0x7FC00000u);
    const float x = mm_f32_from_bits(((e == 0u ? 1u : e) + 120u) << 23 | m << 20);
    const float mag = e == 0u ? mm_add(x, -0.015625f) : x;
    return mm_f32_from_bits(mm_f32_bits(mag) | sign);
}

/* Round 0 <= y < 2^22 to the nearest integer, ties to even, in one f32 addition. */
MM_HD uint32_t mm_rne_small(float y) {
    return mm_f32_bits(mm_add(y, 12582912.0f)) - 0x4B400000u; /* 1.5 * 2^23 */
}

/* Nearest E4M3 value, ties to even, saturating at +-448; NaN gives 0x7F with v's sign bit. */
MM_HD uint8_t mm_e4m3_rn(float v) {
    uint32_t bits = mm_f32_bits(v);
    uint32_t sign = (bits >> 24) & 0x80u;
    uint32_t abits = bits & 0x7FFFFFFFu;
    if (abits > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);
    if (abits >= 0x43E00000u) return (uint8_t)(sign | 0x7Eu); /* >= 448, infinity too */
    if (abits < 0x3C800000u) {                                /* < 2^-6: subnormal target */
        return (uint8_t)(sign | mm_rne_small(mm_mul(mm_f32_from_bits(abits), 512.0f)));
    }
    /* Normal: keep 3 mantissa bits with round-to-nearest-even, re-bias the exponent 127 -> 7.
     * A mantissa carry moves into the exponent, which is the right result. */
    uint32_t r = (abits + 0x7FFFFu + ((abits >> 20) & 1u)) >> 20;
    r -= (127u - 7u) << 3;
    if (r > 0x7Eu) r = 0x7Eu;
    return (uint8_t)(sign | r);
}

/* An E4M3 block-scale byte a checkpoint may hold: not NaN, not negative (SPEC §5). */
MM_HD int mm_e4m3_scale_valid(uint8_t b) { return (b & 0x80u) == 0 && b != 0x7Fu; }

/* ---- The block quantizer (SPEC §3) --------------------------------------------------------------
 * One 16-element block v against a per-row scale `scale` (the token's s, the static a2, or a
 * weight's global alpha):
 *   sf = e4m3_rn(max|v| / (scale * 6));  sf == 0 -> codes 0;  else q = e2m1_rn(v / (sf * scale)).
 * Writes 8 bytes of codes (element 2j low nibble, 2j+1 high nibble) and returns the sf byte. */
MM_HD uint8_t mm_quantize_block16(const float *v, float scale, uint8_t *codes) {
    float amax = 0.0f;
    for (int i = 0; i < MM_NVFP4_BLOCK; i++)
        amax = mm_max_nan(amax, mm_fabs(v[i]));
    uint8_t sf = mm_e4m3_rn(mm_div(amax, mm_mul(scale, 6.0f)));
    float sf_f = mm_e4m3_to_f32(sf);
    if (sf_f == 0.0f) {
        for (int j = 0; j < MM_NVFP4_BLOCK / 2; j++)
            codes[j] = 0;
        return sf;
    }
    float denom = mm_mul(sf_f, scale);
    for (int j = 0; j < MM_NVFP4_BLOCK / 2; j++) {
        uint8_t lo = mm_e2m1_rn(mm_div(v[2 * j], denom));
        uint8_t hi = mm_e2m1_rn(mm_div(v[2 * j + 1], denom));
        codes[j] = (uint8_t)(lo | (hi << 4));
    }
    return sf;
}

/* The per-token activation scale: s = A / 2688 (6 * 448), 1 when A == 0. */
MM_HD float mm_activation_scale(float amax) { return amax == 0.0f ? 1.0f : mm_div(amax, 2688.0f); }

#endif /* MEGAMOE_FORMATS_H */
