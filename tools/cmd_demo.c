/*
 * cmd_demo.c -- `megamoe demo` (an embedded model, checked) and `megamoe bench` (timings).
 */
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* ---- The demo model ------------------------------------------------------------------------- */

typedef struct demo_model {
    int E, K, H, I;
    uint16_t *w13; /* [E, 2I, H] bf16 */
    uint16_t *w2;  /* [E, H, I]  bf16 */
    float *norm;   /* [H] */
    /* NVFP4, per expert and projection (gate, up, down) */
    uint8_t *codes[3], *sf[3]; /* [E, rows, cols/2], [E, rows, cols/16] */
    float *alpha[3];           /* [E] */
    float *in_scale[3];        /* [E] (gate and up share the x scale) */
} demo_model;

static void demo_model_free(demo_model *m) {
    free(m->w13), free(m->w2), free(m->norm);
    for (int p = 0; p < 3; p++)
        free(m->codes[p]), free(m->sf[p]), free(m->alpha[p]), free(m->in_scale[p]);
}

static int demo_model_build(demo_model *m, uint64_t seed) {
    const size_t E = (size_t)m->E, H = (size_t)m->H, I = (size_t)m->I;
    cli_rng r = {seed};
    m->w13 = malloc(E * 2 * I * H * 2);
    m->w2 = malloc(E * H * I * 2);
    m->norm = malloc(H * sizeof(float));
    for (int p = 0; p < 3; p++) {
        const size_t n = p == 2 ? H * I : I * H;
        m->codes[p] = malloc(E * n / 2);
        m->sf[p] = malloc(E * n / 16);
        m->alpha[p] = malloc(E * sizeof(float));
        m->in_scale[p] = malloc(E * sizeof(float));
        if (!m->codes[p] || !m->sf[p] || !m->alpha[p] || !m->in_scale[p]) return cli_fail("out of memory");
    }
    if (!m->w13 || !m->w2 || !m->norm) return cli_fail("out of memory");
    for (size_t i = 0; i < E * 2 * I * H; i++)
        m->w13[i] = cli_f32_to_bf16((float)(cli_rng_normal(&r) / sqrt((double)H)));
    for (size_t i = 0; i < E * H * I; i++)
        m->w2[i] = cli_f32_to_bf16((float)(cli_rng_normal(&r) / sqrt((double)I)));
    for (size_t h = 0; h < H; h++)
        m->norm[h] = (float)(1.0 + 0.1 * cli_rng_normal(&r));
    for (size_t e = 0; e < E; e++) {
        for (int p = 0; p < 3; p++) {
            const size_t rows = p == 2 ? H : I, cols = p == 2 ? I : H;
            const uint16_t *w = p == 2 ? m->w2 + e * H * I : m->w13 + e * 2 * I * H + (size_t)p * I * H;
            megamoe_status st =
                megamoe_quantize_nvfp4(w, (int64_t)rows, (int64_t)cols, m->codes[p] + e * rows * cols / 2,
                                       m->sf[p] + e * rows * cols / 16, &m->alpha[p][e]);
            if (st) return cli_fail("quantize: %s", megamoe_status_string(st));
        }
        float xa, aa;
        megamoe_status st =
            megamoe_calibrate_expert_bf16(m->w13 + e * 2 * I * H, m->H, m->I, 64, seed + e, 0.0f, &xa, &aa);
        if (st) return cli_fail("calibrate: %s", megamoe_status_string(st));
        m->in_scale[0][e] = m->in_scale[1][e] = xa / 2688.0f;
        m->in_scale[2][e] = aa > 0.0f ? aa / 2688.0f : 1.0f;
    }
    return 0;
}

