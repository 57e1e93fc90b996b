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
 *   build: nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Isrc/cuda dev/sm90_bf16_gemm_probe.cu -o probe
 *   run:   ./probe [M N K]   (default: three shapes; M % 128, N % 256, K % 64 must be 0)
 * Not part of the library.
 */
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "dev_tma.cuh"

#define BM 128
#define BN 256
#define BK 64
#define STAGES 4
#define A_BYTES (BM * BK * 2) /* 16 KB */
#define B_BYTES (BN * BK * 2) /* 32 KB */
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define THREADS 384
#define SMEM (STAGES * STAGE_BYTES + 1024) /* + alignment of the swizzled tiles to 1024 bytes */

__device__ __forceinline__ void wgmma_256(float *d, uint64_t da, uint64_t db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db), "r"(accumulate));
}
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
                tma_load_2d(sa, &map_a, kb * BK, m0, &full[s]);
                tma_load_2d(sb, &map_b, kb * BK, n0, &full[s]);
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

static uint16_t bf16_bits(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static float bf16_val(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
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
    double worst = 0.0;
    int bad = 0;
    for (int i = 0; i < 4096; i++) {
        x = x * 1664525u + 1013904223u;
        const int m = (int)(x % (uint32_t)M);
        x = x * 1664525u + 1013904223u;
        const int n = (int)(x % (uint32_t)N);
        double ref = 0.0, mag = 0.0;
        for (int k = 0; k < K; k++) {
            const double p = (double)bf16_val(a[(size_t)m * K + k]) * bf16_val(b[(size_t)n * K + k]);
            ref += p, mag += p * p;
        }
        const double got = bf16_val(c[(size_t)m * N + n]), err = fabs(got - ref) / (fabs(ref) + sqrt(mag) + 1e-30);
        worst = std::max(worst, err);
        if (!(err < 1e-2)) bad++; /* bf16 rounding of the output: 2^-8 of |ref| */
    }
    /* Every output written (the poison is NaN). */
    long unwritten = 0;
    for (size_t i = 0; i < c.size(); i++) unwritten += (c[i] & 0x7FFF) > 0x7F80;
    const double med = median_ms([&] { bf16_gemm<<<grid, THREADS, SMEM>>>(ma, mb, (__nv_bfloat16 *)dc, M, N, K); });
    const double tf = 2.0 * M * N * K / (med * 1e-3) / 1e12;
    printf("M=%d N=%d K=%d: %s (worst %.2e of the row's magnitude, %d of 4096 samples off, %ld unwritten), "
           "median %.4f ms, %.1f TFLOP/s (%.0f%% of 795)\n",
           M, N, K, bad || unwritten ? "WRONG" : "exact to bf16", worst, bad, unwritten, med, tf, 100.0 * tf / 795.0);
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dc));
    return bad || unwritten;
}

int main(int argc, char **argv) {
    if (argc == 4) return run(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]));
    int fails = 0;
    fails += run(8192, 7168, 2048);  /* DSv3-like down projection of 8192 tokens' slots, one expert-sized K */
    fails += run(4096, 28672, 4096); /* Mixtral-like gate/up of 4096 tokens per expert */
    fails += run(512, 1536, 2048);   /* Qwen3-like gate/up of one expert's 512 tokens */
    return fails != 0;
}
