/*
 * sm90_accum_probe.cu -- an experiment, not part of the library: how far the tensor cores' f32
 * accumulation is from float64 on long BF16 dot products, wgmma against mma.sync against ordered
 * f32 FMAs on the CUDA cores (DECISIONS 29: the GPU's BF16 y sits at 9.7e-4 of the CPU's at H = 7168,
 * with mma.sync 5.8e-4 -- is that the accumulation?). One warpgroup computes D = A . B^T for A, B of
 * 64 x K random bf16 values three ways:
 *   0. wgmma m64n64k16 (SS: both operands in shared memory, the no-swizzle K-major core-matrix
 *      layout of dev/sm90_wgmma_probe.cu), one accumulator over all of K;
 *   1. mma.sync m16n8k16, each warp 16 rows x 64 columns, one accumulator over all of K;
 *   2. fmaf in K order, one thread per output.
 * Against the double product: relative L2 error and the signed bias sum((d - ref) sign(ref)) /
 * sum |ref| (negative: truncation toward zero). K = 2048 and 7168, a few seeds.
 * Build and run on the GPU machine:
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O2 -Iinclude -Isrc -Isrc/cuda dev/sm90_accum_probe.cu -o /tmp/accum && /tmp/accum
 */
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmath>
#include <random>
#include <vector>

#include "dev_util.cuh"
#include "gemm/fragments.cuh" /* with ptx/wgmma.cuh: */
#include "ptx/wgmma.cuh" /* smem_desc, MM_ACC32, wgmma_fence / commit / wait (-Iinclude -Isrc -Isrc/cuda) */

constexpr int M = 64, N = 64;

/* Byte offset of element (r, k) of a [rows x 16] K-major tile in the core-matrix layout. */
__device__ inline int core_offset(int r, int k, int rows) {
    return (k / 8) * (rows * 16) + (r / 8) * 128 + (r % 8) * 16 + (k % 8) * 2;
}

__device__ inline void wgmma_ss_bf16(float *d, uint64_t da, uint64_t db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : MM_ACC32(d, 0)
                 : "l"(da), "l"(db), "r"(accumulate));
}

__device__ inline void mma_bf16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* One block of 128 threads. A, B: [64][K] bf16 row-major (B is N x K). D: [3][64][64] f32. */
__global__ void accum_kernel(const __nv_bfloat16 *A, const __nv_bfloat16 *B, int K, float *D) {
    __shared__ __align__(128) uint8_t sa[M * 16 * 2], sb[N * 16 * 2];   /* core-matrix tiles, one k16 */
    __shared__ __align__(16) __nv_bfloat16 ra[M][16], rb[N][16];         /* the same, row-major */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    float dw[32], dm[8][4];
    for (int i = 0; i < 32; i++) dw[i] = 0.0f;
    for (int j = 0; j < 8; j++)
        for (int v = 0; v < 4; v++) dm[j][v] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 16) {
        __syncthreads();
        for (int i = tid; i < M * 16; i += blockDim.x) {
            const int r = i / 16, k = i % 16;
            const __nv_bfloat16 a = A[(size_t)r * K + k0 + k], b = B[(size_t)r * K + k0 + k];
            *(__nv_bfloat16 *)(sa + core_offset(r, k, M)) = a;
            *(__nv_bfloat16 *)(sb + core_offset(r, k, N)) = b;
            ra[r][k] = a, rb[r][k] = b;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        /* 0: wgmma */
        wgmma_fence();
        wgmma_ss_bf16(dw, smem_desc(sa, M * 16, 128), smem_desc(sb, N * 16, 128), k0 > 0);
        wgmma_commit();
        wgmma_wait<0>();
        /* 1: mma.sync, this warp's rows 16 warp .. + 15 */
        uint32_t a[4];
        const int r0 = 16 * warp + g;
        a[0] = *(const uint32_t *)&ra[r0][2 * c];
        a[1] = *(const uint32_t *)&ra[r0 + 8][2 * c];
        a[2] = *(const uint32_t *)&ra[r0][2 * c + 8];
        a[3] = *(const uint32_t *)&ra[r0 + 8][2 * c + 8];
        for (int j = 0; j < 8; j++) {
            const uint32_t b0 = *(const uint32_t *)&rb[8 * j + g][2 * c], b1 = *(const uint32_t *)&rb[8 * j + g][2 * c + 8];
            mma_bf16(dm[j], a, b0, b1);
        }
    }
    for (int i = 0; i < 32; i++) { /* wgmma D fragment: row 16 warp + g + 8 (v >> 1), column 8 j + 2 c + (v & 1) */
        const int j = i / 4, v = i % 4;
        D[(16 * warp + g + 8 * (v >> 1)) * N + 8 * j + 2 * c + (v & 1)] = dw[i];
    }
    for (int j = 0; j < 8; j++)
        for (int v = 0; v < 4; v++)
            D[M * N + (16 * warp + g + 8 * (v >> 1)) * N + 8 * j + 2 * c + (v & 1)] = dm[j][v];
    /* 2: ordered f32 FMAs, 32 outputs per thread */
    for (int o = tid; o < M * N; o += blockDim.x) {
        const int r = o / N, n = o % N;
        float s = 0.0f;
        for (int k = 0; k < K; k++)
            s = fmaf(__bfloat162float(A[(size_t)r * K + k]), __bfloat162float(B[(size_t)n * K + k]), s);
        D[2 * M * N + o] = s;
    }
}

