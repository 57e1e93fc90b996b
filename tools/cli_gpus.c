/*
 * cli_gpus.c -- `megamoe run --gpus N`: one process, N GPUs, one NCCL rank per GPU. The
 * communicators come from ncclCommInitAll; each rank runs in its own thread (layer creation and
 * destruction are collective across the ranks), with its contiguous chunk of the tokens.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#ifdef MEGAMOE_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

/* What every per-GPU job starts with: its rank, its communicator and its error message. */
typedef struct rank_job {
    int rank;
    ncclComm_t comm;
    char error[1024];
} rank_job;

static int gpus_visible(const char *cmd, int gpus) {
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess || visible < gpus)
        return cli_fail("%s: --gpus %d, but %d GPU%s visible", cmd, gpus, visible, visible == 1 ? " is" : "s are");
    return 0;
}

/* Runs fn on GPUs 0..gpus-1, one thread and one NCCL rank (ncclCommInitAll) each. jobs: gpus structs of
 * `stride` bytes, each beginning with a rank_job, filled by the caller but for rank and comm. Returns 0,
 * or the exit code of the first failure (its message printed). */
static int on_gpus(const char *cmd, int gpus, void *jobs, size_t stride, void *(*fn)(void *)) {
    ncclComm_t *comms = calloc((size_t)gpus, sizeof *comms);
    pthread_t *threads = calloc((size_t)gpus, sizeof *threads);
    int *devs = calloc((size_t)gpus, sizeof *devs), *started = calloc((size_t)gpus, sizeof *started);
    int rc = 0;
    if (!comms || !threads || !devs || !started) rc = cli_fail("out of memory");
    for (int i = 0; i < gpus && !rc; i++)
        devs[i] = i;
    if (!rc && ncclCommInitAll(comms, gpus, devs) != ncclSuccess) rc = cli_fail("%s: ncclCommInitAll failed", cmd);
    for (int i = 0; i < gpus && !rc; i++) {
        rank_job *j = (rank_job *)((char *)jobs + (size_t)i * stride);
        j->rank = i;
        j->comm = comms[i];
        if (pthread_create(&threads[i], NULL, fn, j) != 0)
            rc = cli_fail("%s: cannot start a thread", cmd);
        else
            started[i] = 1;
    }
    for (int i = 0; i < gpus && started; i++) {
        const rank_job *j = (const rank_job *)((const char *)jobs + (size_t)i * stride);
        if (started[i]) pthread_join(threads[i], NULL);
        if (j->error[0] && !rc) rc = cli_fail("%s", j->error);
    }
    for (int i = 0; i < gpus && comms; i++)
        if (comms[i]) ncclCommDestroy(comms[i]);
    free(comms), free(threads), free(devs), free(started);
    return rc;
}

typedef struct gpu_job {
    rank_job r; /* first: on_gpus fills rank and comm */
    int T, K, H;
    const megamoe_layer_config *cfg;
    megamoe_checkpoint *ck;
    const char *prefix;
    const uint16_t *x;
    const int32_t *ids;
    const float *w;
    const uint8_t *pad;
    uint16_t *y;
} gpu_job;

/* The group of GPU `rank` (its thread's device) on communicator `comm` and a layer on it; on failure
 * `error` gets the message. Collective: every rank's thread calls it. */
static megamoe_status rank_layer(int rank, ncclComm_t comm, const megamoe_layer_config *cfg, cli_layer *L,
                                 char *error, size_t error_size) {
    cudaSetDevice(rank);
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.backend = MEGAMOE_BACKEND_NCCL;
    gc.device = rank;
    gc.nccl_comm = comm;
    megamoe_status st = megamoe_group_create(&gc, &L->group);
    if (st) snprintf(error, error_size, "GPU %d: %s", rank, megamoe_group_last_error(L->group));
    if (!st && (st = megamoe_layer_create(L->group, cfg, &L->layer)) != MEGAMOE_OK)
        snprintf(error, error_size, "GPU %d: %s", rank, megamoe_layer_last_error(L->layer));
    return st;
}

static void *gpu_main(void *arg) {
    gpu_job *j = arg;
    cli_layer L = {0};
    megamoe_status st = rank_layer(j->r.rank, j->r.comm, j->cfg, &L, j->r.error, sizeof j->r.error);
    if (!st)
        st = megamoe_layer_load_checkpoint(L.layer, j->ck, j->prefix, j->r.rank == 0 ? cli_progress : NULL,
                                           NULL);
    if (!st) st = megamoe_layer_finalize(L.layer);
    if (!st) st = cli_forward_split_device(&L, j->T, j->K, j->H, j->x, j->ids, j->w, j->pad, j->y, 0, NULL);
    if (st && !j->r.error[0])
        snprintf(j->r.error, sizeof j->r.error, "GPU %d: %s: %s", j->r.rank, megamoe_status_string(st),
                 megamoe_layer_last_error(L.layer));
    cli_layer_destroy(&L);
    return NULL;
}

