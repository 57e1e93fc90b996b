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

/* One warp per slot row of rank first_rank + blockIdx.y (rows walked by the grid). */
__global__ void __launch_bounds__(ACT_F16_THREADS) sm90_act_f16_kernel(mm_dev_shape sh, mm_buffer_layout L,
                                                                       uint8_t *const *peers) {
    mm_wait_previous();
    uint8_t *mine = peers[sh.first_rank + blockIdx.y];
    const int lane = threadIdx.x & 31, warps = ACT_F16_THREADS / 32;
    const int n = ((const int32_t *)(mine + L.expert_offset))[sh.E_r], chunks = sh.I / 8;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < n; row += gridDim.x * warps) {
        uint4 *a = (uint4 *)(mine + L.act + (size_t)row * sh.I * 2);
        float amax = 0.0f;
        for (int c = lane; c < chunks; c += 32) {
            const uint4 v = a[c];
            const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
                amax = mm_max_nan(amax, mm_max_nan(mm_fabs(mm_bf16_to_f32((uint16_t)(w[i] & 0xFFFFu))),
                                                   mm_fabs(mm_bf16_to_f32((uint16_t)(w[i] >> 16)))));
        }
        for (int o = 16; o > 0; o >>= 1) amax = mm_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        const int e = mm_f16_exponent(amax, -149);
        if (lane == 0) ((float *)(mine + L.slot_scale))[row] = ldexpf(1.0f, e);
        for (int c = lane; c < chunks; c += 32) {
            const uint4 v = a[c];
            uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
                w[i] = (uint32_t)to_f16_bits(ldexpf(mm_bf16_to_f32((uint16_t)(w[i] & 0xFFFFu)), -e)) |
                       (uint32_t)to_f16_bits(ldexpf(mm_bf16_to_f32((uint16_t)(w[i] >> 16)), -e)) << 16;
            a[c] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

megamoe_status sm90_act_f16_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                   long max_rows, cudaStream_t s) {
    int sms = 0;
    MM_CUDA_TRY(mm_device_sms(&sms));
    /* Enough warps for every slot row the rank can hold, at most 4 blocks per SM. */
    const long warps = ACT_F16_THREADS / 32, want = (max_rows + warps - 1) / warps;
    const dim3 grid((unsigned)(want < 1 ? 1 : want < 4L * sms ? want : 4L * sms), sh.local_ranks);
    MM_CUDA_TRY(mm_launch(sm90_act_f16_kernel, grid, ACT_F16_THREADS, 0, s, sh, L, peers));
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
