/*
 * sm90_act_f16.cu -- W4A16 (SPEC §3b) only: between the two expert GEMMs, each slot row of a rank's
 * down-projection input act (bf16 a = bf16_rn(silu(g) u), written by the gate/up epilogue) becomes
 * f16 a * 2^-e in place, with 2^e the row's power of two that puts its largest |a| in [2^15, 2^16),
 * and 2^e into the row's slot_scale (the gate/up epilogue has read the token scales there), which
 * the down epilogue multiplies back. The down GEMM then runs on the f16 tensor-core path the NVFP4
 * weights decode to. Every bf16 value of at least amax * 2^-33 converts exactly (f16 keeps 11
 * significant bits down to 2^-14 and 8 down to 2^-17; bf16 has 8); smaller ones round to f16
 * subnormals, at most amax * 2^-40 away (docs/DECISIONS.md).
 */
#include "launch.h"

#define ACT_F16_THREADS 256
#define ACT_F16_HELD 8 /* 16-byte chunks of a row a thread keeps in registers between the two passes */

/* The largest |value| of 8 bf16 values, NaN if one is. */
__device__ __forceinline__ float chunk_amax(uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
        m = mm_max_nan(m, mm_max_nan(mm_fabs(mm_bf16_to_f32((uint16_t)(w[i] & 0xFFFFu))),
                                     mm_fabs(mm_bf16_to_f32((uint16_t)(w[i] >> 16)))));
    return m;
}

/* 8 bf16 values a as f16 a * 2^-e. */
__device__ __forceinline__ uint4 chunk_to_f16(uint4 v, int e) {
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        w[i] = (uint32_t)to_f16_bits(ldexpf(mm_bf16_to_f32((uint16_t)(w[i] & 0xFFFFu)), -e)) |
               (uint32_t)to_f16_bits(ldexpf(mm_bf16_to_f32((uint16_t)(w[i] >> 16)), -e)) << 16;
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* The slot rows of rank first_rank + blockIdx.y, walked by the grid: a warp per row, or, when the rank
 * has few rows (`block_per_row`: decode, e.g. Mixtral-like T = 1 has 2 rows of 14336 values, 56
 * dependent loads deep for one warp), the whole block per row. A row that fits ACT_F16_HELD chunks per
 * thread is read once (its loads all issued before the first is used) and converted from registers;
 * a longer one is read twice. The row's largest |a| is a maximum, the same whichever threads reduce it. */
__global__ void __launch_bounds__(ACT_F16_THREADS)
    sm90_act_f16_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers, int block_per_row) {
    mm_wait_previous();
    /* The down kernel's blocks may enter now: they set up and load their first weights while this
     * kernel converts (a few rows: microseconds), and read act and slot_scale after their wait. */
    mm_launch_dependents();
    __shared__ float warp_max[ACT_F16_THREADS / 32];
    uint8_t *mine = peers[sh.first_rank + blockIdx.y];
    const int G = block_per_row ? ACT_F16_THREADS : 32, t = threadIdx.x % G,
              rows_per_block = ACT_F16_THREADS / G;
    const int n = ((const int32_t *)(mine + L.expert_offset))[sh.E_r], chunks = sh.I / 8;
    const bool held = chunks <= G * ACT_F16_HELD;
    /* row0 is the same for every thread of the block, and with a block per row so is row: the barriers
     * below are reached by the whole block or by none of it. */
    for (int row0 = blockIdx.x * rows_per_block; row0 < n; row0 += gridDim.x * rows_per_block) {
        const int row = row0 + (int)threadIdx.x / G;
        if (row >= n) continue;
        uint4 *a = (uint4 *)(mine + L.act + (size_t)row * sh.I * 2);
        uint4 v[ACT_F16_HELD];
        float amax = 0.0f;
        if (held) {
#pragma unroll
            for (int j = 0; j < ACT_F16_HELD; j++)
                v[j] = t + j * G < chunks ? a[t + j * G] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int j = 0; j < ACT_F16_HELD; j++)
                amax = mm_max_nan(amax, chunk_amax(v[j]));
        } else {
            for (int c = t; c < chunks; c += G)
                amax = mm_max_nan(amax, chunk_amax(a[c]));
        }
        for (int o = 16; o > 0; o >>= 1)
            amax = mm_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        if (block_per_row) {
            if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
            __syncthreads();
            amax = warp_max[0];
            for (int w = 1; w < ACT_F16_THREADS / 32; w++)
                amax = mm_max_nan(amax, warp_max[w]);
            __syncthreads(); /* warp_max is written again for the next row */
        }
        const int e = mm_f16_exponent(amax, -149);
        if (t == 0) ((float *)(mine + L.slot_scale))[row] = ldexpf(1.0f, e);
        if (held) {
#pragma unroll
            for (int j = 0; j < ACT_F16_HELD; j++)
                if (t + j * G < chunks) a[t + j * G] = chunk_to_f16(v[j], e);
        } else {
            for (int c = t; c < chunks; c += G)
                a[c] = chunk_to_f16(a[c], e);
        }
    }
}

megamoe_status sm90_act_f16_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                   long max_rows, cudaStream_t s) {
    int sms = 0;
    MM_CUDA_TRY(mm_device_sms(&sms));
    /* Up to two rows per SM a block each; else enough warps for every row the rank can hold, at most
     * 4 blocks per SM. */
    const int block_per_row = max_rows <= 2L * sms;
    const long warps = ACT_F16_THREADS / 32, want = block_per_row ? max_rows : (max_rows + warps - 1) / warps;
    const dim3 grid((unsigned)(want < 1 ? 1 : want < 4L * sms ? want : 4L * sms), sh.local_ranks);
    MM_CUDA_TRY(mm_launch(sm90_act_f16_kernel, grid, ACT_F16_THREADS, 0, s, sh, L, peers, block_per_row));
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
