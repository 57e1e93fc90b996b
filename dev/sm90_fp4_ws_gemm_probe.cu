/*
 * sm90_fp4_ws_gemm_probe.cu -- an experiment for the NVFP4 prefill (issue 3: >= 320 TFLOP/s at
 * T = 8192; the library's wgmma kernel reaches 292 over the whole DSv3 forward with 2 blocks of 8
 * warps per SM at 128 registers, where ptxas serializes each warpgroup's wgmma with its next step,
 * C7511, and every K step ends in a block barrier). The same RS design (weights decoded from the
 * kernel layout into registers, `decode_a` of gemm/fragments.cuh, fed to wgmma as the A operand),
 * warp-specialized the way the BF16 probe is:
 *   - a producer warpgroup (setmaxnreg 40): per K step one 2D TMA of the 128-token tile (f16,
 *     128-byte swizzle) and two bulk copies per weight slab (4 KB of codes, 512 B of scales: each
 *     one contiguous run of the kernel layout) into a 6-stage mbarrier ring;
 *   - two consumer warpgroups (setmaxnreg 232), one 128-row slab each, as two m64 blocks: each warp
 *     decodes one 16-row group per m64 block and K step, wgmma.m64n128k16 RS, one group of wgmma in
 *     flight while the next step decodes (two register sets), a stage released when the step after
 *     it has been issued; no block barrier after the start.
 * A block is 256 weight rows x 128 tokens: each decoded weight feeds 128 tokens (64 today).
 * Checks small problems against a double reference (weights unpacked by src/weight_layout.c) and
 * that every output is written (NaN poison), then times dense one-expert shapes (CUDA events,
 * median of 20) in TFLOP/s against 795.
 *   build: nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Iinclude -Isrc -Isrc/cuda dev/sm90_fp4_ws_gemm_probe.cu -o probe
 * Not part of the library.
 */
#include <algorithm>
#include <vector>

#include "../src/weight_layout.c"
#include "dev_tma.cuh"
#include "gemm/fragments.cuh" /* with ptx/wgmma.cuh: */
#include "ptx/wgmma.cuh" /* a_raw, decode_a: the library's fragment decode */

#define ROWS_B 256 /* weight rows per block: two slabs, one per consumer warpgroup */
#define TOK_B 128  /* tokens per block: the wgmma N */
#define STAGES 6
#define TOK_BYTES (TOK_B * 64 * 2) /* 16 KB of f16 tokens per K step */
#define SLAB_BYTES (4096 + 512)    /* a slab's K step: codes, then scales */
#define STAGE_BYTES (TOK_BYTES + 2 * SLAB_BYTES)
#define THREADS 384
#define SMEM (STAGES * STAGE_BYTES + 1024)
static_assert(STAGE_BYTES % 1024 == 0, "each stage's token tile 1024-byte aligned (128-byte swizzle)");

