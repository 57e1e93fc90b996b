/*
 * sm90_combine.cu -- on the home rank: the post-expert RMSNorm of each slot's p and the weighted sum
 * in ascending slot order (SPEC §5), y = bf16_rn(sum_j w_j * (p_j * rms_j) * gamma). Padding tokens
 * get zeros, non-finite ones NaN. One block per token.
 */
#include "common.cuh"

__global__ void sm90_combine_kernel(mm_dev_shape sh, mm_buffer_layout L, const uint8_t *base, const float *gamma,
                                    mm_dev_rank_args a) {
    __shared__ float scratch[32];
    __shared__ float rms[32];
    const int t = blockIdx.x, K = sh.K, H = sh.H;
    if (t >= a.T) return;
    uint16_t *y = a.y + (size_t)t * H;
    const uint8_t state = (base + L.token_state)[t];
    if (state != MM_TOKEN_LIVE) {
        const uint16_t fill = state == MM_TOKEN_POISONED ? 0x7FC0 : 0x0000;
        for (int h = threadIdx.x; h < H; h += blockDim.x) y[h] = fill;
        return;
    }
    const int32_t *ids = (const int32_t *)(base + L.topk_ids) + (size_t)t * K;
    const float *w = (const float *)(base + L.topk_weights) + (size_t)t * K;
    const float *p = (const float *)(base + L.p) + (size_t)t * K * H; /* [K, H] */
    for (int k = 0; k < K; k++) {
        const int id = ids[k];
        if (id < 0 || id >= sh.E || !gamma) continue; /* uniform over the block */
        float ss = 0.0f;
        for (int h = threadIdx.x; h < H; h += blockDim.x) ss += p[(size_t)k * H + h] * p[(size_t)k * H + h];
        ss = mm_block_sum(ss, scratch);
        if (threadIdx.x == 0) rms[k] = 1.0f / sqrtf(ss / (float)H + sh.eps);
    }
    __syncthreads();
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < K; k++) {
            const int id = ids[k];
            if (id < 0 || id >= sh.E) continue;
            float pk = p[(size_t)k * H + h];
            if (gamma) pk = mm_mul(mm_mul(pk, rms[k]), gamma[h]);
            acc = mm_add(acc, mm_mul(w[k], pk));
        }
        y[h] = mm_f32_to_bf16(acc);
    }
}

megamoe_status sm90_combine_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, const uint8_t *base,
                                   const float *gamma, const mm_dev_rank_args &a, cudaStream_t s) {
    if (a.T == 0) return MEGAMOE_OK;
    sm90_combine_kernel<<<a.T, 256, 0, s>>>(sh, L, base, gamma, a);
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
