/*
 * sm90_stage.cu -- a rank's tokens into its buffer: ids and weights, token state, and the NVFP4
 * activation quantization of SPEC §3 (bit-identical to the CPU: the same formats.h code), or a copy
 * of x for BF16. Bad expert ids are counted and the first (rank, token, slot) kept.
 * One block per token.
 */
#include "common.cuh"

__global__ void sm90_stage_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *base, uint8_t *err_base, int rank,
                                  mm_dev_rank_args a) {
    __shared__ float scratch[32];
    const int t = blockIdx.x, K = sh.K, H = sh.H;
    if (t == 0 && threadIdx.x == 0) *(int32_t *)(base + L.num_tokens) = a.T;
    if (t >= a.T) return;
    int32_t *ids = (int32_t *)(base + L.topk_ids);       /* [T_max, K] */
    float *weights = (float *)(base + L.topk_weights);   /* [T_max, K] */
    uint8_t *state = base + L.token_state;               /* [T_max]    */
    const bool pad = a.padding && a.padding[t];
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const int id = a.ids[(size_t)t * K + k];
        ids[(size_t)t * K + k] = id;
        weights[(size_t)t * K + k] = a.weights[(size_t)t * K + k];
        if (!pad && (id < -1 || id >= sh.E)) {
            const unsigned long long key = ((unsigned long long)(((uint32_t)rank * sh.T_max + t) * K + k) << 32) |
                                           (uint32_t)id;
            atomicMin((unsigned long long *)(err_base + L.error), key);
            atomicAdd((unsigned int *)(err_base + L.error + 8), 1u);
        }
    }
    if (pad) {
        if (threadIdx.x == 0) state[t] = MM_TOKEN_PADDING;
        return;
    }
    const uint16_t *x = a.x + (size_t)t * H; /* [H] bf16 */
    int finite = 1;
    float amax = 0.0f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        const float v = mm_bf16_to_f32(x[h]);
        finite &= mm_isfinite(v);
        amax = fmaxf(amax, mm_fabs(v)); /* exact; finite tokens only use it */
    }
    finite = __syncthreads_and(finite);
    amax = mm_block_max(amax, scratch);
    if (!finite) {
        if (threadIdx.x == 0) state[t] = MM_TOKEN_POISONED;
        return;
    }
    if (threadIdx.x == 0) state[t] = MM_TOKEN_LIVE;
    if (!sh.nvfp4) {
        uint16_t *dst = (uint16_t *)(base + L.x) + (size_t)t * H;
        for (int h = threadIdx.x; h < H; h += blockDim.x) dst[h] = x[h];
        return;
    }
    const float s = mm_activation_scale(amax);
    if (threadIdx.x == 0) ((float *)(base + L.x_scale))[t] = s;
    uint8_t *codes = base + L.x + (size_t)t * H / 2;  /* [H/2]  */
    uint8_t *sf = base + L.x_sf + (size_t)t * H / 16; /* [H/16] */
    uint4 *x16 = (uint4 *)((uint16_t *)(base + L.x_f16) + (size_t)t * H); /* [H] biased f16 */
    for (int b = threadIdx.x; b < H / 16; b += blockDim.x) {
        float block[16];
        for (int i = 0; i < 16; i++) block[i] = mm_bf16_to_f32(x[b * 16 + i]);
        sf[b] = mm_quantize_block16(block, s, codes + b * 8);
        /* The gate/up GEMM's operand, decoded once here instead of in every block that reads it. */
        const uint2 cw = *(const uint2 *)(codes + b * 8);
        x16[2 * b] = decode8_biased(cw.x, sf[b]);
        x16[2 * b + 1] = decode8_biased(cw.y, sf[b]);
    }
}

megamoe_status sm90_stage_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *base, uint8_t *err_base,
                                 int rank, const mm_dev_rank_args &a, cudaStream_t s) {
    const int blocks = a.T > 0 ? a.T : 1; /* block 0 also writes the token count */
    sm90_stage_kernel<<<blocks, 256, 0, s>>>(sh, L, base, err_base, rank, a);
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
