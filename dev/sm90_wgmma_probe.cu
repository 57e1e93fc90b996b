/*
 * sm90_wgmma_probe.cu -- an experiment, not part of the library: checks on the GPU machine the
 * layout assumptions the wgmma prefill kernel will rest on, before that kernel is written.
 *   1. SS: wgmma m64n64k16 f16 -> f32 with A and B in shared memory in the no-swizzle K-major
 *      core-matrix layout: [k group of 8][row group of 8][8 rows][16 bytes], descriptors with
 *      LBO = byte distance of K-adjacent core matrices, SBO = of M/N-adjacent ones.
 *      Measured on the H200 (2026-11-29): this convention is exact (0 of 4096 outside 1e-6); the
 *      swapped one (mode 1) reads outside shared memory and kills the context.
 *   2. RS: A from registers in the mma.sync A-fragment order (KERNEL_NOTES §3.2), B as in 1.
 *   3. The biased FP4 decode of weight_layout.h as the A operand: code * 2^-14 * E4M3 scale, f16
 *      subnormals included, against an exact double reference.
 * Build and run on the GPU machine:
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O2 -Isrc/cuda dev/sm90_wgmma_probe.cu -o /tmp/probe && /tmp/probe
 */
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "dev_util.cuh"
#include <string.h>

#include <cmath>


constexpr int M = 64, N = 64, K = 16;

/* Byte offset of element (r, k) of a [rows x 16] K-major tile in the core-matrix layout. */
__host__ __device__ inline int core_offset(int r, int k, int rows) {
    return (k / 8) * (rows * 16) + (r / 8) * 128 + (r % 8) * 16 + (k % 8) * 2;
}

__device__ inline uint64_t make_desc(const void *smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    uint64_t d = 0;
    d |= (uint64_t)((addr >> 4) & 0x3FFF);
    d |= (uint64_t)((lbo >> 4) & 0x3FFF) << 16;
    d |= (uint64_t)((sbo >> 4) & 0x3FFF) << 32;
    return d; /* base offset 0, swizzle mode 0 (none) */
}

#define ACC32(d)                                                                                   \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),    \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),       \
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),     \
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),     \
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

__device__ inline void wgmma_ss(float *d, uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : ACC32(d)
                 : "l"(da), "l"(db));
}

__device__ inline void wgmma_rs(float *d, const uint32_t *a, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/* a: [M][K] f16 row-major, b: [N][K] f16 (K-major), out: [M][N] f32. mode 0 SS, 1 SS with LBO/SBO
 * swapped, 2 RS. One warpgroup. */
__global__ void probe_kernel(const __half *a, const __half *b, float *out, int mode) {
    __shared__ __align__(128) uint8_t sa[M * K * 2];
    __shared__ __align__(128) uint8_t sb[N * K * 2];
    const int t = threadIdx.x;
    for (int i = t; i < M * K; i += blockDim.x) *(__half *)(sa + core_offset(i / K, i % K, M)) = a[i];
    for (int i = t; i < N * K; i += blockDim.x) *(__half *)(sb + core_offset(i / K, i % K, N)) = b[i];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const uint32_t lbo = mode == 1 ? 128 : M * 16, sbo = mode == 1 ? M * 16 : 128;
    const uint64_t da = make_desc(sa, lbo, sbo), db = make_desc(sb, mode == 1 ? 128 : N * 16, mode == 1 ? N * 16 : 128);
    float d[32];
    for (int i = 0; i < 32; i++) d[i] = 0.0f;
    const int w = t / 32, l = t % 32, g = l / 4, c = l % 4;
    uint32_t ar[4];
    if (mode == 2) {
        const int rows[4] = {16 * w + g, 16 * w + g + 8, 16 * w + g, 16 * w + g + 8};
        const int ks[4] = {2 * c, 2 * c, 2 * c + 8, 2 * c + 8};
        for (int j = 0; j < 4; j++) {
            __half2 h = __halves2half2(a[rows[j] * K + ks[j]], a[rows[j] * K + ks[j] + 1]);
            ar[j] = *reinterpret_cast<uint32_t *>(&h);
        }
    }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if (mode == 2) wgmma_rs(d, ar, db);
    else wgmma_ss(d, da, db);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    for (int j = 0; j < N / 8; j++)
        for (int q = 0; q < 4; q++) {
            const int row = 16 * w + g + 8 * (q >> 1), col = 8 * j + 2 * c + (q & 1);
            out[row * N + col] = d[4 * j + q];
        }
}


static int run(const char *name, int mode, const float *af, const float *bf) {
    __half ha[M * K], hb[N * K];
    for (int i = 0; i < M * K; i++) ha[i] = __float2half_rn(af[i]);
    for (int i = 0; i < N * K; i++) hb[i] = __float2half_rn(bf[i]);
    __half *da, *db;
    float *dout, out[M * N];
    CK(cudaMalloc(&da, sizeof ha));
    CK(cudaMalloc(&db, sizeof hb));
    CK(cudaMalloc(&dout, sizeof out));
    CK(cudaMemcpy(da, ha, sizeof ha, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, hb, sizeof hb, cudaMemcpyHostToDevice));
    CK(cudaMemset(dout, 0xFF, sizeof out));
    probe_kernel<<<1, 128>>>(da, db, dout, mode);
    CK(cudaGetLastError());
    CK(cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost));
    int bad = 0;
    double worst = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double ref = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                const double p = (double)__half2float(ha[m * K + k]) * (double)__half2float(hb[n * K + k]);
                ref += p;
                mag += fabs(p);
            }
            const double err = fabs(out[m * N + n] - ref) / (mag > 0 ? mag : 1);
            if (!(err <= 1e-6)) bad++;
            if (err > worst || err != err) worst = err;
        }
    printf("%-48s %s  (%d of %d outside 1e-6 of the exact sum, worst %.2e)\n", name, bad ? "MISMATCH" : "ok", bad,
           M * N, worst);
    cudaFree(da), cudaFree(db), cudaFree(dout);
    return bad != 0;
}

int main() {
    float a[M * K], b[N * K], a4[M * K];
    srand(1);
    for (int i = 0; i < M * K; i++) a[i] = (float)(rand() % 2001 - 1000) / 500.0f;
    for (int i = 0; i < N * K; i++) b[i] = (float)(rand() % 2001 - 1000) / 250.0f;
    /* Biased FP4 weights: code * 2^-14 * scale, scales across the E4M3 range (subnormal products). */
    for (int i = 0; i < M * K; i++) a4[i] = e2m1(rand() % 16) * ldexpf(1.0f, -14) * e4m3(1 + rand() % 0x7D);
    int fails = 0;
    fails += run("SS, LBO = K-adjacent, SBO = M/N-adjacent", 0, a, b);
    /* Mode 1 (LBO/SBO swapped) faults with an illegal address: run it last, alone, if ever needed. */
    fails += run("RS, A in the mma.sync fragment order", 2, a, b);
    fails += run("RS, biased FP4 x E4M3 weights (f16 subnormals)", 2, a4, b);
    printf("%s\n", fails == 0 ? "layout probe: all ok" : "layout probe: FAILED");
    return 0;
}
