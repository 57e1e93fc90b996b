/* gpu_occupier.h -- a kernel that holds part of every SM from another stream (gpu_occupier.cu). */
#ifndef MEGAMOE_TESTS_GPU_OCCUPIER_H
#define MEGAMOE_TESTS_GPU_OCCUPIER_H
#include <cuda_runtime_api.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tu_occupier {
    volatile int *host_flags; /* [0] release, [1] blocks started (mapped pinned memory) */
    cudaStream_t stream;      /* its own non-blocking stream */
    int blocks;               /* one per SM */
} tu_occupier;

/* Launches it and waits until a block runs on every SM: 0, a cudaError_t, or -1 (not all started). */
int tu_occupier_start(tu_occupier *o);
/* Releases it and waits for it to end; frees it. 0 or a cudaError_t. */
int tu_occupier_release(tu_occupier *o);

#ifdef __cplusplus
}
#endif
#endif