int cli_run_gpus(int gpus, const megamoe_layer_config *cfg, megamoe_checkpoint *ck, const char *prefix, int T,
                 int K, int H, const uint16_t *x, const int32_t *ids, const float *w, const uint8_t *pad,
                 uint16_t *y) {
    if (gpus_visible("run", gpus)) return 1;
    gpu_job *jobs = calloc((size_t)gpus, sizeof *jobs);
    if (!jobs) return cli_fail("out of memory");
    const int chunk = (T + gpus - 1) / gpus;
    for (int i = 0; i < gpus; i++) {
        const int t0 = i * chunk < T ? i * chunk : T, t1 = t0 + chunk < T ? t0 + chunk : T;
        jobs[i] = (gpu_job){{0},
                            t1 - t0,
                            K,
                            H,
                            cfg,
                            ck,
                            prefix,
                            x + (size_t)t0 * H,
                            ids + (size_t)t0 * K,
                            w + (size_t)t0 * K,
                            pad ? pad + t0 : NULL,
                            y + (size_t)t0 * H};
    }
    const int rc = on_gpus("run", gpus, jobs, sizeof *jobs, gpu_main);
    free(jobs);
    return rc;
}

/* ---- bench --gpus ------------------------------------------------------------------------------ */

typedef struct bench_job {
    rank_job r; /* first: on_gpus fills rank and comm */
    int gpus, nT, iters;
    const int *Ts;
    uint64_t seed;
    const megamoe_layer_config *cfg;
    cli_bench_loader load;
    double *ms;          /* [nT] median per forward on this rank */
    double *remote_frac; /* [nT] share of this rank's slots routed to another rank */
    char *used;          /* [nT][E] 1 where one of this rank's tokens went to the expert */
} bench_job;