/* Loads the demo model into a layer, per expert, through the public loading API. */
static int demo_model_load(const demo_model *m, megamoe_layer *layer, megamoe_weight_format fmt) {
    const int64_t H = m->H, I = m->I;
    for (int e = 0; e < m->E; e++) {
        for (int p = 0; p < 3; p++) {
            const int64_t rows = p == 2 ? H : I, cols = p == 2 ? I : H;
            megamoe_status st;
            if (fmt == MEGAMOE_FORMAT_BF16) {
                const uint16_t *w =
                    p == 2 ? m->w2 + (size_t)e * H * I : m->w13 + (size_t)e * 2 * I * H + (size_t)p * I * H;
                megamoe_tensor t = {MEGAMOE_DTYPE_BF16, 2, {rows, cols}, w};
                st = megamoe_layer_load_expert_weight(layer, e, (megamoe_proj)p, MEGAMOE_FIELD_WEIGHT, &t);
            } else {
                megamoe_tensor codes = {
                    MEGAMOE_DTYPE_U8, 2, {rows, cols / 2}, m->codes[p] + (size_t)e * rows * cols / 2};
                megamoe_tensor sf = {
                    MEGAMOE_DTYPE_F8_E4M3, 2, {rows, cols / 16}, m->sf[p] + (size_t)e * rows * cols / 16};
                megamoe_tensor alpha = {MEGAMOE_DTYPE_F32, 0, {0}, &m->alpha[p][e]};
                megamoe_tensor in = {MEGAMOE_DTYPE_F32, 0, {0}, &m->in_scale[p][e]};
                st =
                    megamoe_layer_load_expert_weight(layer, e, (megamoe_proj)p, MEGAMOE_FIELD_WEIGHT, &codes);
                if (!st)
                    st = megamoe_layer_load_expert_weight(layer, e, (megamoe_proj)p,
                                                          MEGAMOE_FIELD_WEIGHT_SCALE, &sf);
                if (!st)
                    st = megamoe_layer_load_expert_weight(layer, e, (megamoe_proj)p,
                                                          MEGAMOE_FIELD_WEIGHT_SCALE_2, &alpha);
                if (!st)
                    st = megamoe_layer_load_expert_weight(layer, e, (megamoe_proj)p,
                                                          MEGAMOE_FIELD_INPUT_SCALE, &in);
            }
            if (st) return cli_fail("%s", megamoe_layer_last_error(layer));
        }
    }
    megamoe_tensor norm = {MEGAMOE_DTYPE_F32, 1, {H}, m->norm};
    megamoe_status st = megamoe_layer_load_norm_weight(layer, &norm);
    if (!st) st = megamoe_layer_finalize(layer);
    if (st) return cli_fail("%s", megamoe_layer_last_error(layer));
    return 0;
}

static const char k_demo_help[] =
    "usage: megamoe demo [--backend auto|cpu|cuda] [--tokens T] [--threads N] [--seed S]\n"
    "                    [--activations bf16|nvfp4]\n"
    "\n"
    "Builds an embedded MoE layer (E=32 experts, top-4, H=1024, I=512) from seeded random BF16\n"
    "weights, quantizes it to NVFP4, runs BF16 and NVFP4 (with both activation modes: bf16, the\n"
    "W4A16 default, and nvfp4, SPEC §3b; --activations runs only that one) with 1 and 4\n"
    "expert-parallel ranks and checks the results: ranks must not change y (bitwise), a device\n"
    "backend must match the CPU reference, and NVFP4 must stay near BF16 (with bf16 activations\n"
    "nearer than with nvfp4). Runs on the GPU when there is one (auto), else on the CPU.\n";

