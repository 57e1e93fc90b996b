/*
 * sm90_expert_gemm.cu -- the two expert GEMMs of SPEC §3-4 over the token tiles of every local
 * expert, weights decoded in-kernel to 16-bit and fed to the tensor cores (mma.sync m16n8k16, f32
 * accumulation):
 *   gate/up: [64 gate + 64 up weight rows] x [64 tokens] over K = H, epilogue: token scale s and
 *            alpha, clamp, SwiGLU, the static-a2 NVFP4 quantization of the down projection's input
 *            (or bf16 rounding), written to the rank's act buffer;
 *   down:    [128 rows of W2] x [64 tokens] over K = I, epilogue: a2 and alpha_2, p written into the
 *            home rank's buffer at (token, slot) through the peer table.
 * NVFP4: E2M1 x E4M3 is exact in f16 (at most 6 significant bits, 2^-10 ... 2688), so weights and
 * activations become exact f16 values and the products are exact in the f32 accumulator.
 *
 * This is the first, simple version: one 128 x 64 tile per block, no pipelining, no wgmma. The fast
 * sm_90a path (wgmma with register-A decode, see docs/CUDA_BACKEND.md) replaces it.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

#define BM 128
#define BN MM_TILE_TOKENS
#define BK 32
#define LDS (BK + 8) /* 16-bit elements per smem row: 80 bytes, conflict-free fragment loads */

enum { PHASE_GATE_UP = 0, PHASE_DOWN = 1 };

static_assert(BN == 64, "the epilogue maps 256 threads onto 64 tokens x 4 blocks of 16");

__device__ __forceinline__ uint16_t to_f16_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }

/* 8 E2M1 codes (4 bytes) times one E4M3 scale -> 8 f16 values (exact). */
__device__ __forceinline__ void decode8(uint32_t codes, uint8_t sf, uint16_t *out) {
    const float s = mm_e4m3_to_f32(sf);
    for (int j = 0; j < 8; j++) out[j] = to_f16_bits(mm_e2m1_to_f32((uint8_t)((codes >> (4 * j)) & 15u)) * s);
}