static void *bench_main(void *arg) {
    bench_job *j = arg;
    cli_layer L = {0};
    megamoe_layer_config lc = *j->cfg;
    lc.timeout_ms = 120000; /* the ranks make their random inputs on the host at different speeds */
    const megamoe_layer_config *c = &lc;
    const int K = c->top_k, H = c->hidden_size, E = c->num_experts, E_r = E / j->gpus;
    megamoe_status st = rank_layer(j->r.rank, j->r.comm, c, &L, j->r.error, sizeof j->r.error);
    if (!st && j->load(L.layer, c, j->seed)) {
        snprintf(j->r.error, sizeof j->r.error, "GPU %d: loading the random weights failed", j->r.rank);
        st = MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    for (int ti = 0; ti < j->nT && !st; ti++) {
        const int T = j->Ts[ti];
        const size_t xn = (size_t)T * H;
        uint16_t *x = malloc(xn * 2 + 2), *y = malloc(xn * 2 + 2);
        int32_t *ids = malloc((size_t)T * K * 4 + 4);
        float *w = malloc((size_t)T * K * 4 + 4);
        char *used = j->used + (size_t)ti * E;
        cli_rng r = {j->seed + (uint64_t)T * 7919u + (uint64_t)j->r.rank * 104729u};
        if (!x || !y || !ids || !w) {
            snprintf(j->r.error, sizeof j->r.error, "GPU %d: out of host memory", j->r.rank);
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
        } else {
            for (size_t i = 0; i < xn; i++)
                x[i] = cli_f32_to_bf16((float)cli_rng_normal(&r));
            cli_random_routing(&r, T, K, E, ids, w);
            st = cli_forward_split_device(&L, T, K, H, x, ids, w, NULL, y, j->iters, &j->ms[ti]);
            if (st)
                snprintf(j->r.error, sizeof j->r.error, "GPU %d: %s: %s", j->r.rank, megamoe_status_string(st),
                         megamoe_layer_last_error(L.layer));
            long remote = 0;
            for (size_t i = 0; i < (size_t)T * K; i++) {
                remote += ids[i] / E_r != j->r.rank;
                used[ids[i]] = 1;
            }
            j->remote_frac[ti] = T > 0 ? (double)remote / ((double)T * K) : 0.0;
        }
        free(x), free(y), free(ids), free(w);
    }
    cli_layer_destroy(&L);
    return NULL;
}

int cli_bench_gpus(int gpus, const megamoe_layer_config *cfg, cli_bench_loader load, uint64_t seed, const int *Ts,
                   int nT, int iters) {
    if (gpus_visible("bench", gpus)) return 1;
    if (cfg->num_experts % gpus != 0)
        return cli_fail("bench: --experts %d is not a multiple of --gpus %d", cfg->num_experts, gpus);
    bench_job *jobs = calloc((size_t)gpus, sizeof *jobs);
    double *ms = calloc((size_t)gpus * nT * 2, sizeof *ms);
    char *used = calloc((size_t)gpus * nT * cfg->num_experts, 1);
    int rc = 0;
    if (!jobs || !ms || !used) rc = cli_fail("out of memory");
    for (int i = 0; i < gpus && !rc; i++)
        jobs[i] = (bench_job){{0}, gpus, nT, iters, Ts, seed, cfg, load, ms + (size_t)i * nT,
                              ms + (size_t)(gpus + i) * nT, used + (size_t)i * nT * cfg->num_experts};
    if (!rc) {
        fprintf(stderr, "bench: loading random weights on %d GPUs...\n", gpus);
        rc = on_gpus("bench", gpus, jobs, sizeof *jobs, bench_main);
    }
    const int H = cfg->hidden_size, I = cfg->intermediate_size, K = cfg->top_k;
    const int nvfp4 = cfg->format == MEGAMOE_FORMAT_NVFP4;
    for (int ti = 0; ti < nT && !rc; ti++) {
        double worst = 0, remote = 0;
        int touched = 0;
        for (int e = 0; e < cfg->num_experts; e++) {
            int any = 0;
            for (int i = 0; i < gpus; i++)
                any |= used[((size_t)i * nT + ti) * cfg->num_experts + e];
            touched += any;
        }
        for (int i = 0; i < gpus; i++) {
            worst = ms[(size_t)i * nT + ti] > worst ? ms[(size_t)i * nT + ti] : worst;
            remote += ms[(size_t)(gpus + i) * nT + ti] / gpus;
        }
        const double sec = worst * 1e-3, slots = (double)Ts[ti] * K * gpus;
        /* What crosses NVLink at the least: each remote slot's activation row once (NVFP4 codes and
         * scales with NVFP4 activations, else bf16) and its fp32 expert output p once. */
        const int qx = nvfp4 && cfg->activations == MEGAMOE_ACTIVATIONS_NVFP4;
        const double xbytes = qx ? H * (0.5 + 1.0 / 16) : H * 2.0;
        const char *what = !nvfp4 ? "bf16" : qx ? "nvfp4 act=nvfp4" : "nvfp4 act=bf16";
        const double link = slots * remote * (xbytes + 4.0 * H);
        const double expert_bytes = nvfp4 ? 3.0 * H * I * (0.5 + 1.0 / 16) : 3.0 * H * I * 2;
        printf("bench: EP=%d E=%d K=%d H=%d I=%d T/rank=%d %s backend=nccl: %.4f ms per layer (slowest rank's "
               "median over %d), %.1f TFLOP/s, %.0f GB/s of touched expert weights (%d experts, all GPUs), "
               "%.0f%% of slots remote, exchange %.1f GB/s (%.1f MB)\n",
               gpus, cfg->num_experts, K, H, I, Ts[ti], what, worst, iters,
               6.0 * H * I * slots / sec / 1e12, expert_bytes * touched / sec / 1e9, touched, remote * 100,
               link / sec / 1e9, link / 1e6);
        fflush(stdout);
    }
    free(jobs), free(ms), free(used);
    return rc;
}
#else
int cli_run_gpus(int gpus, const megamoe_layer_config *cfg, megamoe_checkpoint *ck, const char *prefix, int T,
                 int K, int H, const uint16_t *x, const int32_t *ids, const float *w, const uint8_t *pad,
                 uint16_t *y) {
    (void)gpus, (void)cfg, (void)ck, (void)prefix, (void)T, (void)K, (void)H, (void)x, (void)ids, (void)w,
        (void)pad, (void)y;
    return cli_fail("run: --gpus needs a build with the NCCL backend (CUDA and NCCL >= 2.28 headers)");
}
int cli_bench_gpus(int gpus, const megamoe_layer_config *cfg, cli_bench_loader load, uint64_t seed, const int *Ts,
                   int nT, int iters) {
    (void)gpus, (void)cfg, (void)load, (void)seed, (void)Ts, (void)nT, (void)iters;
    return cli_fail("bench: --gpus needs a build with the NCCL backend (CUDA and NCCL >= 2.28 headers)");
}
#endif