int cmd_demo(int argc, char **argv) {
    static const struct option opts[] = {{"backend", required_argument, 0, 'b'},
                                         {"tokens", required_argument, 0, 'T'},
                                         {"threads", required_argument, 0, 't'},
                                         {"seed", required_argument, 0, 's'},
                                         {"activations", required_argument, 0, 'a'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int T = 256, threads = 0, c, activations = -1;
    uint64_t seed = 2026;
    const char *backend_name = "auto";
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int ok = 1;
        switch (c) {
        case 'b': backend_name = optarg; break;
        case 'T': ok = cli_parse_int(optarg, &T) && T >= 1; break;
        case 't': ok = cli_parse_int(optarg, &threads) && threads >= 0; break;
        case 's': ok = cli_parse_u64(optarg, &seed); break;
        case 'a': ok = cli_parse_activations(optarg, &activations); break;
        case 'h': fputs(k_demo_help, stdout); return 0;
        default: fputs(k_demo_help, stderr); return 2;
        }
        if (!ok) return cli_fail("demo: bad value '%s' (see megamoe demo --help)", optarg);
    }
    megamoe_backend backend;
    if (!cli_parse_backend(backend_name, 1, &backend))
        return cli_fail("demo: --backend must be auto, cpu or cuda");
    if (backend == MEGAMOE_BACKEND_CUDA && !megamoe_backend_available(MEGAMOE_BACKEND_CUDA))
        return cli_fail(
            "demo: --backend cuda: no usable CUDA device (sm_90) or this build has no CUDA backend");

    demo_model m = {.E = 32, .K = 4, .H = 1024, .I = 512};
    printf("megamoe %s demo: E=%d experts, top-%d, H=%d, I=%d, %d tokens, backend %s\n",
           megamoe_version_string(), m.E, m.K, m.H, m.I, T, backend == MEGAMOE_BACKEND_CUDA ? "cuda" : "cpu");
    printf("  weights: seeded random BF16, quantized to NVFP4 (global + E4M3 block scales, calibrated input "
           "scales)\n");
    fflush(stdout);
    int rc = demo_model_build(&m, seed);
    const size_t xn = (size_t)T * (size_t)m.H;
    uint16_t *x = malloc(xn * 2), *y[3][3] = {{0}}, *ref[3] = {0};
    int32_t *ids = malloc((size_t)T * m.K * sizeof *ids);
    float *w = malloc((size_t)T * m.K * sizeof *w);
    if (!rc && (!x || !ids || !w)) rc = cli_fail("out of memory");
    if (!rc) {
        cli_rng r = {seed ^ 0xABCDEFull};
        for (size_t i = 0; i < xn; i++)
            x[i] = cli_f32_to_bf16((float)cli_rng_normal(&r));
        cli_random_routing(&r, T, m.K, m.E, ids, w);
    }
    const double flop = 6.0 * m.H * m.I * (double)T * m.K;
    const int gpu = backend == MEGAMOE_BACKEND_CUDA;
    printf("  %-11s %-7s %-6s %-13s %-10s %s\n", "format", "backend", "ranks", "ms/forward", "GFLOP/s",
           "check");
    /* Modes: BF16 weights; NVFP4 weights with bf16 activations (W4A16); NVFP4 with nvfp4 ones. */
    const megamoe_weight_format mode_format[3] = {MEGAMOE_FORMAT_BF16, MEGAMOE_FORMAT_NVFP4,
                                                  MEGAMOE_FORMAT_NVFP4};
    const megamoe_activations mode_act[3] = {MEGAMOE_ACTIVATIONS_BF16, MEGAMOE_ACTIVATIONS_BF16,
                                             MEGAMOE_ACTIVATIONS_NVFP4};
    const char *mode_name[3] = {"bf16", "nvfp4/bf16", "nvfp4/nvfp4"};
    for (int f = 0; f < 3 && !rc; f++) {
        if (f > 0 && activations >= 0 && (int)mode_act[f] != activations) continue;
        const megamoe_weight_format fmt = mode_format[f];
        /* Runs: the CPU reference with 1 rank, then the chosen backend with 1 and 4 ranks. */
        const megamoe_backend run_backend[3] = {MEGAMOE_BACKEND_CPU, backend, backend};
        const int run_ranks[3] = {1, 1, 4};
        for (int ri = gpu ? 0 : 1; ri < 3 && !rc; ri++) {
            const int R = run_ranks[ri];
            megamoe_layer_config cfg;
            megamoe_layer_config_init(&cfg);
            cfg.name = "demo";
            cfg.num_experts = m.E, cfg.top_k = m.K, cfg.hidden_size = m.H, cfg.intermediate_size = m.I;
            cfg.max_tokens = (T + R - 1) / R, cfg.format = fmt, cfg.activations = mode_act[f];
            cli_layer L;
            if ((rc = cli_layer_create(run_backend[ri], R, threads, &cfg, &L)) != 0) break;
            rc = demo_model_load(&m, L.layer, fmt);
            y[f][ri] = malloc(xn * 2);
            double best = 1e30;
            if (!rc && run_backend[ri] == MEGAMOE_BACKEND_CUDA) {
                double ms = 0;
                if (cli_forward_split_device(&L, T, m.K, m.H, x, ids, w, NULL, y[f][ri], 10, &ms))
                    rc = cli_fail("%s", megamoe_layer_last_error(L.layer));
                best = ms * 1e-3;
            }
            for (int it = 0; it < 3 && !rc && run_backend[ri] == MEGAMOE_BACKEND_CPU; it++) {
                for (size_t i = 0; i < xn; i++)
                    y[f][ri][i] = 0xFFFF; /* poison: NaN pattern */
                const double t0 = cli_now_seconds();
                megamoe_status st = cli_forward_split(&L, T, m.K, m.H, x, ids, w, NULL, y[f][ri]);
                const double dt = cli_now_seconds() - t0;
                if (st) rc = cli_fail("%s", megamoe_layer_last_error(L.layer));
                if (dt < best) best = dt;
            }
            cli_layer_destroy(&L);
            if (rc) break;
            for (size_t i = 0; i < xn && !rc; i++)
                if (y[f][ri][i] == 0xFFFF) rc = cli_fail("demo: output element %zu was not written", i);
            char check[128] = "reference";
            if (ri == 2) {
                const int same = memcmp(y[f][1], y[f][2], xn * 2) == 0;
                snprintf(check, sizeof check, "bitwise equal to 1 rank: %s", same ? "yes" : "NO");
                if (!same) rc = 1;
            } else if (ri == 1 && gpu) {
                /* test_gpu.c's bounds: 1e-3, and 2e-3 for NVFP4 weights with bf16 activations */
                const double err = cli_rel_l2_bf16(y[f][1], y[f][0], xn), tol = f == 1 ? 2e-3 : 1e-3;
                snprintf(check, sizeof check, "relative L2 vs CPU %.2e", err);
                if (!(err <= tol)) rc = cli_fail("demo: GPU differs from the CPU reference (%.3e)", err);
            }
            printf("  %-11s %-7s %-6d %-13.3f %-10.1f %s\n", mode_name[f],
                   run_backend[ri] == MEGAMOE_BACKEND_CUDA ? "cuda" : "cpu", R, best * 1e3, flop / best / 1e9,
                   check);
            fflush(stdout);
        }
        ref[f] = y[f][1];
    }
    double err[3] = {0, -1, -1};
    for (int f = 1; f < 3 && !rc; f++) {
        if (!ref[f]) continue;
        err[f] = cli_rel_l2_bf16(ref[f], ref[0], xn);
        printf("  %s vs BF16 output: relative L2 %.4f (the quantization error of the weights%s)\n",
               mode_name[f], err[f], f == 2 ? " and activations" : "");
        if (!(err[f] < 0.35))
            rc = cli_fail("demo: %s output is too far from BF16 (%.4f)", mode_name[f], err[f]);
    }
    if (!rc && err[1] >= 0 && err[2] >= 0 && !(err[1] < err[2]))
        rc = cli_fail("demo: bf16 activations (%.4f) are not closer to BF16 than nvfp4 ones (%.4f)", err[1],
                      err[2]);
    printf(rc ? "FAILED\n" : "OK\n");
    for (int f = 0; f < 3; f++)
        free(y[f][0]), free(y[f][1]), free(y[f][2]);
    free(x), free(ids), free(w);
    demo_model_free(&m);
    return rc;
}

/* ---- bench ---------------------------------------------------------------------------------- */

static const char k_bench_help[] =
    "usage: megamoe bench [--experts E] [--top-k K] [--hidden H] [--inter I] [--tokens T[,T...]]\n"
    "                     [--format nvfp4|bf16] [--ranks R] [--backend cpu|cuda] [--threads N]\n"
    "                     [--iters N] [--seed S] [--gpus N] [--gemm auto|mma|wgmma|stream|ws|ws64]\n"
    "                     [--peak-tflops P] [--activations bf16|nvfp4]\n"
    "\n"
    "Times the forward of a layer with random weights and random routing (defaults: the demo's\n"
    "shape, E=32 K=4 H=1024 I=512, T=256, NVFP4). Several token counts reuse one layer. Prints per\n"
    "T the median time per forward (CUDA events on the GPU), the arithmetic rate 6*H*I*T*K/time,\n"
    "and the bytes of the experts touched per second. On the GPU also both as fractions of their\n"
    "ceilings: the device's copy bandwidth (measured at start: a 512 MB device-to-device copy, read +\n"
    "written bytes) and its bf16 matrix-product peak (--peak-tflops).\n"
    "\n"
    "  --gpus N   expert parallelism over N GPUs of this machine, one NCCL rank each: E/N experts\n"
    "             per GPU, and each T is the tokens of every rank (the group runs N*T). Prints the\n"
    "             slowest rank's median, and the activations and expert outputs that cross NVLink.\n"
    "  --gemm K   the GPU's expert GEMM kernel: auto (default: chosen per forward from the token\n"
    "             count), mma (mma.sync, split-K), wgmma (warpgroup MMA), stream (the NVFP4\n"
    "             streaming kernel for few tokens per expert; BF16 layers take mma), ws (the\n"
    "             warp-specialized warpgroup-MMA kernel for many tokens per expert) or ws64 (the same\n"
    "             on 64-token blocks; auto takes it for BF16 from 4 tokens per expert, and for NVFP4\n"
    "             above 16 per expert when H and I are both 4096 or more).\n"
    "  --activations A  an NVFP4 layer's activations: bf16 (default; W4A16, unquantized) or nvfp4\n"
    "             (quantized per token, SPEC §3b); a BF16 layer takes bf16 only.\n"
    "  --peak-tflops P  the bf16 peak the arithmetic rate is reported against (default 795: an\n"
    "             8192^3 bf16 product with cuBLAS on an H200, measured).\n"
    "\n"
    "On the GPU each forward is a CUDA-graph replay after writing 256 MB (more than L2 holds), so\n"
    "no weights or inputs are served from L2. For diagnosis only, MEGAMOE_BENCH_FLUSH_MB=M writes\n"
    "M MB instead (0: no flush); the recorded benchmarks use the default.\n";

/* Fills n bytes fast from a seed: xorshift64*, 8 bytes a step, each 1 MB chunk from its own seed so
 * the chunks fill in parallel (OpenMP) with the same bytes on any thread count. */
static void fill_random(uint8_t *p, size_t n, uint64_t seed) {
    const size_t chunk = (size_t)1 << 20, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < chunks; c++) {
        uint64_t x = (seed + c * 0x632BE59BD9B4E019ull) * 0x9E3779B97F4A7C15ull + 1;
        const size_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        size_t i = c * chunk;
        for (; i + 8 <= end; i += 8) {
            x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
            const uint64_t v = x * 0x2545F4914F6CDD1Dull;
            memcpy(p + i, &v, 8);
        }
        for (; i < end; i++)
            p[i] = (uint8_t)(i * 131 + seed);
    }
}

