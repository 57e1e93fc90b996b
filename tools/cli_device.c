/*
 * cli_device.c -- device memory for the CLI's CUDA runs: inputs uploaded, y downloaded, forwards
 * timed with CUDA events. Built against the CUDA runtime when the library has its CUDA backend.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#ifdef MEGAMOE_HAVE_CUDA
#include <cuda_runtime_api.h>

typedef struct dev_io {
    uint16_t *x, *y;
    int32_t *ids;
    float *w;
    uint8_t *pad;
} dev_io;

static void dev_io_free(dev_io *d) {
    cudaFree(d->x), cudaFree(d->y), cudaFree(d->ids), cudaFree(d->w), cudaFree(d->pad);
}

static int dev_io_upload(dev_io *d, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                         const float *w, const uint8_t *pad) {
    memset(d, 0, sizeof *d);
    const size_t n = (size_t)T;
    if (cudaMalloc((void **)&d->x, n * H * 2 + 16) || cudaMalloc((void **)&d->y, n * H * 2 + 16) ||
        cudaMalloc((void **)&d->ids, n * K * 4 + 16) || cudaMalloc((void **)&d->w, n * K * 4 + 16) ||
        (pad && cudaMalloc((void **)&d->pad, n + 16)))
        return cli_fail("cudaMalloc for the inputs failed");
    if (cudaMemcpy(d->x, x, n * H * 2, cudaMemcpyHostToDevice) ||
        cudaMemcpy(d->ids, ids, n * K * 4, cudaMemcpyHostToDevice) ||
        cudaMemcpy(d->w, w, n * K * 4, cudaMemcpyHostToDevice) ||
        (pad && cudaMemcpy(d->pad, pad, n, cudaMemcpyHostToDevice)) || cudaMemset(d->y, 0xFF, n * H * 2))
        return cli_fail("copying the inputs to the device failed");
    return 0;
}

megamoe_status cli_forward_split_device(cli_layer *c, int T, int K, int H, const uint16_t *x,
                                        const int32_t *ids, const float *w, const uint8_t *pad, uint16_t *y,
                                        int iters, double *ms) {
    return cli_forward_split_device_stats(c, T, K, H, x, ids, w, pad, y, iters, NULL, ms, NULL);
}

void cli_device_name(char *out, size_t n) {
    struct cudaDeviceProp p;
    int dev = 0;
    if (n == 0) return;
    out[0] = '\0';
    if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&p, dev) == cudaSuccess)
        snprintf(out, n, "%s", p.name);
    else
        cudaGetLastError();
}

megamoe_status cli_forward_split_device_stats(cli_layer *c, int T, int K, int H, const uint16_t *x,
                                              const int32_t *ids, const float *w, const uint8_t *pad, uint16_t *y,
                                              int iters, double *min_ms, double *ms, double *max_ms) {
    dev_io d;
    if (dev_io_upload(&d, T, K, H, x, ids, w, pad)) {
        dev_io_free(&d);
        return MEGAMOE_ERR_CUDA;
    }
    megamoe_status st = cli_forward_split(c, T, K, H, d.x, d.ids, d.w, d.pad, d.y); /* warm-up, checked */
    if (st == MEGAMOE_OK) st = megamoe_layer_check(c->layer);
    if (st == MEGAMOE_OK && iters > 0) {
        /* Graph-replayed, the L2 flushed before each replay by writing a buffer larger than it.
         * Thread-local capture: with --gpus each rank is a thread, and another rank's cudaMalloc or
         * cudaMemcpy during this capture would otherwise fail it ("operation not permitted when
         * stream is capturing", as EP2 with T_max 8192 does). */
        cudaStream_t s = NULL;
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        cudaEvent_t e0 = NULL, e1 = NULL;
        void *flush = NULL;
        /* MEGAMOE_BENCH_FLUSH_MB (diagnosis only, see `megamoe bench --help`): the flush's size. */
        const char *env = getenv("MEGAMOE_BENCH_FLUSH_MB");
        const size_t flush_bytes = (env ? (size_t)strtoul(env, NULL, 10) : 256u) << 20;
        double *times = calloc((size_t)iters, sizeof *times);
        int ok = times && cudaStreamCreate(&s) == cudaSuccess && cudaEventCreate(&e0) == cudaSuccess &&
                 cudaEventCreate(&e1) == cudaSuccess && (flush_bytes == 0 || cudaMalloc(&flush, flush_bytes) == cudaSuccess) &&
                 cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
        if (ok) {
            st = cli_forward_split_on(c, T, K, H, d.x, d.ids, d.w, d.pad, d.y, s);
            ok = cudaStreamEndCapture(s, &graph) == cudaSuccess && st == MEGAMOE_OK &&
                 cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
        }
        for (int it = -1; ok && it < iters; it++) {
            float t = 0;
            ok = (flush_bytes == 0 || cudaMemsetAsync(flush, it & 0xFF, flush_bytes, s) == cudaSuccess) &&
                 cudaEventRecord(e0, s) == cudaSuccess && cudaGraphLaunch(exec, s) == cudaSuccess &&
                 cudaEventRecord(e1, s) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
                 cudaEventElapsedTime(&t, e0, e1) == cudaSuccess;
            if (it >= 0) times[it] = t;
        }
        if (ok) {
            for (int i = 1; i < iters; i++)
                for (int j = i; j > 0 && times[j] < times[j - 1]; j--) {
                    double tmp = times[j];
                    times[j] = times[j - 1], times[j - 1] = tmp;
                }
            if (ms) *ms = times[iters / 2];
            if (min_ms) *min_ms = times[0];
            if (max_ms) *max_ms = times[iters - 1];
            st = megamoe_layer_check(c->layer);
        } else if (st == MEGAMOE_OK) {
            cli_fail("CUDA graph capture or replay failed: %s", cudaGetErrorString(cudaGetLastError()));
            st = MEGAMOE_ERR_CUDA;
        }
        if (exec) cudaGraphExecDestroy(exec);
        if (graph) cudaGraphDestroy(graph);
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
        if (s) cudaStreamDestroy(s);
        cudaFree(flush);
        free(times);
    }
    if (st == MEGAMOE_OK && cudaMemcpy(y, d.y, (size_t)T * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
        st = MEGAMOE_ERR_CUDA;
    dev_io_free(&d);
    return st;
}

double cli_device_copy_gbps(void) {
    const size_t bytes = 512u << 20;
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float best = 0;
    int ok = cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess &&
             cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess &&
             cudaMemset(a, 1, bytes) == cudaSuccess;
    for (int i = -1; ok && i < 5; i++) { /* a warm-up, then the best of 5 */
        float t = 0;
        ok = cudaEventRecord(e0, NULL) == cudaSuccess && cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, NULL) == cudaSuccess &&
             cudaEventRecord(e1, NULL) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
             cudaEventElapsedTime(&t, e0, e1) == cudaSuccess;
        if (ok && i >= 0 && (best == 0 || t < best)) best = t;
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(a), cudaFree(b);
    if (!ok) cudaGetLastError(); /* leave no sticky error for the runs that follow */
    return ok && best > 0 ? 2.0 * (double)bytes / (best * 1e-3) / 1e9 : 0.0;
}
#else
double cli_device_copy_gbps(void) { return 0.0; }

void cli_device_name(char *out, size_t n) {
    if (n) out[0] = '\0';
}

megamoe_status cli_forward_split_device_stats(cli_layer *c, int T, int K, int H, const uint16_t *x,
                                              const int32_t *ids, const float *w, const uint8_t *pad, uint16_t *y,
                                              int iters, double *min_ms, double *ms, double *max_ms) {
    (void)min_ms, (void)max_ms;
    return cli_forward_split_device(c, T, K, H, x, ids, w, pad, y, iters, ms);
}

megamoe_status cli_forward_split_device(cli_layer *c, int T, int K, int H, const uint16_t *x,
                                        const int32_t *ids, const float *w, const uint8_t *pad, uint16_t *y,
                                        int iters, double *ms) {
    (void)c, (void)T, (void)K, (void)H, (void)x, (void)ids, (void)w, (void)pad, (void)y, (void)iters,
        (void)ms;
    return MEGAMOE_ERR_UNSUPPORTED;
}
#endif
