/*
 * sm90_bf16_gather_probe.cu -- the BF16 prefill design to decide before the library changes its BF16
 * layout (issue 3: BF16 at T = 8192 no slower than PyTorch, which runs the
 * Mixtral-like shape at ~520 TFLOP/s). sm90_bf16_gemm_probe.cu loads both operands with 2D TMA (638
 * TFLOP/s dense); an expert GEMM cannot: its tokens are gathered rows. Here, as the library would:
 *   - weights stored by the host as the exact shared-memory image of each (256-row block, 64-wide K
 *     step): 256 rows x 128 bytes in the 128-byte swizzle (chunk j of row r at (j ^ r & 7) * 16), one
 *     32 KB bulk copy (TMA 1D) per stage, no tensor map;
 *   - the 128 tokens of a block gathered through an index list (a random permutation of the rows):
 *     producer thread t copies token t's 128 bytes per K step with cp.async into the same swizzle,
 *     waits for them WS_LAG steps later, fences them for the async proxy and arrives (as the
 *     library's sm90_expert_ws.cu does);
 *   - two consumer warpgroups (setmaxnreg 232), 64 tokens each: wgmma.m64n256k16 SS, one group in
 *     flight, a stage released when the next has been issued.
 * out[token][row] in bf16. Checks 4096 sampled outputs against a double reference and that every
 * output was written (NaN poison); times (CUDA events, median of 20) in TFLOP/s against 795.
 *   build: nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Iinclude -Isrc -Isrc/cuda dev/sm90_bf16_gather_probe.cu -o probe
 *   run:   ./probe [M N K]   (default: three shapes; M % 128, N % 256, K % 128 must be 0)
 * Not part of the library.
 */
#include <cuda_bf16.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "dev_tma.cuh"

#define BM 128 /* tokens per block: two consumer warpgroups of 64 */
#define BN 256 /* weight rows per block */
static_assert(BK == 64, "K step: the library's BK (gemm/fragments.cuh)");
#define STAGES 4
#define LAG 2
#define A_BYTES (BM * BK * 2) /* 16 KB */
#define B_BYTES (BN * BK * 2) /* 32 KB: one weight image */
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define THREADS 384
#define SMEM (STAGES * STAGE_BYTES + 1024)
static_assert(LAG <= STAGES - 2, "a producer thread signals a stage before it waits for a later one");

/* cp_async16_zfill: the library's (ptx/cp_async.cuh) */
/* out[m][n] = sum_k x[idx[m0 + m]][k] . w[n][k]; w as images [N / 256][K / 64][32 KB]. */
__global__ void __launch_bounds__(THREADS, 1)
    bf16_gather_gemm(const __nv_bfloat16 *x, const int *idx, const uint8_t *w_img, __nv_bfloat16 *out, int M, int N,
                     int K) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + ((1024 - (mm_smem_u32(smem_raw) & 1023)) & 1023); /* stays a shared pointer */
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128, nk = K / BK;
    const int nb = blockIdx.x, m0 = blockIdx.y * BM;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mm_mbar_init(&full[s], 128 + 1), mm_mbar_init(&empty[s], 8);
        mm_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 0) { /* producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        const __nv_bfloat16 *row = x + (size_t)idx[m0 + t] * K;
        const uint8_t *img = w_img + (size_t)nb * nk * B_BYTES;
        for (int kb = 0; kb < nk; kb++) {
            const int s = kb % STAGES;
            if (kb >= STAGES) mm_mbar_wait_parity(&empty[s], ((kb / STAGES) - 1) & 1);
            uint8_t *st = smem + s * STAGE_BYTES;
            if (t == 0) {
                mm_mbar_expect_tx(&full[s], B_BYTES);
                mm_bulk_copy(st + A_BYTES, img + (size_t)kb * B_BYTES, B_BYTES, &full[s]);
            }
            const uint32_t dst = mm_smem_u32(st) + t * 128;
#pragma unroll
            for (int j = 0; j < 8; j++) cp_async16_zfill(dst + ((j ^ (t & 7)) << 4), row + kb * BK + 8 * j, 16);
            cp_async_commit();
            if (kb >= LAG) {
                cp_async_wait<LAG>();
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                mm_mbar_arrive(&full[(kb - LAG) % STAGES]);
            }
        }
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        for (int kb = max(0, nk - LAG); kb < nk; kb++) mm_mbar_arrive(&full[kb % STAGES]);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1; /* this consumer's 64 tokens: m0 + 64 c ... */
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.0f;
    for (int kb = 0; kb < nk; kb++) {
        const int s = kb % STAGES;
        mm_mbar_wait_parity(&full[s], (kb / STAGES) & 1);
        const uint8_t *st = smem + s * STAGE_BYTES;
        const uint64_t da = desc_sw128(st + c * 64 * 128), db = desc_sw128(st + A_BYTES);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; k++) wgmma_256(d, da + 2 * k, db + 2 * k, kb > 0 || k > 0);
        wgmma_commit();
        wgmma_wait<1>(); /* the group of kb - 1 has retired: its stage goes back */
        if (kb > 0 && t % 32 == 0) mm_mbar_arrive(&empty[(kb - 1) % STAGES]);
    }
    wgmma_wait<0>();
    const int m = m0 + 64 * c + 16 * (t / 32) + (t % 32) / 4;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const int n = nb * BN + 8 * j + 2 * (t % 4);
        *(__nv_bfloat162 *)(out + (size_t)m * N + n) = __floats2bfloat162_rn(d[4 * j], d[4 * j + 1]);
        *(__nv_bfloat162 *)(out + (size_t)(m + 8) * N + n) = __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
    }
}