/* d[64] (+)= A (64 x 16: this warp's 16 rows in a[4], mma.sync fragment order) . B (128 tokens x 16)^T */
__device__ __forceinline__ void wgmma_rs_n128(float *d, const uint32_t *a, uint64_t db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
                 :
                   MM_ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

/* out[token][row] = sum_k W[row][k] x[token][k]; W in the kernel layout (one expert, plain rows). */
__global__ void __launch_bounds__(THREADS, 1)
    fp4_ws_gemm(const __grid_constant__ CUtensorMap map_x, const uint8_t *codes, const uint8_t *sfs, float *out,
                int rows, int K, int ntok) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + ((1024 - (mm_smem_u32(smem_raw) & 1023)) & 1023); /* stays a shared pointer */
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128, nkc = K / 64;
    const int slab0 = blockIdx.x * 2, n0 = blockIdx.y * TOK_B;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mm_mbar_init(&full[s], 1), mm_mbar_init(&empty[s], 8);
        mm_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 0) { /* producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (t == 0) {
            for (int kc = 0; kc < nkc; kc++) {
                const int s = kc % STAGES;
                if (kc >= STAGES) mm_mbar_wait_parity(&empty[s], ((kc / STAGES) - 1) & 1);
                uint8_t *st = smem + s * STAGE_BYTES;
                mm_mbar_expect_tx(&full[s], STAGE_BYTES);
                mm_tma_load_2d(st, &map_x, kc * 64, n0, &full[s]);
                for (int j = 0; j < 2; j++) {
                    const size_t unit0 = (size_t)mm_layout_unit(8 * (slab0 + j), 0, nkc);
                    uint8_t *dst = st + TOK_BYTES + j * SLAB_BYTES;
                    mm_bulk_copy(dst, codes + unit0 * 512 + (size_t)kc * 4096, 4096, &full[s]);
                    mm_bulk_copy(dst + 4096, sfs + unit0 * 64 + (size_t)kc * 512, 512, &full[s]);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1, w = t / 32, lane = t % 32;
    float acc[2][64];
    auto step = [&](int kc, a_regs &a, a_regs &prev) {
        const int s = kc % STAGES;
        mm_mbar_wait_parity(&full[s], (kc / STAGES) & 1);
        const uint8_t *st = smem + s * STAGE_BYTES, *slab = st + TOK_BYTES + c * SLAB_BYTES;
        a_raw<true> raw[2];
#pragma unroll
        for (int q = 0; q < 2; q++) { /* m64 block q: groups 4q .. 4q + 3 of the slab, this warp's 4q + w */
            raw[q].w[0] = *(const uint4 *)(slab + (4 * q + w) * 512 + lane * 16);
            raw[q].sf = *(const uint2 *)(slab + 4096 + (4 * q + w) * 64 + (lane >> 2) * 8);
        }
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int k = 0; k < 4; k++) decode_a<true>(raw[q], k, a[q][k]);
        const uint64_t db = desc_sw128(st);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int q = 0; q < 2; q++) wgmma_rs_n128(acc[q], a[q][k], db + 2 * k, kc > 0 || k > 0);
        wgmma_commit();
        wgmma_wait<1>(); /* step kc - 1's group retired: its registers and its stage are free */
        keep_alive(prev);
        if (kc > 0 && lane == 0) mm_mbar_arrive(&empty[(kc - 1) % STAGES]);
    };
    a_regs a0, a1;
    int kc = 0;
    for (; kc + 1 < nkc; kc += 2) {
        step(kc, a0, a1);
        step(kc + 1, a1, a0);
    }
    if (kc < nkc) step(kc, a0, a1);
    wgmma_wait<0>();
    keep_alive(a0);
    keep_alive(a1);
    /* Accumulator (m64n128) of block q: rows 16 w + lane / 4 (+ 8) of the 64, tokens 8 j + 2 (lane % 4)
     * (+ 1) in acc[q][4 j ...]; x 2^14 undoes the biased decode of the weights. */
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int row = (slab0 + c) * 128 + 64 * q + 16 * w + lane / 4;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int tok = n0 + 8 * j + 2 * (lane % 4);
            out[(size_t)tok * rows + row] = acc[q][4 * j] * 16384.0f;
            out[(size_t)(tok + 1) * rows + row] = acc[q][4 * j + 1] * 16384.0f;
            out[(size_t)tok * rows + row + 8] = acc[q][4 * j + 2] * 16384.0f;
            out[(size_t)(tok + 1) * rows + row + 8] = acc[q][4 * j + 3] * 16384.0f;
        }
    }
}

struct dev_problem {
    int rows, K, ntok;
    uint8_t *codes, *sfs;
    __half *x;
    float *out;
    CUtensorMap map_x;
};

static dev_problem make_problem(int rows, int K, int ntok, uint32_t seed) {
    dev_problem p = {rows, K, ntok, NULL, NULL, NULL, NULL, {}};
    CK(cudaMalloc(&p.codes, (size_t)rows * K / 2));
    CK(cudaMalloc(&p.sfs, (size_t)rows * K / 16));
    CK(cudaMalloc(&p.x, (size_t)ntok * K * 2));
    CK(cudaMalloc(&p.out, (size_t)ntok * rows * 4));
    fill_bytes<<<1024, 256>>>(p.codes, (size_t)rows * K / 2, seed, 0, 0);
    fill_bytes<<<1024, 256>>>(p.sfs, (size_t)rows * K / 16, seed + 1, 0x28, 0x20);      /* E4M3 2^-2 .. 2^1.9 */
    fill_bytes<<<1024, 256>>>((uint8_t *)p.x, (size_t)ntok * K * 2, seed + 2, 0x20, 0x18); /* f16 high bytes */
    CK(cudaGetLastError());
    CK(cudaMemset(p.out, 0xFF, (size_t)ntok * rows * 4)); /* poison: NaN */
    p.map_x = tile_map_16bit(p.x, ntok, K, TOK_B, CU_TENSOR_MAP_DATA_TYPE_FLOAT16);
    return p;
}