/* Random stacked weights: any code byte, block scales in a moderate range, bf16 ~ N(0, 0.02). */
static int bench_load(megamoe_layer *layer, const megamoe_layer_config *c, uint64_t seed) {
    const int64_t E = c->num_experts, H = c->hidden_size, I = c->intermediate_size;
    const int nvfp4 = c->format == MEGAMOE_FORMAT_NVFP4;
    const char *names[4] = {"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"};
    const int64_t shapes[4][3] = {
        {E, 2 * I, nvfp4 ? H / 2 : H}, {E, H, nvfp4 ? I / 2 : I}, {E, 2 * I, H / 16}, {E, H, I / 16}};
    for (int i = 0; i < (nvfp4 ? 4 : 2); i++) {
        megamoe_tensor t = {i >= 2  ? MEGAMOE_DTYPE_F8_E4M3
                            : nvfp4 ? MEGAMOE_DTYPE_U8
                                    : MEGAMOE_DTYPE_BF16,
                            3,
                            {shapes[i][0], shapes[i][1], shapes[i][2]},
                            NULL};
        const size_t n = (size_t)megamoe_tensor_numel(&t), bytes = n * megamoe_dtype_size(t.dtype);
        uint8_t *buf = malloc(bytes);
        if (!buf) return cli_fail("out of memory for %s", names[i]);
        fill_random(buf, bytes, seed + (uint64_t)i);
        if (i >= 2) {
#pragma omp parallel for schedule(static)
            for (size_t j = 0; j < n; j++)
                buf[j] = (uint8_t)(0x30 + (buf[j] & 15));
        } else if (!nvfp4) {
            uint16_t *w = (uint16_t *)buf;
#pragma omp parallel for schedule(static)
            for (size_t j = 0; j < n; j++) /* bf16 with exponent 2^-7..2^-6: |w| ~ 0.01 */
                w[j] = (uint16_t)((w[j] & 0x807F) | 0x3C00);
        }
        t.data = buf;
        const megamoe_status st = megamoe_layer_load_weight(layer, names[i], &t);
        free(buf);
        if (st) return cli_fail("%s", megamoe_layer_last_error(layer));
    }
    if (nvfp4) {
        float *s2 = malloc((size_t)E * 2 * sizeof *s2);
        if (!s2) return cli_fail("out of memory");
        for (int64_t i = 0; i < 2 * E; i++)
            s2[i] = 1.0f / 64.0f;
        megamoe_tensor a13 = {MEGAMOE_DTYPE_F32, 2, {E, 2}, s2}, a2 = {MEGAMOE_DTYPE_F32, 1, {E}, s2};
        int bad = megamoe_layer_load_weight(layer, "w13_weight_scale_2", &a13) ||
                  megamoe_layer_load_weight(layer, "w2_weight_scale_2", &a2) ||
                  megamoe_layer_load_weight(layer, "w2_input_scale", &a2);
        free(s2);
        if (bad) return cli_fail("%s", megamoe_layer_last_error(layer));
    }
    if (megamoe_layer_finalize(layer)) return cli_fail("%s", megamoe_layer_last_error(layer));
    return 0;
}

