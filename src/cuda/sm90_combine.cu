/*
 * sm90_combine.cu -- on the home rank: the post-expert RMSNorm of each slot's p and the weighted sum
 * in ascending slot order (SPEC §5), y = bf16_rn(sum_j w_j * (p_j * rms_j) * gamma). Padding tokens
 * get zeros, non-finite ones NaN. One block per token; each thread owns 4-float columns of every
 * slot row, so all of a token's loads are in flight at once.
 * The last combine of a forward also hands the forward's error words (bad ids, a late peer) to the
 * host through mapped pinned memory and resets them for the next forward, so a forward needs no
 * memset or copy nodes around its kernels.
 */
#include "common.cuh"

__global__ void sm90_combine_kernel(mm_dev_shape sh, mm_buffer_layout L, const uint8_t *base, const float *gamma,
                                    mm_dev_rank_args a, uint8_t *err_words, uint8_t *host_err) {
    mm_wait_previous();
    if (host_err && blockIdx.x == 0 && threadIdx.x == 0) { /* every writer of the words has finished */
        uint4 *words = (uint4 *)err_words;
        *(uint4 *)host_err = *words;
        *words = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0u, 0u); /* first bad key: none; counts: 0 */
    }
    __shared__ float partial[32][33]; /* [slot][warp] sums of squares */
    __shared__ float rms[32];
    const int t = blockIdx.x, K = sh.K, H = sh.H, H4 = H / 4;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    if (t >= a.T) return;
    uint16_t *y = a.y + (size_t)t * H;
    const uint8_t state = (base + L.token_state)[t];
    if (state != MM_TOKEN_LIVE) {
        const uint32_t fill = state == MM_TOKEN_POISONED ? 0x7FC07FC0u : 0u;
        for (int i = threadIdx.x; i < H / 8; i += blockDim.x) ((uint4 *)y)[i] = make_uint4(fill, fill, fill, fill);
        return;
    }
    /* The slots' ids and weights first, so the loads of p below do not wait on them one by one. */
    __shared__ int live[32];
    __shared__ float wt[32];
    if (threadIdx.x < K) {
        const int id = ((const int32_t *)(base + L.topk_ids))[(size_t)t * K + threadIdx.x];
        live[threadIdx.x] = id >= 0 && id < sh.E;
        wt[threadIdx.x] = ((const float *)(base + L.topk_weights))[(size_t)t * K + threadIdx.x];
    }
    __syncthreads();
    const float4 *p = (const float4 *)((const float *)(base + L.p) + (size_t)t * K * H); /* [K, H/4] */
    if (gamma) {
        /* Sums of squares: per thread in column order, per warp by shuffles, then per slot over the
         * warps in warp order (one barrier for all slots). */
#pragma unroll 8
        for (int k = 0; k < K; k++) {
            float ss = 0.0f;
            if (live[k])
                for (int i = threadIdx.x; i < H4; i += blockDim.x) {
                    const float4 v = p[(size_t)k * H4 + i];
                    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                }
            ss = mm_warp_sum(ss);
            if (lane == 0) partial[k][warp] = ss;
        }
        __syncthreads();
        if (threadIdx.x < K) {
            float ss = 0.0f;
            for (int i = 0; i < nwarps; i++) ss += partial[threadIdx.x][i];
            rms[threadIdx.x] = 1.0f / sqrtf(ss / (float)H + sh.eps);
        }
        __syncthreads();
    }
    const float4 *g4 = (const float4 *)gamma;
    for (int i = threadIdx.x; i < H4; i += blockDim.x) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float4 gv = gamma ? g4[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        const float gm[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll 8
        for (int k = 0; k < K; k++) {
            if (!live[k]) continue;
            const float4 v = p[(size_t)k * H4 + i];
            const float pv[4] = {v.x, v.y, v.z, v.w};
            const float wk = wt[k];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float pk = pv[j];
                if (gamma) pk = mm_mul(mm_mul(pk, rms[k]), gm[j]);
                acc[j] = mm_add(acc[j], mm_mul(wk, pk));
            }
        }
        uint2 out;
        out.x = (uint32_t)mm_f32_to_bf16(acc[0]) | ((uint32_t)mm_f32_to_bf16(acc[1]) << 16);
        out.y = (uint32_t)mm_f32_to_bf16(acc[2]) | ((uint32_t)mm_f32_to_bf16(acc[3]) << 16);
        ((uint2 *)y)[i] = out;
    }
}

megamoe_status sm90_combine_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, const uint8_t *base,
                                   const float *gamma, const mm_dev_rank_args &a, uint8_t *err_words,
                                   uint8_t *host_err, cudaStream_t s) {
    if (a.T == 0 && !host_err) return MEGAMOE_OK;
    /* A thread per 16 columns (448 for H = 7168): four 16-byte loads per slot row each. */
    const int n = sh.H / 16, threads = n < 64 ? 64 : n > 1024 ? 1024 : (n + 31) / 32 * 32;
    MM_CUDA_TRY(mm_launch(sm90_combine_kernel, a.T > 0 ? a.T : 1, threads, 0, s, sh, L, base, gamma, a, err_words, host_err));
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
