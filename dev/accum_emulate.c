/*
 * accum_emulate.c -- an experiment, not part of the library: a test_gpu grid case on the CPU, the
 * CPU backend's y against an emulation of the GPU kernels' arithmetic (DECISIONS 30, 31).
 * The emulation: every 16-element dot product exact (double), added into an f32 accumulator that
 * rounds toward zero -- the tensor cores' accumulation (dev/sm90_accum_probe.cu: a bias toward zero)
 * -- over all of K as one chain, or with the chain's sums added into a round-to-nearest f32
 * accumulator every P k16 steps (env TCP=P; PHASE=1 gate/up only, 2 down only, 3 both). Against
 * the H200 on E 16 K 1 H 512 I 768 T 33 (session 16, MEGAMOE_TEST_SEED 0-4), one chain: 3.5e-4 /
 * 1.76e-5 / 1.077e-3 / 4.6e-5 / 6.03e-4 where the GPU read 2.3e-5 / 1.76e-5 / 1.08e-3 / 6.0e-5 /
 * 6.04e-4; a chain per K step (TCP=4 PHASE=1): 3.0e-6 / 6.7e-6 / 6.2e-5 / 4.5e-5 against 3.0e-6 /
 * 5.5e-6 / 5.7e-5 / 6.0e-5 (seeds 0-3). Not exact (the tensor cores' 16-product sums are not exact
 * double), the same magnitudes and mechanism.
 * With "f64" instead of "tc": the float64 evaluation of the same math (SPEC's roundings kept).
 * NVFP4 (FORMAT=nvfp4): the same with SPEC's NVFP4 math -- x quantized per token (s, E4M3 block
 * scales, E2M1 codes) and the down input quantized with the static a2, as the CPU backend does;
 * the dot products over the decoded values (x / s and the E2M1 x E4M3 weights, exact products),
 * scaled by s and the global scales afterwards, as both backends do. One chain: E 16 K 8 H 256
 * I 256 T 1100 at 8.473e-4 on the recorded data, where the H200 read 8.47e-4 (2.66e-5 / 2.65e-5 at
 * seed 4).
 * W4A16 (FORMAT=w4a16, SPEC §3b): NVFP4 weights, x unquantized, g and u scaled by the global
 * scales, a = bf16_rn(silu(g) u), p scaled by alpha_2 -- what the GPU computes with x and a as exact
 * f16 (times powers of two) against the decoded weights; test_gpu's NVFP4 seeds.
 *   usage: accum_emulate SEEDS {tc|f64} [E K H I T]     (defaults: 16 1 512 768 33)
 * Build from the repo root after the CPU build (cmake -B build-nocuda -DMEGAMOE_CUDA=OFF):
 *   cc -O2 -std=c11 -D_GNU_SOURCE -Iinclude -Isrc -Itests dev/accum_emulate.c tests/test_util.c \
 *      build-nocuda/libmegamoe.a -lcmocka -ljansson -lm -fopenmp -o /tmp/emu && TCP=4 PHASE=1 /tmp/emu 64 tc
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "formats.h"
#include "test_util.h"

static uint64_t g_offset;
static int g_tc, g_tcp, g_phase = 3;

/* test_gpu.c's seed(): the case's seed offset by MEGAMOE_TEST_SEED */
static uint64_t seed(uint64_t s) { return s + g_offset * 0x9E3779B97F4A7C15ull; }
static double bf16_rn(double v) { return tu_f32(tu_bf16((float)v)); }
static float add_rz(float acc, double v) { /* f32 add rounding toward zero */
    const double s = (double)acc + v;
    float f = (float)s;
    if (fabs((double)f) > fabs(s)) f = nextafterf(f, 0.0f);
    return f;
}

/* sum_k a[k] b[k] over n elements: float64, or the tensor-core emulation. */
static double dot(const double *a, const double *b, int n, int phase_bit) {
    if (!g_tc) {
        double s = 0;
        for (int k = 0; k < n; k++) s += a[k] * b[k];
        return s;
    }
    float chain = 0, sum = 0;
    for (int k0 = 0; k0 < n; k0 += 16) {
        if (g_tcp && (g_phase & phase_bit) && k0 && (k0 / 16) % g_tcp == 0) sum += chain, chain = 0;
        double c = 0;
        for (int k = k0; k < k0 + 16; k++) c += a[k] * b[k];
        chain = add_rz(chain, c);
    }
    return (double)(sum + chain);
}

/* Element i of packed E2M1 codes (element 2j the low nibble of byte j) times its block scale sf. */
static double fp4_value(const uint8_t *codes, size_t i, float sf) {
    return (double)mm_e2m1_to_f32((uint8_t)((codes[i / 2] >> (4 * (i & 1))) & 15)) * sf;
}

