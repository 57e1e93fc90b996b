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

typedef struct gpu_job {
    int rank, T, K, H;
    ncclComm_t comm;
    const megamoe_layer_config *cfg;
    megamoe_checkpoint *ck;
    const char *prefix;
    const uint16_t *x;
    const int32_t *ids;
    const float *w;
    const uint8_t *pad;
    uint16_t *y;
    char error[1024];
} gpu_job;

static void *gpu_main(void *arg) {
    gpu_job *j = arg;
    cudaSetDevice(j->rank);
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.backend = MEGAMOE_BACKEND_NCCL;
    gc.device = j->rank;
    gc.nccl_comm = j->comm;
    cli_layer L = {0};
    megamoe_status st = megamoe_group_create(&gc, &L.group);
    if (st) snprintf(j->error, sizeof j->error, "GPU %d: %s", j->rank, megamoe_group_last_error(L.group));
    if (!st && (st = megamoe_layer_create(L.group, j->cfg, &L.layer)) != MEGAMOE_OK)
        snprintf(j->error, sizeof j->error, "GPU %d: %s", j->rank, megamoe_layer_last_error(L.layer));
    if (!st)
        st = megamoe_layer_load_checkpoint(L.layer, j->ck, j->prefix, j->rank == 0 ? cli_progress : NULL,
                                           NULL);
    if (!st) st = megamoe_layer_finalize(L.layer);
    if (!st) st = cli_forward_split_device(&L, j->T, j->K, j->H, j->x, j->ids, j->w, j->pad, j->y, 0, NULL);
    if (st && !j->error[0])
        snprintf(j->error, sizeof j->error, "GPU %d: %s: %s", j->rank, megamoe_status_string(st),
                 megamoe_layer_last_error(L.layer));
    cli_layer_destroy(&L);
    return NULL;
}

int cli_run_gpus(int gpus, const megamoe_layer_config *cfg, megamoe_checkpoint *ck, const char *prefix, int T,
                 int K, int H, const uint16_t *x, const int32_t *ids, const float *w, const uint8_t *pad,
                 uint16_t *y) {
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess || visible < gpus)
        return cli_fail("run: --gpus %d, but %d GPU%s visible", gpus, visible,
                        visible == 1 ? " is" : "s are");
    ncclComm_t *comms = calloc((size_t)gpus, sizeof *comms);
    gpu_job *jobs = calloc((size_t)gpus, sizeof *jobs);
    pthread_t *threads = calloc((size_t)gpus, sizeof *threads);
    int *devs = calloc((size_t)gpus, sizeof *devs);
    int rc = 0;
    if (!comms || !jobs || !threads || !devs) rc = cli_fail("out of memory");
    for (int i = 0; i < gpus && !rc; i++)
        devs[i] = i;
    if (!rc && ncclCommInitAll(comms, gpus, devs) != ncclSuccess)
        rc = cli_fail("run: ncclCommInitAll failed");
    const int chunk = (T + gpus - 1) / gpus;
    for (int i = 0; i < gpus && !rc; i++) {
        const int t0 = i * chunk < T ? i * chunk : T, t1 = t0 + chunk < T ? t0 + chunk : T;
        jobs[i] = (gpu_job){i,
                            t1 - t0,
                            K,
                            H,
                            comms[i],
                            cfg,
                            ck,
                            prefix,
                            x + (size_t)t0 * H,
                            ids + (size_t)t0 * K,
                            w + (size_t)t0 * K,
                            pad ? pad + t0 : NULL,
                            y + (size_t)t0 * H,
                            {0}};
        if (pthread_create(&threads[i], NULL, gpu_main, &jobs[i]) != 0)
            rc = cli_fail("run: cannot start a thread");
    }
    for (int i = 0; i < gpus && comms && comms[0]; i++) {
        if (threads[i]) pthread_join(threads[i], NULL);
        if (jobs[i].error[0] && !rc) rc = cli_fail("%s", jobs[i].error);
    }
    for (int i = 0; i < gpus && comms; i++)
        if (comms[i]) ncclCommDestroy(comms[i]);
    free(comms), free(jobs), free(threads), free(devs);
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
#endif