/* The host's packing: w [N, K] bf16 -> images [N / 256][K / 64] of 256 x 128 bytes, swizzled. */
static std::vector<uint16_t> pack_images(const std::vector<uint16_t> &w, int N, int K) {
    std::vector<uint16_t> img(w.size());
    const int nk = K / BK;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            const int nb = n / BN, r = n % BN, kb = k / BK, j = (k % BK) / 8, e = k % 8;
            const size_t byte = ((size_t)nb * nk + kb) * B_BYTES + (size_t)r * 128 + ((j ^ (r & 7)) << 4) + 2 * e;
            img[byte / 2] = w[(size_t)n * K + k];
        }
    return img;
}

static int run(int M, int N, int K) {
    std::vector<uint16_t> x((size_t)M * K), w((size_t)N * K), c((size_t)M * N);
    uint32_t s = 12345u + (uint32_t)(M ^ N ^ K);
    auto rnd = [&]() { s = s * 1664525u + 1013904223u; return ((s >> 8) & 0xFFFF) / 32768.0f - 1.0f; };
    for (auto &v : x) v = bf16_bits(rnd());
    for (auto &v : w) v = bf16_bits(rnd() * 0.05f);
    std::vector<int> idx(M);
    std::iota(idx.begin(), idx.end(), 0);
    std::shuffle(idx.begin(), idx.end(), std::mt19937(7)); /* gathered rows */
    const std::vector<uint16_t> img = pack_images(w, N, K);
    void *dx, *dw, *dc, *di;
    CK(cudaMalloc(&dx, x.size() * 2));
    CK(cudaMalloc(&dw, img.size() * 2));
    CK(cudaMalloc(&dc, c.size() * 2));
    CK(cudaMalloc(&di, idx.size() * 4));
    CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, img.data(), img.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(di, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dc, 0xFF, c.size() * 2)); /* poison: NaN bf16 */
    CK(cudaFuncSetAttribute(bf16_gather_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    const dim3 grid(N / BN, M / BM);
    auto launch = [&] {
        bf16_gather_gemm<<<grid, THREADS, SMEM>>>((const __nv_bfloat16 *)dx, (const int *)di, (const uint8_t *)dw,
                                                  (__nv_bfloat16 *)dc, M, N, K);
    };
    launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(c.data(), dc, c.size() * 2, cudaMemcpyDeviceToHost));
    const int fail = report_bf16_product("gathered ", x, w, c, M, N, K, [&](int m) { return idx[m]; }, median_ms(launch));
    CK(cudaFree(dx));
    CK(cudaFree(dw));
    CK(cudaFree(dc));
    CK(cudaFree(di));
    return fail;
}

int main(int argc, char **argv) {
    if (argc == 4) return run(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]));
    int fails = 0;
    fails += run(8192, 7168, 2048);  /* as sm90_bf16_gemm_probe: 638 TFLOP/s with both operands by TMA */
    fails += run(4096, 28672, 4096); /* Mixtral-like gate/up of 4096 tokens per expert: 509 there */
    fails += run(512, 1536, 2048);   /* Qwen3-like gate/up of one expert's 512 tokens */
    return fails != 0;
}
