/*
 * cli_device.c -- device memory for the CLI's CUDA runs: inputs uploaded, y downloaded, forwards
 * timed with CUDA events. Built against the CUDA runtime when the library has its CUDA backend.
 */
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

static int dev_io_upload(dev_io *d, int T, int K, int H, const uint16_t *x, const int32_t *ids, const float *w,
                         const uint8_t *pad) {
    memset(d, 0, sizeof *d);
    const size_t n = (size_t)T;
    if (cudaMalloc((void **)&d->x, n * H * 2 + 16) || cudaMalloc((void **)&d->y, n * H * 2 + 16) ||
        cudaMalloc((void **)&d->ids, n * K * 4 + 16) || cudaMalloc((void **)&d->w, n * K * 4 + 16) ||
        (pad && cudaMalloc((void **)&d->pad, n + 16)))
        return cli_fail("cudaMalloc for the inputs failed");
    if (cudaMemcpy(d->x, x, n * H * 2, cudaMemcpyHostToDevice) || cudaMemcpy(d->ids, ids, n * K * 4, cudaMemcpyHostToDevice) ||
        cudaMemcpy(d->w, w, n * K * 4, cudaMemcpyHostToDevice) || (pad && cudaMemcpy(d->pad, pad, n, cudaMemcpyHostToDevice)) ||
        cudaMemset(d->y, 0xFF, n * H * 2))
        return cli_fail("copying the inputs to the device failed");
    return 0;
}

megamoe_status cli_forward_split_device(cli_layer *c, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                                        const float *w, const uint8_t *pad, uint16_t *y, int iters, double *ms) {
    dev_io d;
    if (dev_io_upload(&d, T, K, H, x, ids, w, pad)) {
        dev_io_free(&d);
        return MEGAMOE_ERR_CUDA;
    }
    megamoe_status st = MEGAMOE_OK;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    double *times = calloc((size_t)(iters > 0 ? iters : 1), sizeof *times);
    for (int it = -1; it < iters && st == MEGAMOE_OK; it++) { /* one warm-up run */
        cudaEventRecord(e0, NULL);
        st = cli_forward_split(c, T, K, H, d.x, d.ids, d.w, d.pad, d.y);
        cudaEventRecord(e1, NULL);
        if (st == MEGAMOE_OK) st = megamoe_layer_check(c->layer);
        float t = 0;
        cudaEventElapsedTime(&t, e0, e1);
        if (it >= 0 && times) times[it] = t;
    }
    if (st == MEGAMOE_OK && times && ms) {
        for (int i = 1; i < iters; i++)
            for (int j = i; j > 0 && times[j] < times[j - 1]; j--) {
                double tmp = times[j];
                times[j] = times[j - 1], times[j - 1] = tmp;
            }
        *ms = times[iters / 2];
    }
    if (st == MEGAMOE_OK && cudaMemcpy(y, d.y, (size_t)T * H * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
        st = MEGAMOE_ERR_CUDA;
    free(times);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    dev_io_free(&d);
    return st;
}
#else
megamoe_status cli_forward_split_device(cli_layer *c, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                                        const float *w, const uint8_t *pad, uint16_t *y, int iters, double *ms) {
    (void)c, (void)T, (void)K, (void)H, (void)x, (void)ids, (void)w, (void)pad, (void)y, (void)iters, (void)ms;
    return MEGAMOE_ERR_UNSUPPORTED;
}
#endif
