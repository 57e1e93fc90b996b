/*
 * sm90_wgmma_fp4_gemm.cu -- an experiment, not part of the library: the prefill building block of the
 * next expert GEMM, on one dense matrix. C[tokens, rows] = X[tokens, K] . W[rows, K]^T with W in
 * NVFP4 (E2M1 codes + E4M3 block scales per 16), decoded in-kernel to f16 in shared memory and fed to
 * wgmma (SS, m64n128k16, f32 accumulation), swap-AB: weight rows are the wgmma M side, tokens N.
 *
 * Block: 2 warpgroups, 128 weight rows (64 each) x 128 tokens, K in 64-wide stages, 2 stages. While
 * the wgmma of stage s run (async), all 256 threads load and decode stage s+1: the FP4 decode hides
 * behind the tensor cores. Shared-memory tiles use the no-swizzle K-major core-matrix layout whose
 * descriptor convention dev/sm90_wgmma_probe.cu verified on the H200 (LBO = K-adjacent core
 * matrices, SBO = row-adjacent ones).
 *
 * Checks a small problem against a double reference, then times a DSv3-size gate/up (4096 x 7168)
 * at 2048 tokens and prints TFLOP/s (target from issue 3: >= 320; measured bf16 peak 795).
 * Build and run on the GPU machine:
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O2 -Isrc/cuda dev/sm90_wgmma_fp4_gemm.cu -o /tmp/g && /tmp/g
 */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "dev_util.cuh"

#include <cmath>
#include <vector>


constexpr int BR = 128;   /* weight rows per block (2 warpgroups x m64) */
constexpr int BT = 128;   /* tokens per block (wgmma N) */
constexpr int BKS = 64;   /* K per stage */
constexpr int A_BYTES = BR * BKS * 2, B_BYTES = BT * BKS * 2, STAGE_BYTES = A_BYTES + B_BYTES;

/* Byte offset of (r, k) in a [rows x 64] K-major tile: core matrices of 8 rows x 16 B, K groups of 8
 * outermost, then row groups. */
__device__ __forceinline__ int core_offset(int r, int k, int rows) {
    return (k >> 3) * (rows * 16) + (r >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2;
}

__device__ __forceinline__ uint64_t desc(const void *smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}

#define R8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

/* d[64] += A(64 x 16) . B(128 x 16)^T */
__device__ __forceinline__ void wgmma_m64n128k16(float *d, uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : R8(0), R8(8), R8(16), R8(24), R8(32), R8(40), R8(48), R8(56)
                 : "l"(da), "l"(db));
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)), "l"(gmem));
}

/* Two E2M1 codes of a byte -> f16x2 of code * 2^-14 (weight_layout.h's bias), times an f16 scale. */
__device__ __forceinline__ uint32_t decode2(uint32_t byte, __half2 s) {
    uint32_t v = ((byte & 0x8u) << 12) | ((byte & 0x7u) << 9) | ((byte & 0x80u) << 24) | ((byte & 0x70u) << 21);
    __half2 h = __hmul2(*reinterpret_cast<__half2 *>(&v), s);
    return *reinterpret_cast<uint32_t *>(&h);
}

/* Loads and decodes stage ks: 128 rows x 64 K of weights (32 B codes + 4 scale bytes per row) and
 * copies 128 tokens x 64 K of activations with cp.async. 256 threads: thread -> (row, half of K). */
