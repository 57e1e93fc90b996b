/*
 * dev_util.cuh -- what the experiments of dev/ share: checked CUDA calls, the library's mbarrier and
 * bulk-copy (TMA 1D) primitives (src/cuda/ptx/mbarrier.cuh, ptx/bulk_copy.cuh), and exact host decoders of E2M1 and E4M3
 * for double references.
 * Not part of the library.
 */
#ifndef MEGAMOE_DEV_UTIL_CUH
#define MEGAMOE_DEV_UTIL_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ptx/bulk_copy.cuh" /* the library's mbarrier and bulk-copy primitives (build with -Isrc/cuda) */

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

/* ---- bf16 products (the BF16 probes) ------------------------------------------------------------ */
static inline uint16_t bf16_bits(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_val(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* c[M][N] (bf16) against sum_k a[arow(m)][k] b[n][k] in double at 4096 sampled outputs (within 1e-2 of
 * the row's magnitude: the output's bf16 rounding), and every output written (the poison is NaN);
 * prints one line with the timing (TFLOP/s against 795). Returns nonzero on a mismatch. */
template <class Row>
static int report_bf16_product(const char *what, const std::vector<uint16_t> &a, const std::vector<uint16_t> &b,
                               const std::vector<uint16_t> &c, int M, int N, int K, Row arow, double med_ms) {
    uint32_t x = 777u + (uint32_t)(M ^ N ^ K);
    double worst = 0.0;
    int bad = 0;
    for (int i = 0; i < 4096; i++) {
        x = x * 1664525u + 1013904223u;
        const int m = (int)(x % (uint32_t)M);
        x = x * 1664525u + 1013904223u;
        const int n = (int)(x % (uint32_t)N);
        double ref = 0.0, mag = 0.0;
        for (int k = 0; k < K; k++) {
            const double p = (double)bf16_val(a[(size_t)arow(m) * K + k]) * bf16_val(b[(size_t)n * K + k]);
            ref += p, mag += p * p;
        }
        const double got = bf16_val(c[(size_t)m * N + n]), err = fabs(got - ref) / (fabs(ref) + sqrt(mag) + 1e-30);
        worst = std::max(worst, err);
        if (!(err < 1e-2)) bad++;
    }
    long unwritten = 0;
    for (size_t i = 0; i < c.size(); i++) unwritten += (c[i] & 0x7FFF) > 0x7F80;
    const double tf = 2.0 * M * N * K / (med_ms * 1e-3) / 1e12;
    printf("%sM=%d N=%d K=%d: %s (worst %.2e of the row's magnitude, %d of 4096 samples off, %ld unwritten), "
           "median %.4f ms, %.1f TFLOP/s (%.0f%% of 795)\n",
           what, M, N, K, bad || unwritten ? "WRONG" : "exact to bf16", worst, bad, unwritten, med_ms, tf,
           100.0 * tf / 795.0);
    return bad || unwritten;
}

#endif /* MEGAMOE_DEV_UTIL_CUH */