int cmd_bench(int argc, char **argv) {
    static const struct option opts[] = {{"experts", required_argument, 0, 'E'},
                                         {"top-k", required_argument, 0, 'K'},
                                         {"hidden", required_argument, 0, 'H'},
                                         {"inter", required_argument, 0, 'I'},
                                         {"tokens", required_argument, 0, 'T'},
                                         {"format", required_argument, 0, 'f'},
                                         {"ranks", required_argument, 0, 'R'},
                                         {"backend", required_argument, 0, 'b'},
                                         {"threads", required_argument, 0, 't'},
                                         {"iters", required_argument, 0, 'n'},
                                         {"seed", required_argument, 0, 's'},
                                         {"gpus", required_argument, 0, 'G'},
                                         {"gemm", required_argument, 0, 'g'},
                                         {"peak-tflops", required_argument, 0, 'P'},
                                         {"activations", required_argument, 0, 'a'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int E = 32, K = 4, H = 1024, I = 512, R = 1, threads = 0, iters = 5, c, nT = 1, gpus = 0, gemm = 0;
    int activations = MEGAMOE_ACTIVATIONS_BF16;
    int Ts[32] = {256};
    uint64_t seed = 1;
    float peak_tflops = 795.0f;
    megamoe_weight_format fmt = MEGAMOE_FORMAT_NVFP4;
    megamoe_backend backend = MEGAMOE_BACKEND_CPU;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int ok = 1;
        switch (c) {
        case 'E': ok = cli_parse_int(optarg, &E); break;
        case 'K': ok = cli_parse_int(optarg, &K); break;
        case 'H': ok = cli_parse_int(optarg, &H); break;
        case 'I': ok = cli_parse_int(optarg, &I); break;
        case 'T': {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", optarg);
            nT = 0;
            for (char *tok = strtok(buf, ","); tok && ok; tok = strtok(NULL, ","))
                ok = nT < 32 && cli_parse_int(tok, &Ts[nT]) && Ts[nT] >= 0 && ++nT;
            ok = ok && nT > 0;
            break;
        }
        case 'R': ok = cli_parse_int(optarg, &R); break;
        case 't': ok = cli_parse_int(optarg, &threads); break;
        case 'n': ok = cli_parse_int(optarg, &iters) && iters >= 1; break;
        case 'G': ok = cli_parse_int(optarg, &gpus) && gpus >= 1; break;
        case 'g':
            gemm = strcmp(optarg, "auto") == 0    ? 0
                   : strcmp(optarg, "mma") == 0   ? 1
                   : strcmp(optarg, "wgmma") == 0 ? 2
                   : strcmp(optarg, "stream") == 0 ? 3
                   : strcmp(optarg, "ws") == 0     ? 4
                   : strcmp(optarg, "ws64") == 0   ? 5
                                                   : -1;
            ok = gemm >= 0;
            break;
        case 's': ok = cli_parse_u64(optarg, &seed); break;
        case 'P': ok = cli_parse_float(optarg, &peak_tflops) && peak_tflops > 0; break;
        case 'a': ok = cli_parse_activations(optarg, &activations); break;
        case 'f':
            if (strcmp(optarg, "nvfp4") == 0)
                fmt = MEGAMOE_FORMAT_NVFP4;
            else if (strcmp(optarg, "bf16") == 0)
                fmt = MEGAMOE_FORMAT_BF16;
            else
                ok = 0;
            break;
        case 'b': ok = cli_parse_backend(optarg, 0, &backend); break;
        case 'h': fputs(k_bench_help, stdout); return 0;
        default: fputs(k_bench_help, stderr); return 2;
        }
        if (!ok) return cli_fail("bench: bad value '%s' (see megamoe bench --help)", optarg);
    }
    if (backend == MEGAMOE_BACKEND_CUDA && !megamoe_backend_available(MEGAMOE_BACKEND_CUDA))
        return cli_fail(
            "bench: --backend cuda: no usable CUDA device (sm_90) or this build has no CUDA backend");
    int T_max = 1;
    for (int i = 0; i < nT; i++)
        T_max = Ts[i] > T_max ? Ts[i] : T_max;
    megamoe_layer_config cfg;
    megamoe_layer_config_init(&cfg);
    cfg.name = "bench";
    cfg.num_experts = E, cfg.top_k = K, cfg.hidden_size = H, cfg.intermediate_size = I, cfg.format = fmt;
    cfg.activations = (megamoe_activations)activations;
    cfg.gemm_kernel = gemm;
    cfg.max_tokens = R > 0 ? (T_max + R - 1) / R : 1;
    if (gpus > 0) {
        cfg.max_tokens = T_max;
        return cli_bench_gpus(gpus, &cfg, bench_load, seed, Ts, nT, iters);
    }
    cli_layer L;
    int rc = cli_layer_create(backend, R, threads, &cfg, &L);
    if (!rc) rc = bench_load(L.layer, &cfg, seed);
    const int nvfp4 = fmt == MEGAMOE_FORMAT_NVFP4;
    const double copy_gbps = !rc && backend == MEGAMOE_BACKEND_CUDA ? cli_device_copy_gbps() : 0.0;
    if (copy_gbps > 0) printf("bench: device copy bandwidth %.0f GB/s (read + written), bf16 peak %.0f TFLOP/s\n", copy_gbps, peak_tflops);
    const double expert_bytes = nvfp4 ? 3.0 * H * I * (0.5 + 1.0 / 16) : 3.0 * H * I * 2;
    for (int ti = 0; ti < nT && !rc; ti++) {
        const int T = Ts[ti];
        const size_t xn = (size_t)T * H;
        uint16_t *x = malloc(xn * 2 + 2), *y = malloc(xn * 2 + 2);
        int32_t *ids = malloc((size_t)T * K * 4 + 4);
        float *w = malloc((size_t)T * K * 4 + 4);
        double *times = calloc((size_t)iters, sizeof *times);
        cli_rng r = {seed + (uint64_t)T};
        if (!x || !y || !ids || !w || !times) rc = cli_fail("out of memory");
        if (!rc) {
            for (size_t i = 0; i < xn; i++)
                x[i] = cli_f32_to_bf16((float)cli_rng_normal(&r));
            cli_random_routing(&r, T, K, E, ids, w);
        }
        double med = 0;
        if (!rc && backend == MEGAMOE_BACKEND_CUDA) {
            if (cli_forward_split_device(&L, T, K, H, x, ids, w, NULL, y, iters, &med))
                rc = cli_fail("%s", megamoe_layer_last_error(L.layer));
            med *= 1e-3;
        } else if (!rc) {
            for (int it = -1; it < iters && !rc; it++) { /* one warm-up */
                const double t0 = cli_now_seconds();
                if (cli_forward_split(&L, T, K, H, x, ids, w, NULL, y))
                    rc = cli_fail("%s", megamoe_layer_last_error(L.layer));
                if (it >= 0) times[it] = cli_now_seconds() - t0;
            }
            for (int i = 1; i < iters; i++)
                for (int j = i; j > 0 && times[j] < times[j - 1]; j--) {
                    double tmp = times[j];
                    times[j] = times[j - 1], times[j - 1] = tmp;
                }
            med = times[iters / 2];
        }
        if (!rc) {
            int touched = 0;
            char *used = calloc((size_t)E, 1);
            for (size_t i = 0; used && i < (size_t)T * K; i++)
                used[ids[i]] = 1;
            for (int e = 0; used && e < E; e++)
                touched += used[e];
            free(used);
            const double tflops = 6.0 * H * I * (double)T * K / med / 1e12, gbps = expert_bytes * touched / med / 1e9;
            char frac[96] = "";
            if (copy_gbps > 0)
                snprintf(frac, sizeof frac, " [%.0f%% of copy, %.1f%% of bf16 peak]", 100.0 * gbps / copy_gbps,
                         100.0 * tflops / peak_tflops);
            printf(
                "bench: E=%d K=%d H=%d I=%d T=%d %s%s R=%d backend=%s: median %.4f ms over %d, %.1f TFLOP/s, "
                "%.1f GB/s of touched expert weights (%d experts)%s\n",
                E, K, H, I, T, nvfp4 ? "nvfp4" : "bf16",
                nvfp4 ? (cfg.activations == MEGAMOE_ACTIVATIONS_NVFP4 ? " act=nvfp4" : " act=bf16") : "", R,
                backend == MEGAMOE_BACKEND_CUDA ? "cuda" : "cpu", med * 1e3, iters, tflops, gbps, touched,
                frac);
            fflush(stdout);
        }
        free(times), free(x), free(y), free(ids), free(w);
    }
    cli_layer_destroy(&L);
    return rc;
}