__device__ __forceinline__ void load_stage(uint8_t *stage, const uint8_t *codes, const uint8_t *sf, const __half *x,
                                           int K, int row0, int tok0, int ks) {
    const int t = threadIdx.x, r = t >> 1, half = t & 1; /* 32 weights each */
    const int k0 = ks * BKS + half * 32;
    const uint4 c = *(const uint4 *)(codes + (size_t)(row0 + r) * (K / 2) + k0 / 2);
    const uint16_t s2 = *(const uint16_t *)(sf + (size_t)(row0 + r) * (K / 16) + k0 / 16);
    const __half2_raw sr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)s2, __NV_E4M3);
    const __half2 sp = *reinterpret_cast<const __half2 *>(&sr);
    const __half2 sa = __low2half2(sp), sb = __high2half2(sp);
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
    uint8_t *a = stage;
    for (int q = 0; q < 4; q++) { /* 8 weights = one 16-byte core-matrix row */
        const __half2 s = q < 2 ? sa : sb;
        uint4 o;
        o.x = decode2(w[q] & 0xFF, s), o.y = decode2((w[q] >> 8) & 0xFF, s);
        o.z = decode2((w[q] >> 16) & 0xFF, s), o.w = decode2(w[q] >> 24, s);
        *(uint4 *)(a + core_offset(r, half * 32 + q * 8, BR)) = o;
    }
    uint8_t *b = stage + A_BYTES;
    for (int i = t; i < BT * 8; i += 256) { /* 128 tokens x 8 chunks of 8 */
        const int tok = i >> 3, kc = i & 7;
        cp_async16(b + core_offset(tok, kc * 8, BT), x + (size_t)(tok0 + tok) * K + ks * BKS + kc * 8);
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

/* C: [tokens][rows] f32, times 2^14 (the weight bias). rows % 128 == 0, tokens % 128 == 0. */
__global__ void __launch_bounds__(256) fp4_gemm(const uint8_t *codes, const uint8_t *sf, const __half *x, float *C,
                                                int rows, int K) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int row0 = blockIdx.x * BR, tok0 = blockIdx.y * BT, wg = threadIdx.x >> 7;
    float d[64];
    for (int i = 0; i < 64; i++) d[i] = 0.0f;
    const int nks = K / BKS;
    load_stage(smem, codes, sf, x, K, row0, tok0, 0);
    asm volatile("cp.async.wait_all;\n" ::);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    for (int ks = 0; ks < nks; ks++) {
        uint8_t *st = smem + (ks & 1) * STAGE_BYTES;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int kk = 0; kk < BKS / 16; kk++) {
            /* A: this warpgroup's 64 rows (row groups 8 wg .. 8 wg + 7), K group 2 kk; B: all tokens. */
            const uint64_t da = desc(st + kk * 2 * (BR * 16) + wg * 8 * 128, BR * 16, 128);
            const uint64_t db = desc(st + A_BYTES + kk * 2 * (BT * 16), BT * 16, 128);
            wgmma_m64n128k16(d, da, db);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (ks + 1 < nks) load_stage(smem + ((ks + 1) & 1) * STAGE_BYTES, codes, sf, x, K, row0, tok0, ks + 1);
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        asm volatile("cp.async.wait_all;\n" ::);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    }
    const int t = threadIdx.x & 127, w = t >> 5, l = t & 31, g = l >> 2, c = l & 3;
    for (int j = 0; j < BT / 8; j++)
        for (int q = 0; q < 4; q++) {
            const int row = row0 + wg * 64 + 16 * w + g + 8 * (q >> 1), tok = tok0 + 8 * j + 2 * c + (q & 1);
            C[(size_t)tok * rows + row] = d[4 * j + q] * 16384.0f;
        }
}


static double run(int rows, int K, int tokens, bool check, int iters) {
    std::vector<uint8_t> codes((size_t)rows * K / 2), sf((size_t)rows * K / 16);
    std::vector<__half> x((size_t)tokens * K);
    uint64_t s = 12345;
    auto next = [&]() { return (s = s * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
    for (auto &v : codes) v = (uint8_t)next();
    for (auto &v : sf) v = (uint8_t)(0x28 + next() % 0x20);
    for (auto &v : x) v = __float2half_rn(((int)(next() % 2001) - 1000) / 250.0f);
    uint8_t *dc, *ds;
    __half *dx;
    float *dC;
    CK(cudaMalloc(&dc, codes.size()));
    CK(cudaMalloc(&ds, sf.size()));
    CK(cudaMalloc(&dx, x.size() * 2));
    CK(cudaMalloc(&dC, (size_t)tokens * rows * 4));
    CK(cudaMemcpy(dc, codes.data(), codes.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ds, sf.data(), sf.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(fp4_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * STAGE_BYTES));
    const dim3 grid(rows / BR, tokens / BT);
    fp4_gemm<<<grid, 256, 2 * STAGE_BYTES>>>(dc, ds, dx, dC, rows, K);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    if (check) {
        std::vector<float> C((size_t)tokens * rows);
        CK(cudaMemcpy(C.data(), dC, C.size() * 4, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        for (int t = 0; t < tokens; t++)
            for (int r = 0; r < rows; r++) {
                double ref = 0;
                for (int k = 0; k < K; k++) {
                    const int code = (codes[(size_t)r * K / 2 + k / 2] >> (4 * (k & 1))) & 15;
                    ref += (double)e2m1(code) * e4m3(sf[(size_t)r * K / 16 + k / 16]) * __half2float(x[(size_t)t * K + k]);
                }
                num += (C[(size_t)t * rows + r] - ref) * (C[(size_t)t * rows + r] - ref);
                den += ref * ref;
            }
        printf("check rows=%d K=%d tokens=%d: relative L2 vs double %.2e %s\n", rows, K, tokens, sqrt(num / den),
               sqrt(num / den) < 1e-5 ? "ok" : "MISMATCH");
    }
    double ms = 0;
    if (iters > 0) {
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        CK(cudaEventRecord(a));
        for (int i = 0; i < iters; i++) fp4_gemm<<<grid, 256, 2 * STAGE_BYTES>>>(dc, ds, dx, dC, rows, K);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float t;
        CK(cudaEventElapsedTime(&t, a, b));
        ms = t / iters;
        printf("time rows=%d K=%d tokens=%d: %.3f ms, %.1f TFLOP/s\n", rows, K, tokens, ms,
               2.0 * rows * K * tokens / (ms * 1e-3) / 1e12);
    }
    cudaFree(dc), cudaFree(ds), cudaFree(dx), cudaFree(dC);
    return ms;
}

int main() {
    run(256, 512, 256, true, 0);
    run(4096, 7168, 2048, false, 20);  /* DSv3 gate/up of one expert at 2048 tokens */
    run(7168, 2048, 2048, false, 20);  /* DSv3 down */
    return 0;
}