int main() {
    const char *names[3] = {"wgmma m64n64k16", "mma.sync m16n8k16", "f32 fma in K order"};
    for (int K : {2048, 7168}) {
        for (int seed = 1; seed <= 3; seed++) {
            std::mt19937 rng(seed * 7919 + K);
            std::normal_distribution<float> nd(0.0f, 1.0f);
            std::vector<__nv_bfloat16> A((size_t)M * K), B((size_t)N * K);
            for (auto &v : A) v = __float2bfloat16(nd(rng));
            for (auto &v : B) v = __float2bfloat16(nd(rng) * 0.05f);
            __nv_bfloat16 *dA, *dB;
            float *dD;
            CK(cudaMalloc(&dA, A.size() * 2));
            CK(cudaMalloc(&dB, B.size() * 2));
            CK(cudaMalloc(&dD, 3 * M * N * 4));
            CK(cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dB, B.data(), B.size() * 2, cudaMemcpyHostToDevice));
            CK(cudaMemset(dD, 0xFF, 3 * M * N * 4)); /* NaN poison */
            accum_kernel<<<1, 128>>>(dA, dB, K, dD);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<float> D(3 * M * N);
            CK(cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost));
            std::vector<double> ref(M * N);
            for (int r = 0; r < M; r++)
                for (int n = 0; n < N; n++) {
                    double s = 0;
                    for (int k = 0; k < K; k++)
                        s += (double)__bfloat162float(A[(size_t)r * K + k]) * (double)__bfloat162float(B[(size_t)n * K + k]);
                    ref[r * N + n] = s;
                }
            for (int m = 0; m < 3; m++) {
                double num = 0, den = 0, bias = 0, absref = 0;
                int bad = 0;
                for (int o = 0; o < M * N; o++) {
                    const double d = D[m * M * N + o], e = d - ref[o];
                    if (!std::isfinite(d)) bad++;
                    num += e * e, den += ref[o] * ref[o];
                    bias += e * (ref[o] < 0 ? -1.0 : 1.0), absref += std::fabs(ref[o]);
                }
                printf("K=%5d seed %d  %-20s rel L2 %.3e  bias %+.3e%s\n", K, seed, names[m], std::sqrt(num / den),
                       bias / absref, bad ? "  UNWRITTEN/NaN outputs" : "");
            }
            CK(cudaFree(dA));
            CK(cudaFree(dB));
            CK(cudaFree(dD));
        }
    }
    return 0;
}
