/*
 * cmd_bench.c -- `megamoe bench`: times the forward of a layer of random weights.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char k_bench_help[] =
    "usage: megamoe bench [--experts E] [--top-k K] [--hidden H] [--inter I] [--tokens T[,T...]]\n"
    "                     [--format nvfp4|bf16] [--ranks R] [--backend cpu|cuda] [--threads N]\n"
    "                     [--iters N] [--seed S] [--gpus N] [--gemm auto|mma|wgmma|stream|ws|ws64]\n"
    "                     [--peak-tflops P] [--activations bf16|nvfp4] [--json FILE]\n"
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
    "  --json FILE  append one JSON object per T to FILE (JSON Lines), with the keys shape, format,\n"
    "             activations, T, median_ms, min_ms, max_ms, tflops, weight_gbps, pct_copy (null\n"
    "             without a measured copy bandwidth), commit, gpu (\"cpu\" on the CPU), date (UTC) and\n"
    "             source (\"megamoe\"): the records of bench/records.py.\n"
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
                                         {"json", required_argument, 0, 'J'},
                                         {"activations", required_argument, 0, 'a'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int E = 32, K = 4, H = 1024, I = 512, R = 1, threads = 0, iters = 5, c, nT = 1, gpus = 0, gemm = 0;
    int Ts[32] = {256};
    uint64_t seed = 1;
    const char *json_path = NULL;
    int activations = MEGAMOE_ACTIVATIONS_BF16;
    float peak_tflops = 795.0f;
    megamoe_weight_format fmt = MEGAMOE_FORMAT_NVFP4;
    megamoe_backend backend = MEGAMOE_BACKEND_CPU;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int ok = 1;
        const char *want = "an integer >= 1";
        switch (c) {
        case 'E': ok = cli_parse_int(optarg, &E) && E >= 1; break;
        case 'K': ok = cli_parse_int(optarg, &K) && K >= 1; break;
        case 'H': ok = cli_parse_int(optarg, &H) && H >= 1; break;
        case 'I': ok = cli_parse_int(optarg, &I) && I >= 1; break;
        case 'T': {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", optarg);
            want = "up to 32 integers >= 0, separated by commas";
            nT = 0;
            for (char *tok = strtok(buf, ","); tok && ok; tok = strtok(NULL, ","))
                ok = nT < 32 && cli_parse_int(tok, &Ts[nT]) && Ts[nT] >= 0 && ++nT;
            ok = ok && nT > 0;
            break;
        }
        case 'R': want = "an integer in 1..72", ok = cli_parse_int(optarg, &R); break;
        case 't': want = "an integer in 0..1024", ok = cli_parse_int(optarg, &threads); break;
        case 'n': ok = cli_parse_int(optarg, &iters) && iters >= 1; break;
        case 'G': ok = cli_parse_int(optarg, &gpus) && gpus >= 1; break;
        case 'g':
            want = "auto, mma, wgmma, stream, ws or ws64";
            gemm = strcmp(optarg, "auto") == 0    ? 0
                   : strcmp(optarg, "mma") == 0   ? 1
                   : strcmp(optarg, "wgmma") == 0 ? 2
                   : strcmp(optarg, "stream") == 0 ? 3
                   : strcmp(optarg, "ws") == 0     ? 4
                   : strcmp(optarg, "ws64") == 0   ? 5
                                                   : -1;
            ok = gemm >= 0;
            break;
        case 's': want = "an integer in 0..2^64-1", ok = cli_parse_u64(optarg, &seed); break;
        case 'P': want = "a number > 0", ok = cli_parse_float(optarg, &peak_tflops) && peak_tflops > 0; break;
        case 'J': json_path = optarg; break;
        case 'a': want = "bf16 or nvfp4", ok = cli_parse_activations(optarg, &activations); break;
        case 'f':
            want = "nvfp4 or bf16";
            if (strcmp(optarg, "nvfp4") == 0)
                fmt = MEGAMOE_FORMAT_NVFP4;
            else if (strcmp(optarg, "bf16") == 0)
                fmt = MEGAMOE_FORMAT_BF16;
            else
                ok = 0;
            break;
        case 'b': want = "cpu or cuda", ok = cli_parse_backend(optarg, 0, &backend); break;
        case 'h': fputs(k_bench_help, stdout); return 0;
        default: fputs(k_bench_help, stderr); return 2;
        }
        if (!ok) return cli_bad_value("bench", opts, c, optarg, want);
    }
    if (optind < argc) return cli_unexpected("bench", argv[optind], k_bench_help);
    if (cli_check_threads("bench", threads) || (gpus == 0 && cli_check_ranks("bench", R))) return 1;
    if (json_path && gpus > 0) return cli_fail("bench: --json is not written for --gpus runs yet");
    FILE *json = NULL;
    if (json_path && !(json = fopen(json_path, "a")))
        return cli_fail("bench: --json %s: cannot open for appending: %s", json_path, strerror(errno));
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
    char gpu[256] = "cpu";
    if (backend == MEGAMOE_BACKEND_CUDA) cli_device_name(gpu, sizeof gpu);
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
        double med = 0, lo = 0, hi = 0; /* seconds */
        if (!rc && backend == MEGAMOE_BACKEND_CUDA) {
            if (cli_forward_split_device_stats(&L, T, K, H, x, ids, w, NULL, y, iters, &lo, &med, &hi))
                rc = cli_fail("%s", megamoe_layer_last_error(L.layer));
            med *= 1e-3, lo *= 1e-3, hi *= 1e-3;
        } else if (!rc) {
            char what[64];
            snprintf(what, sizeof what, "bench T=%d forwards", T);
            for (int it = -1; it < iters && !rc; it++) { /* one warm-up */
                const double t0 = cli_now_seconds();
                if (cli_forward_split(&L, T, K, H, x, ids, w, NULL, y))
                    rc = cli_fail("%s", megamoe_layer_last_error(L.layer));
                if (it >= 0) times[it] = cli_now_seconds() - t0;
                cli_progress(NULL, what, (uint64_t)(it + 2), (uint64_t)iters + 1);
            }
            for (int i = 1; i < iters; i++)
                for (int j = i; j > 0 && times[j] < times[j - 1]; j--) {
                    double tmp = times[j];
                    times[j] = times[j - 1], times[j - 1] = tmp;
                }
            med = times[iters / 2], lo = times[0], hi = times[iters - 1];
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
            /* Three significant digits below 1 TFLOP/s (a CPU's rate), one decimal above. */
            printf("bench: E=%d K=%d H=%d I=%d T=%d %s%s R=%d backend=%s: median %.4f ms over %d, %.*f TFLOP/s, "
                   "%.1f GB/s of touched expert weights (%d experts)%s\n",
                   E, K, H, I, T, nvfp4 ? "nvfp4" : "bf16",
                   nvfp4 ? (cfg.activations == MEGAMOE_ACTIVATIONS_NVFP4 ? " act=nvfp4" : " act=bf16") : "", R,
                   backend == MEGAMOE_BACKEND_CUDA ? "cuda" : "cpu", med * 1e3, iters, tflops >= 1 || tflops == 0 ? 1 : 2 - (int)floor(log10(tflops)), tflops, gbps,
                   touched, frac);
            fflush(stdout);
            if (json) {
                char shape[96];
                snprintf(shape, sizeof shape, "E=%d K=%d H=%d I=%d", E, K, H, I);
                if (cli_bench_json_record(json, shape, nvfp4 ? "nvfp4" : "bf16", cli_activations_name(&cfg), T,
                                          med * 1e3, lo * 1e3, hi * 1e3, tflops, gbps,
                                          copy_gbps > 0 ? 100.0 * gbps / copy_gbps : -1.0, gpu))
                    rc = cli_fail("bench: --json %s: cannot write: %s", json_path, strerror(errno));
            }
        }
        free(times), free(x), free(y), free(ids), free(w);
    }
    cli_layer_destroy(&L);
    if (json && fclose(json) != 0 && !rc) rc = cli_fail("bench: --json %s: cannot write: %s", json_path, strerror(errno));
    return rc;
}
