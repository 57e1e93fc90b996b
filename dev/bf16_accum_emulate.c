/*
 * bf16_accum_emulate.c -- an experiment, not part of the library: test_gpu's BF16 grid case on the
 * CPU, the CPU backend's y against an emulation of the GPU kernels' arithmetic (DECISIONS 85).
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
 *   usage: bf16_accum_emulate SEEDS {tc|f64} [E K H I T]     (defaults: 16 1 512 768 33)
 * Build from the repo root after the CPU build (cmake -B build-nocuda -DMEGAMOE_CUDA=OFF):
 *   cc -O2 -std=c11 -D_GNU_SOURCE -Iinclude -Itests dev/bf16_accum_emulate.c tests/test_util.c \
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

/* sum_k a[k] b[k] over n elements (a, b with strides): float64, or the tensor-core emulation. */
static double dot(const double *a, const uint16_t *b, int n, int phase_bit) {
    if (!g_tc) {
        double s = 0;
        for (int k = 0; k < n; k++) s += a[k] * tu_f32(b[k]);
        return s;
    }
    float chain = 0, sum = 0;
    for (int k0 = 0; k0 < n; k0 += 16) {
        if (g_tcp && (g_phase & phase_bit) && k0 && (k0 / 16) % g_tcp == 0) sum += chain, chain = 0;
        double c = 0;
        for (int k = k0; k < k0 + 16; k++) c += a[k] * tu_f32(b[k]);
        chain = add_rz(chain, c);
    }
    return (double)(sum + chain);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s SEEDS {tc|f64} [E K H I T]\n", argv[0]);
        return 2;
    }
    const int N = atoi(argv[1]);
    g_tc = strcmp(argv[2], "tc") == 0;
    if (getenv("TCP")) g_tcp = atoi(getenv("TCP"));
    if (getenv("PHASE")) g_phase = atoi(getenv("PHASE"));
    int E = 16, K = 1, H = 512, I = 768, T = 33;
    if (argc >= 8) E = atoi(argv[3]), K = atoi(argv[4]), H = atoi(argv[5]), I = atoi(argv[6]), T = atoi(argv[7]);
    double *xr = malloc(sizeof(double) * H), *a = malloc(sizeof(double) * I), *p = malloc(sizeof(double) * H);
    double *acc = malloc(sizeof(double) * H);
    uint16_t *y = malloc((size_t)T * H * 2);
    for (g_offset = 0; g_offset < (uint64_t)N; g_offset++) {
        megamoe_layer_config c;
        megamoe_layer_config_init(&c);
        c.name = "emu";
        c.num_experts = E, c.top_k = K, c.hidden_size = H, c.intermediate_size = I;
        c.max_tokens = T, c.format = MEGAMOE_FORMAT_BF16;
        tu_model m; /* test_gpu.c run_case's model and inputs */
        tu_model_random(&m, &c, 1, seed((uint64_t)(E * 131 + H + T + MEGAMOE_FORMAT_BF16)));
        tu_inputs in;
        tu_inputs_edge_cases(&in, T, &c, seed((uint64_t)T * 7 + 1));
        megamoe_group *g;
        megamoe_layer *l;
        tu_layer_make(&m, 1, &g, &l);
        if (tu_forward(g, l, &in, y) != MEGAMOE_OK) return 1;
        double num = 0, den = 0;
        for (int t = 0; t < T; t++) {
            int skip = in.padding[t], live = 0;
            for (int h = 0; h < H; h++) {
                xr[h] = tu_f32(in.x[(size_t)t * H + h]);
                if (!isfinite(xr[h])) skip = 1;
            }
            for (int k = 0; k < K; k++) live |= in.ids[t * K + k] >= 0;
            if (skip || !live) continue; /* NaN and zero rows: test_gpu compares those exactly */
            for (int h = 0; h < H; h++) acc[h] = 0;
            for (int k = 0; k < K; k++) {
                const int e = in.ids[t * K + k];
                if (e < 0) continue;
                const uint16_t *w13 = m.w13_bf16 + (size_t)e * 2 * I * H, *w2 = m.w2_bf16 + (size_t)e * H * I;
                for (int n = 0; n < I; n++) {
                    const double gv = dot(xr, w13 + (size_t)n * H, H, 1), uv = dot(xr, w13 + (size_t)(I + n) * H, H, 1);
                    a[n] = g_tc ? bf16_rn((float)gv / (1.0f + expf(-(float)gv)) * (float)uv)
                                : bf16_rn(gv / (1 + exp(-gv)) * uv);
                }
                double ss = 0;
                for (int h = 0; h < H; h++) p[h] = dot(a, w2 + (size_t)h * I, I, 2), ss += p[h] * p[h];
                const double rms = 1 / sqrt(ss / H + c.norm_eps);
                for (int h = 0; h < H; h++) acc[h] += in.weights[t * K + k] * p[h] * rms * m.norm[h];
            }
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
    free(xr), free(a), free(p), free(acc), free(y);
    return 0;
}