__device__ __forceinline__ void mma16816(float *d, const uint32_t *a, const uint32_t *b, bool bf16) {
    if (bf16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

struct slot_info {
    int src, token, slot;
};

__device__ __forceinline__ slot_info decode_slot(const mm_dev_shape &sh, int code) {
    slot_info s;
    s.src = code / (sh.T_max * sh.K);
    const int rem = code - s.src * sh.T_max * sh.K;
    s.token = rem / sh.K;
    s.slot = rem - s.token * sh.K;
    return s;
}

/* Gate/up epilogue: gather the tile in shared memory, then one (token, 16-block) per thread. */
__device__ __forceinline__ void gate_up_epilogue(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *mine,
                                                 const mm_dev_weights &W, int e, int first, int ncols, int row0,
                                                 float (&acc)[8][4], float *Cs, const float *col_scale) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const bool nvfp4 = sh.nvfp4 != 0;
    const int I = sh.I;
    for (int nt = 0; nt < 8; nt++)
        for (int j = 0; j < 4; j++)
            Cs[(warp * 16 + g + (j >> 1) * 8) * (BN + 1) + nt * 8 + 2 * c + (j & 1)] = acc[nt][j];
    __syncthreads();
    const int col = tid >> 2, blk = tid & 3;
    if (col >= ncols) return;
    const float s = col_scale[col];
    const float alpha_g = nvfp4 ? W.w13_alpha[e * 2] : 1.0f, alpha_u = nvfp4 ? W.w13_alpha[e * 2 + 1] : 1.0f;
    const float C = sh.clamp;
    float a[16];
    for (int j = 0; j < 16; j++) {
        float gv = Cs[(blk * 16 + j) * (BN + 1) + col], uv = Cs[(BM / 2 + blk * 16 + j) * (BN + 1) + col];
        if (nvfp4) {
            gv = mm_mul(mm_mul(gv, s), alpha_g);
            uv = mm_mul(mm_mul(uv, s), alpha_u);
        }
        if (C > 0.0f) {
            gv = fminf(gv, C);
            uv = fminf(fmaxf(uv, -C), C);
        }
        a[j] = mm_mul(mm_div(gv, mm_add(1.0f, expf(-gv))), uv);
    }
    __align__(16) uint16_t out[16];
    if (nvfp4) {
        uint8_t codes[8];
        const float sf = mm_e4m3_to_f32(mm_quantize_block16(a, W.w2_in[e], codes));
        for (int j = 0; j < 16; j++) out[j] = to_f16_bits(mm_e2m1_to_f32((uint8_t)((codes[j / 2] >> (4 * (j & 1))) & 15u)) * sf);
    } else {
        for (int j = 0; j < 16; j++) out[j] = mm_f32_to_bf16(a[j]);
    }
    uint4 *dst = (uint4 *)((uint16_t *)(mine + L.act) + (size_t)(first + col) * I + row0 + blk * 16);
    dst[0] = ((const uint4 *)out)[0];
    dst[1] = ((const uint4 *)out)[1];
}


template <int PHASE>
__global__ void __launch_bounds__(256) sm90_expert_gemm_kernel(mm_dev_shape sh, mm_buffer_layout L,
                                                                uint8_t *const *peers,
                                                                const mm_dev_weights *weights) {
    __shared__ __align__(16) uint8_t smem[BM * (BN + 1) * 4]; /* tiles, then the epilogue's f32 C */
    __shared__ int col_code[BN];
    __shared__ float col_scale[BN];
    uint16_t *As = (uint16_t *)smem;         /* [BM][LDS] */
    uint16_t *Bs = As + BM * LDS;            /* [BN][LDS] */
    float *Cs = (float *)smem;               /* [BM][BN + 1] after the main loop */

    const int r = blockIdx.z, tile = blockIdx.x, row0 = blockIdx.y * (PHASE == PHASE_GATE_UP ? BM / 2 : BM);
    uint8_t *mine = peers[r];
    if (tile >= *(const int32_t *)(mine + L.num_tiles)) return;
    const int e = ((const int32_t *)(mine + L.tile_expert))[tile];
    const int start = ((const int32_t *)(mine + L.tile_start))[tile];
    const int count = ((const int32_t *)(mine + L.expert_count))[e];
    const int first = ((const int32_t *)(mine + L.expert_offset))[e] + start; /* row of act / slots */
    const int ncols = min(BN, count - start);
    const int H = sh.H, I = sh.I, Kdim = PHASE == PHASE_GATE_UP ? H : I;
    const bool nvfp4 = sh.nvfp4 != 0;
    const mm_dev_weights W = weights[r];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;

    if (tid < BN) {
        const int code = tid < ncols ? ((const int32_t *)(mine + L.slots))[first + tid] : -1;
        col_code[tid] = code;
        float s = 1.0f;
        if (code >= 0 && nvfp4 && PHASE == PHASE_GATE_UP) {
            const slot_info si = decode_slot(sh, code);
            s = ((const float *)(peers[si.src] + L.x_scale))[si.token];
        }
        col_scale[tid] = s;
    }
    __syncthreads();

    float acc[8][4];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;

    /* This thread's A row (weights) and B row (tokens) for the tile loads. */
    const int a_row = tid >> 1, a_half = tid & 1;
    const size_t w_row = PHASE == PHASE_GATE_UP
                             ? (size_t)e * 2 * I + (a_row < BM / 2 ? row0 + a_row : I + row0 + a_row - BM / 2)
                             : (size_t)e * H + row0 + a_row;
    const int b_row = tid >> 2, b_q = tid & 3;
    const int b_code = col_code[b_row];
    const uint8_t *b_src = nullptr;
    if (b_code >= 0) {
        if (PHASE == PHASE_GATE_UP) b_src = peers[decode_slot(sh, b_code).src];
    }
    const int b_token = b_code >= 0 && PHASE == PHASE_GATE_UP ? decode_slot(sh, b_code).token : 0;

    for (int k0 = 0; k0 < Kdim; k0 += BK) {
        /* A: 16 weights of row a_row from k0 + 16 * a_half. */
        uint16_t *as = As + a_row * LDS + a_half * 16;
        if (nvfp4) {
            const uint8_t *codes = (PHASE == PHASE_GATE_UP ? W.w13 : W.w2) + w_row * Kdim / 2 + k0 / 2 + a_half * 8;
            const uint8_t sf = (PHASE == PHASE_GATE_UP ? W.w13_sf : W.w2_sf)[w_row * Kdim / 16 + k0 / 16 + a_half];
            const uint2 cw = *(const uint2 *)codes;
            decode8(cw.x, sf, as);
            decode8(cw.y, sf, as + 8);
        } else {
            const uint4 *src = (const uint4 *)((PHASE == PHASE_GATE_UP ? W.w13_bf16 : W.w2_bf16) + w_row * Kdim + k0 +
                                               a_half * 16);
            ((uint4 *)as)[0] = src[0];
            ((uint4 *)as)[1] = src[1];
        }
        /* B: 8 values of token row b_row from k0 + 8 * b_q. */
        uint16_t *bs = Bs + b_row * LDS + b_q * 8;
        if (b_code < 0) {
            *(uint4 *)bs = make_uint4(0, 0, 0, 0);
        } else if (PHASE == PHASE_DOWN) {
            *(uint4 *)bs = *(const uint4 *)((const uint16_t *)(mine + L.act) + (size_t)(first + b_row) * I + k0 + b_q * 8);
        } else if (nvfp4) {
            const uint32_t cw = *(const uint32_t *)(b_src + L.x + (size_t)b_token * H / 2 + k0 / 2 + b_q * 4);
            const uint8_t sf = (b_src + L.x_sf)[(size_t)b_token * H / 16 + k0 / 16 + b_q / 2];
            decode8(cw, sf, bs);
        } else {
            *(uint4 *)bs = *(const uint4 *)((const uint16_t *)(b_src + L.x) + (size_t)b_token * H + k0 + b_q * 8);
        }
        __syncthreads();
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t a[4];
            const uint16_t *ar = As + (warp * 16 + g) * LDS + kk + 2 * c;
            a[0] = *(const uint32_t *)ar;
            a[1] = *(const uint32_t *)(ar + 8 * LDS);
            a[2] = *(const uint32_t *)(ar + 8);
            a[3] = *(const uint32_t *)(ar + 8 * LDS + 8);
            for (int nt = 0; nt < 8; nt++) {
                uint32_t b[2];
                const uint16_t *br = Bs + (nt * 8 + g) * LDS + kk + 2 * c;
                b[0] = *(const uint32_t *)br;
                b[1] = *(const uint32_t *)(br + 8);
                mma16816(acc[nt], a, b, !nvfp4);
            }
        }
        __syncthreads();
    }

    if constexpr (PHASE == PHASE_DOWN) {
        const float a2 = nvfp4 ? W.w2_in[e] : 1.0f, alpha2 = nvfp4 ? W.w2_alpha[e] : 1.0f;
        for (int nt = 0; nt < 8; nt++) {
            for (int j = 0; j < 4; j++) {
                const int col = nt * 8 + 2 * c + (j & 1), row = warp * 16 + g + (j >> 1) * 8;
                if (col >= ncols) continue;
                const slot_info si = decode_slot(sh, col_code[col]);
                float p = acc[nt][j];
                if (nvfp4) p = mm_mul(mm_mul(p, a2), alpha2);
                ((float *)(peers[si.src] + L.p))[((size_t)si.token * sh.K + si.slot) * H + row0 + row] = p;
            }
        }
    } else {
        gate_up_epilogue(sh, L, mine, W, e, first, ncols, row0, acc, Cs, col_scale);
    }
}

megamoe_status sm90_expert_gemm_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                       const mm_dev_weights *weights, cudaStream_t s) {
    if (L.max_tiles <= 0) return MEGAMOE_OK;
    sm90_expert_gemm_kernel<PHASE_GATE_UP><<<dim3(L.max_tiles, sh.I / (BM / 2), sh.R), 256, 0, s>>>(sh, L, peers,
                                                                                                   weights);
    MM_CUDA_TRY(cudaGetLastError());
    sm90_expert_gemm_kernel<PHASE_DOWN><<<dim3(L.max_tiles, sh.H / BM, sh.R), 256, 0, s>>>(sh, L, peers, weights);
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
