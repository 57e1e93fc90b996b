/*
 * dev_util.cuh -- what the experiments of dev/ share: checked CUDA calls, the library's mbarrier and
 * bulk-copy (TMA 1D) primitives (src/cuda/sm90_async.cuh), and exact host decoders of E2M1 and E4M3
 * for double references.
 * Not part of the library.
 */
#ifndef MEGAMOE_DEV_UTIL_CUH
#define MEGAMOE_DEV_UTIL_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "sm90_async.cuh" /* the library's mbarrier and bulk-copy primitives (build with -Isrc/cuda) */

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);                    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static inline float e2m1(int code) {
    const float v[8] = {0, .5f, 1, 1.5f, 2, 3, 4, 6};
    return code & 8 ? -v[code & 7] : v[code & 7];
}
static inline float e4m3(int b) {
    const int e = (b >> 3) & 15, m = b & 7;
    return e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
}

/* n pseudo-random bytes (a hash of the index and seed): lo + h % span, or any byte when span is 0. */
__global__ void fill_bytes(uint8_t *p, size_t n, uint32_t seed, int lo, int span) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = span > 0 ? (uint8_t)(lo + h % span) : (uint8_t)h;
    }
}

/* Median time of launch() in ms over `iters` runs after one warm-up (CUDA events on the default stream). */
template <class F>
static float median_ms(F launch, int iters = 20) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int it = 0; it <= iters; it++) {
        CK(cudaEventRecord(e0));
        launch();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float v;
        CK(cudaEventElapsedTime(&v, e0, e1));
        if (it) ms.push_back(v);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

#endif /* MEGAMOE_DEV_UTIL_CUH */