static void launch(const dev_problem &p) {
    fp4_ws_gemm<<<dim3(p.rows / ROWS_B, p.ntok / TOK_B), THREADS, SMEM>>>(p.map_x, p.codes, p.sfs, p.out, p.rows,
                                                                           p.K, p.ntok);
}

static void free_problem(dev_problem &p) { cudaFree(p.codes), cudaFree(p.sfs), cudaFree(p.x), cudaFree(p.out); }

/* Against a double reference over every output; returns nonzero on a mismatch. */
static int check(int rows, int K, int ntok) {
    dev_problem p = make_problem(rows, K, ntok, 99);
    launch(p);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> codes((size_t)rows * K / 2), sf((size_t)rows * K / 16), uc(codes.size()), us(sf.size());
    std::vector<__half> x((size_t)ntok * K);
    std::vector<float> out((size_t)ntok * rows);
    CK(cudaMemcpy(codes.data(), p.codes, codes.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sf.data(), p.sfs, sf.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(x.data(), p.x, x.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(out.data(), p.out, out.size() * 4, cudaMemcpyDeviceToHost));
    mm_layout_unpack_nvfp4(codes.data(), sf.data(), rows, K, 0, uc.data(), us.data());
    double num = 0, den = 0;
    long unwritten = 0;
    for (int tk = 0; tk < ntok; tk++)
        for (int r = 0; r < rows; r++) {
            double ref = 0;
            for (int k = 0; k < K; k++)
                ref += (double)e2m1((uc[(size_t)r * K / 2 + k / 2] >> (4 * (k & 1))) & 15) *
                       e4m3(us[(size_t)r * K / 16 + k / 16]) * __half2float(x[(size_t)tk * K + k]);
            const double got = out[(size_t)tk * rows + r];
            if (got != got) unwritten++;
            else num += (got - ref) * (got - ref), den += ref * ref;
        }
    const double rel = sqrt(num / den);
    printf("check %d rows x %d K x %d tokens: relative L2 vs double %.2e, %ld unwritten: %s\n", rows, K, ntok, rel,
           unwritten, rel < 1e-5 && !unwritten ? "ok" : "MISMATCH");
    free_problem(p);
    return !(rel < 1e-5 && !unwritten);
}

static void timeit(const char *what, int rows, int K, int ntok) {
    dev_problem p = make_problem(rows, K, ntok, 7);
    const double med = median_ms([&] { launch(p); });
    const double tf = 2.0 * rows * K * ntok / (med * 1e-3) / 1e12;
    printf("%-34s %5d x %5d x %5d tokens: %.4f ms, %.1f TFLOP/s (%.0f%% of 795)\n", what, rows, K, ntok, med, tf,
           100.0 * tf / 795.0);
    free_problem(p);
}

int main(int argc, char **argv) {
    CK(cudaFuncSetAttribute(fp4_ws_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    int fails = check(256, 512, 128) + check(512, 1024, 256) + check(768, 2048, 128);
    if (fails) return 1;
    /* probe ROWS K TOKENS: that shape only (e.g. the rows of many experts at a forward's tokens per
     * expert, so the weights stream from DRAM as in the library's forward) */
    if (argc == 4) {
        timeit("given shape", atoi(argv[1]), atoi(argv[2]), atoi(argv[3]));
        return 0;
    }
    timeit("DSv3-like gate/up, one expert", 4096, 7168, 8192);
    timeit("DSv3-like down, one expert", 7168, 2048, 8192);
    timeit("Mixtral-like gate/up, one expert", 28672, 4096, 2048);
    timeit("Qwen3-like down, one expert", 2048, 768, 4096);
    return 0;
}