/* Expert e's weights decoded to double: w13 [2I, H], w2 [H, I] (NVFP4 without the global scales). */
static void decode_expert(const tu_model *m, int nvfp4, int e, int H, int I, double *w13, double *w2) {
    for (size_t i = 0; i < (size_t)2 * I * H; i++) {
        const size_t g = (size_t)e * 2 * I * H + i;
        w13[i] = nvfp4 ? fp4_value(m->w13, g, mm_e4m3_to_f32(m->w13_sf[g / 16])) : tu_f32(m->w13_bf16[g]);
    }
    for (size_t i = 0; i < (size_t)H * I; i++) {
        const size_t g = (size_t)e * H * I + i;
        w2[i] = nvfp4 ? fp4_value(m->w2, g, mm_e4m3_to_f32(m->w2_sf[g / 16])) : tu_f32(m->w2_bf16[g]);
    }
}

/* One token's x for the GEMM: x itself (BF16) or its quantized values x / s (NVFP4, the CPU
 * quantizer's arithmetic); returns s (1 for BF16), 0 for a token with a non-finite x. */
static float token_x(const uint16_t *x, int H, int nvfp4, double *xr) {
    float amax = 0.0f;
    for (int h = 0; h < H; h++) {
        const float v = tu_f32(x[h]);
        if (!isfinite(v)) return 0.0f;
        amax = mm_max_nan(amax, mm_fabs(v));
        xr[h] = v;
    }
    if (!nvfp4) return 1.0f;
    const float s = mm_activation_scale(amax);
    for (int b = 0; b < H / 16; b++) {
        float block[16];
        uint8_t codes[8];
        for (int i = 0; i < 16; i++) block[i] = tu_f32(x[b * 16 + i]);
        const float sf = mm_e4m3_to_f32(mm_quantize_block16(block, s, codes));
        for (int i = 0; i < 16; i++) xr[b * 16 + i] = fp4_value(codes, (size_t)i, sf);
    }
    return s;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s SEEDS {tc|f64} [E K H I T]   (env FORMAT=nvfp4|bf16, TCP, PHASE)\n", argv[0]);
        return 2;
    }
    const int N = atoi(argv[1]);
    g_tc = strcmp(argv[2], "tc") == 0;
    if (getenv("TCP")) g_tcp = atoi(getenv("TCP"));
    if (getenv("PHASE")) g_phase = atoi(getenv("PHASE"));
    /* nvfp4: quantized activations (SPEC §3); wfp4: NVFP4 weights (§3, or §3b with w4a16) */
    const int nvfp4 = getenv("FORMAT") && strcmp(getenv("FORMAT"), "nvfp4") == 0;
    const int wfp4 = nvfp4 || (getenv("FORMAT") && strcmp(getenv("FORMAT"), "w4a16") == 0);
    const megamoe_weight_format fmt = wfp4 ? MEGAMOE_FORMAT_NVFP4 : MEGAMOE_FORMAT_BF16;
    int E = 16, K = 1, H = 512, I = 768, T = 33;
    if (argc >= 8) E = atoi(argv[3]), K = atoi(argv[4]), H = atoi(argv[5]), I = atoi(argv[6]), T = atoi(argv[7]);
    double *xq = malloc(sizeof(double) * (size_t)T * H), *a = malloc(sizeof(double) * I);
    double *p = malloc(sizeof(double) * (size_t)T * K * H), *acc = malloc(sizeof(double) * H);
    double *w13 = malloc(sizeof(double) * 2 * (size_t)I * H), *w2 = malloc(sizeof(double) * (size_t)H * I);
    float *xs = malloc(sizeof(float) * T);
    uint16_t *y = malloc((size_t)T * H * 2);
    for (g_offset = 0; g_offset < (uint64_t)N; g_offset++) {
        megamoe_layer_config c;
        megamoe_layer_config_init(&c);
        c.name = "emu";
        c.num_experts = E, c.top_k = K, c.hidden_size = H, c.intermediate_size = I;
        c.max_tokens = T, c.format = fmt;
        c.activations = nvfp4 ? MEGAMOE_ACTIVATIONS_NVFP4 : MEGAMOE_ACTIVATIONS_BF16;
        tu_model m; /* test_gpu.c run_case's model and inputs */
        tu_model_random(&m, &c, 1, seed((uint64_t)(E * 131 + H + T + fmt)));
        tu_inputs in;
        tu_inputs_edge_cases(&in, T, &c, seed((uint64_t)T * 7 + 1));
        megamoe_group *g;
        megamoe_layer *l;
        tu_layer_make(&m, 1, &g, &l);
        if (tu_forward(g, l, &in, y) != MEGAMOE_OK) return 1;
        for (int t = 0; t < T; t++) xs[t] = in.padding[t] ? 0.0f : token_x(in.x + (size_t)t * H, H, nvfp4, xq + (size_t)t * H);
        /* Each routed slot's p (after the norm), expert by expert (one expert's weights decoded at a time). */
        for (int e = 0; e < E; e++) {
            decode_expert(&m, wfp4, e, H, I, w13, w2);
            const float ag = wfp4 ? m.w13_s2[2 * e] : 1.0f, au = wfp4 ? m.w13_s2[2 * e + 1] : 1.0f;
            const float a2 = nvfp4 ? m.w2_in[e] : 1.0f, al2 = wfp4 ? m.w2_s2[e] : 1.0f;
            for (int t = 0; t < T; t++)
                for (int k = 0; k < K; k++) {
                    if (in.ids[t * K + k] != e || xs[t] == 0.0f) continue;
                    const double *xr = xq + (size_t)t * H;
                    for (int n = 0; n < I; n++) {
                        double gv = dot(xr, w13 + (size_t)n * H, H, 1), uv = dot(xr, w13 + (size_t)(I + n) * H, H, 1);
                        if (g_tc) { /* the backends' f32 arithmetic */
                            float gf = (float)gv, uf = (float)uv;
                            if (nvfp4) gf = mm_mul(mm_mul(gf, xs[t]), ag), uf = mm_mul(mm_mul(uf, xs[t]), au);
                            else if (wfp4) gf = mm_mul(gf, ag), uf = mm_mul(uf, au);
                            a[n] = gf / (1.0f + expf(-gf)) * uf;
                        } else {
                            if (wfp4) gv *= (double)xs[t] * ag, uv *= (double)xs[t] * au;
                            a[n] = gv / (1 + exp(-gv)) * uv;
                        }
                    }
                    for (int b = 0; b < I / 16; b++) { /* SPEC's rounding of the down projection's input */
                        float block[16];
                        uint8_t codes[8];
                        for (int i = 0; i < 16; i++) block[i] = (float)a[b * 16 + i];
                        if (!nvfp4) {
                            for (int i = 0; i < 16; i++) a[b * 16 + i] = bf16_rn(block[i]);
                            continue;
                        }
                        const float sf = mm_e4m3_to_f32(mm_quantize_block16(block, a2, codes));
                        for (int i = 0; i < 16; i++) a[b * 16 + i] = fp4_value(codes, (size_t)i, sf);
                    }
                    double *pr = p + ((size_t)t * K + k) * H, ss = 0;
                    for (int h = 0; h < H; h++) {
                        double v = dot(a, w2 + (size_t)h * I, I, 2);
                        if (nvfp4) v = g_tc ? mm_mul(mm_mul((float)v, a2), al2) : v * a2 * al2;
                        else if (wfp4) v = g_tc ? mm_mul((float)v, al2) : v * al2;
                        pr[h] = v, ss += v * v;
                    }
                    const double rms = 1 / sqrt(ss / H + c.norm_eps);
                    for (int h = 0; h < H; h++) pr[h] *= rms * m.norm[h];
                }
        }
        double num = 0, den = 0;
        for (int t = 0; t < T; t++) {
            int live = 0;
            for (int k = 0; k < K; k++) live |= in.ids[t * K + k] >= 0;
            if (xs[t] == 0.0f || !live) continue; /* NaN, zero and padding rows: test_gpu compares those exactly */
            for (int h = 0; h < H; h++) acc[h] = 0;
            for (int k = 0; k < K; k++)
                if (in.ids[t * K + k] >= 0)
                    for (int h = 0; h < H; h++) acc[h] += in.weights[t * K + k] * p[((size_t)t * K + k) * H + h];
            for (int h = 0; h < H; h++) {
                const double r = bf16_rn(acc[h]), cv = tu_f32(y[(size_t)t * H + h]);
                num += (r - cv) * (r - cv), den += cv * cv;
            }
        }
        printf("seed offset %llu: rel L2 of the CPU backend against %s %.3e\n", (unsigned long long)g_offset,
               g_tc ? "the emulation" : "float64", sqrt(num / den));
        megamoe_layer_destroy(l);
        megamoe_group_destroy(g);
        tu_inputs_free(&in);
        tu_model_free(&m);
    }
    free(xq), free(a), free(p), free(acc), free(w13), free(w2), free(xs), free(y);
    return 0;
}
