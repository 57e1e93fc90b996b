/*
 * sm90_bf16_gemm_probe.cu -- the building block the BF16 prefill needs (issue 3: BF16 at T = 8192 no
 * slower than PyTorch's grouped GEMM, which runs at 300-520 TFLOP/s on the H200 at these shapes): a
 * dense C = A . B^T in bf16 (A: [M, K] tokens, B: [N, K] weight rows, both K-major; C: [M, N]) the
 * standard Hopper way, to measure before the expert kernel is rebuilt on it:
 *   - 2D TMA (cp.async.bulk.tensor) of 128 x 64 token tiles and 256 x 64 weight tiles into 128-byte
 *     swizzled shared memory, a 4-stage ring completed on mbarriers (full: the transaction bytes;
 *     empty: one arrival per consumer warp);
 *   - a producer warpgroup (one thread issues the copies, setmaxnreg.dec to 40 registers) and two
 *     consumer warpgroups (setmaxnreg.inc to 232), each wgmma.m64n256k16 SS on its 64 token rows,
 *     one wgmma group kept in flight: a stage is released when the group after it has been issued;
 *   - the f32 accumulators rounded to bf16 straight to global memory.
 * Checks 4096 sampled outputs against a double reference; times the product (CUDA events, median of
 * 20) and prints TFLOP/s against the 795 of DEVICE.md.
 *   build: nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Iinclude -Isrc -Isrc/cuda dev/sm90_bf16_gemm_probe.cu -o probe
 *   run:   ./probe [M N K]   (default: three shapes; M % 128, N % 256, K % 64 must be 0)
 * Not part of the library.
 */
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "dev_tma.cuh"

#define BM 128
#define BN 256
static_assert(BK == 64, "K step: the library's BK (gemm/fragments.cuh)");
#define STAGES 4
#define A_BYTES (BM * BK * 2) /* 16 KB */
#define B_BYTES (BN * BK * 2) /* 32 KB */
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define THREADS 384
#define SMEM (STAGES * STAGE_BYTES + 1024) /* + alignment of the swizzled tiles to 1024 bytes */

__global__ void __launch_bounds__(THREADS, 1)
    bf16_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b, __nv_bfloat16 *c,
              int M, int N, int K) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + ((1024 - (mm_smem_u32(smem_raw) & 1023)) & 1023); /* stays a shared pointer */
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128, nk = K / BK;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mm_mbar_init(&full[s], 1), mm_mbar_init(&empty[s], 8);
        mm_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 0) { /* producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (t == 0) {
            for (int kb = 0; kb < nk; kb++) {
                const int s = kb % STAGES;
                if (kb >= STAGES) mm_mbar_wait_parity(&empty[s], ((kb / STAGES) - 1) & 1);
                uint8_t *sa = smem + s * STAGE_BYTES, *sb = sa + A_BYTES;
                mm_mbar_expect_tx(&full[s], STAGE_BYTES);
                mm_tma_load_2d(sa, &map_a, kb * BK, m0, &full[s]);
                mm_tma_load_2d(sb, &map_b, kb * BK, n0, &full[s]);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int w = wg - 1; /* this consumer's 64 token rows: m0 + 64 w ... */
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.0f;
    for (int kb = 0; kb < nk; kb++) {
        const int s = kb % STAGES;
        mm_mbar_wait_parity(&full[s], (kb / STAGES) & 1);
        const uint8_t *sa = smem + s * STAGE_BYTES + w * 64 * 128, *sb = smem + s * STAGE_BYTES + A_BYTES;
        const uint64_t da = desc_sw128(sa), db = desc_sw128(sb);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; k++) wgmma_256(d, da + 2 * k, db + 2 * k, kb > 0 || k > 0); /* +32 bytes */
        wgmma_commit();
        wgmma_wait<1>(); /* the group of kb - 1 has retired: its stage goes back */
        if (kb > 0 && t % 32 == 0) mm_mbar_arrive(&empty[(kb - 1) % STAGES]);
    }
    wgmma_wait<0>();
    /* Accumulator (m64nN): thread t, warp t / 32: rows 16 (t / 32) + (t % 32) / 4 (+ 8), columns
     * 8 j + 2 (t % 4) (+ 1) in d[4 j ...]. */
    const int row = m0 + 64 * w + 16 * (t / 32) + (t % 32) / 4;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const int col = n0 + 8 * j + 2 * (t % 4);
        *(__nv_bfloat162 *)(c + (size_t)row * N + col) = __floats2bfloat162_rn(d[4 * j], d[4 * j + 1]);
        *(__nv_bfloat162 *)(c + (size_t)(row + 8) * N + col) = __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
    }
}

static int run(int M, int N, int K) {
    std::vector<uint16_t> a((size_t)M * K), b((size_t)N * K), c((size_t)M * N);
    uint32_t x = 12345u + (uint32_t)(M ^ N ^ K);
    auto rnd = [&]() { x = x * 1664525u + 1013904223u; return ((x >> 8) & 0xFFFF) / 32768.0f - 1.0f; };
    for (auto &v : a) v = bf16_bits(rnd());
    for (auto &v : b) v = bf16_bits(rnd() * 0.05f);
    void *da, *db, *dc;
    CK(cudaMalloc(&da, a.size() * 2));
    CK(cudaMalloc(&db, b.size() * 2));
    CK(cudaMalloc(&dc, c.size() * 2));
    CK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(dc, 0xFF, c.size() * 2)); /* poison: NaN bf16 */
    const CUtensorMap ma = tile_map_16bit(da, M, K, BM, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
                      mb = tile_map_16bit(db, N, K, BN, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16);
    CK(cudaFuncSetAttribute(bf16_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    const dim3 grid(N / BN, M / BM);
    bf16_gemm<<<grid, THREADS, SMEM>>>(ma, mb, (__nv_bfloat16 *)dc, M, N, K);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(c.data(), dc, c.size() * 2, cudaMemcpyDeviceToHost));
    const double med = median_ms([&] { bf16_gemm<<<grid, THREADS, SMEM>>>(ma, mb, (__nv_bfloat16 *)dc, M, N, K); });
    const int fail = report_bf16_product("", a, b, c, M, N, K, [](int m) { return m; }, med);
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dc));
    return fail;
}

int main(int argc, char **argv) {
    if (argc == 4) return run(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]));
    int fails = 0;
    fails += run(8192, 7168, 2048);  /* DSv3-like down projection of 8192 tokens' slots, one expert-sized K */
    fails += run(4096, 28672, 4096); /* Mixtral-like gate/up of 4096 tokens per expert */
    fails += run(512, 1536, 2048);   /* Qwen3-like gate/up of one expert's 512 tokens */
    return fails != 0;
}
