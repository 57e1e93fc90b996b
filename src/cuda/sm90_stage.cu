/*
 * sm90_stage.cu -- a rank's tokens into its buffer: ids and weights, token state, and the NVFP4
 * activation quantization of SPEC §3 (bit-identical to the CPU: the same formats.h code), or a copy
 * of x for BF16. Bad expert ids are counted and the first (rank, token, slot) kept.
 * One block per token, a thread per 16-value block.
 */
#include "launch.h"
#include "ptx/barrier.cuh"
#include "route.cuh"

/* The staging threads: the whole block (RW false), or all but the last warp of a one-token forward
 * whose last warp routes (RW true: sm90_stage_kernel); theirs is then named barrier 1 over nq
 * threads. The RW-false instantiation is the plain block-barrier code. */
template <bool RW> __device__ __forceinline__ void stage_sync(int nq) {
    if (RW)
        mm_bar_sync<1>(nq);
    else
        __syncthreads();
}
template <bool RW> __device__ __forceinline__ int stage_sync_and(int nq, int pred) {
    if (!RW) return __syncthreads_and(pred);
    return mm_bar_and<1>(nq, pred);
}
/* Max over the nq staging threads (a multiple of 32): warp maxima through scratch[32]. */
template <bool RW> __device__ __forceinline__ float stage_max(float v, float *scratch /* [32] */, int nq) {
    v = mm_warp_max(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    stage_sync<RW>(nq);
    if (lane == 0) scratch[warp] = v;
    stage_sync<RW>(nq);
    float m = 0.0f;
    for (int w = 0; w < nq / 32; w++)
        m = fmaxf(m, scratch[w]);
    return m;
}

/* A one-token forward's hand-off from the staging threads to the routing warp (named barrier 2 over
 * the whole block): whether the token is routed (live) and its activation scale. Every staging
 * thread passes it exactly once, on one of three paths (a token past T, padding, the rest): the
 * barrier is the non-aligned form (ptx/barrier.cuh), which a warp may reach from different call
 * sites. A sync on both sides, not an arrive on the staging side: compute-sanitizer's racecheck
 * reports the arrive-then-read as hazards, and the routing warp reaches the barrier right after its
 * ids load, long before the staging threads (an x load and an amax reduction later), so the staging
 * threads do not wait on it. */
struct stage_handoff {
    int live;
    float scale;
};
template <bool RW>
__device__ __forceinline__ void stage_hand_over(stage_handoff *h, int nq, int live, float scale) {
    if (!RW) return;
    if (threadIdx.x == 0) {
        h->live = live;
        h->scale = scale;
    }
    mm_bar_sync<2>(nq + 32);
}

/* h: the routing warp's hand-off (RW: a one-token forward with a routing warp), else unused. */
template <bool RW>
__device__ __forceinline__ void stage_token(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *base,
                                            uint8_t *err_base, int rank, const mm_dev_rank_args &a, int nq,
                                            stage_handoff *h) {
    __shared__ float scratch[32];
    const int t = blockIdx.x, K = sh.K, H = sh.H;
    if (t == 0 && threadIdx.x == 0) *(int32_t *)(base + L.num_tokens) = a.T;
    if (t >= a.T) {
        stage_hand_over<RW>(h, nq, 0, 1.0f);
        return;
    }
    /* This thread's first 16-value block of the token, loaded before the ids and the padding flag:
     * its memory latency then overlaps theirs instead of following the padding branch (a padded
     * token's row is read and not used). */
    const uint16_t *x = a.x + (size_t)t * H; /* [H] bf16 */
    const int nblocks = H / 16;
    uint4 first0 = make_uint4(0, 0, 0, 0), first1 = first0;
    if ((int)threadIdx.x < nblocks) {
        const uint4 *src = (const uint4 *)(x + threadIdx.x * 16);
        first0 = src[0];
        first1 = src[1];
    }
    int32_t *ids = (int32_t *)(base + L.topk_ids);     /* [T_max, K] */
    float *weights = (float *)(base + L.topk_weights); /* [T_max, K] */
    uint8_t *state = base + L.token_state;             /* [T_max]    */
    const bool pad = a.padding && a.padding[t];
    for (int k = threadIdx.x; k < K; k += nq) {
        const int id = a.ids[(size_t)t * K + k];
        const float w = a.weights[(size_t)t * K + k]; /* both loads before the stores, which may alias */
        ids[(size_t)t * K + k] = id;
        weights[(size_t)t * K + k] = w;
        if (!pad && (id < -1 || id >= sh.E)) {
            const unsigned long long key =
                ((unsigned long long)(((uint32_t)rank * sh.T_max + t) * K + k) << 32) | (uint32_t)id;
            atomicMin((unsigned long long *)(err_base + L.error), key);
            atomicAdd((unsigned int *)(err_base + L.error + 8), 1u);
        }
    }
    if (pad) {
        if (threadIdx.x == 0) state[t] = MM_TOKEN_PADDING;
        stage_hand_over<RW>(h, nq, 0, 1.0f);
        return;
    }
    /* Each thread owns whole 16-value blocks, read as two 16-byte loads: one pass issues every load
     * of the token at once (a strided scalar pass waited for memory ~28 times in a row). */
    int finite = 1;
    float amax = 0.0f;
    for (int b = threadIdx.x; b < nblocks; b += nq) {
        uint4 v0 = first0, v1 = first1;
        if (b != (int)threadIdx.x) {
            const uint4 *src = (const uint4 *)(x + b * 16);
            v0 = src[0];
            v1 = src[1];
        }
        const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float lo = mm_bf16_to_f32((uint16_t)(w[i] & 0xFFFFu)),
                        hi = mm_bf16_to_f32((uint16_t)(w[i] >> 16));
            finite &= mm_isfinite(lo) & mm_isfinite(hi);
            amax = fmaxf(amax, fmaxf(mm_fabs(lo), mm_fabs(hi))); /* exact; finite tokens only use it */
        }
    }
    finite = stage_sync_and<RW>(nq, finite);
    amax = stage_max<RW>(amax, scratch, nq);
    /* The token's activation scale: NVFP4's s (SPEC §3), or with bf16 activations (W4A16, §3b) the
     * power of two of its exact f16 copy times the 2^-14 that the gate/up epilogue's 2^28 undoes
     * (e16 >= -135 keeps it >= 2^-149; a token small enough to meet that bound still has each nonzero
     * bf16 value at 4 or more in f16, so exact). */
    const int e16 = sh.bf16_act ? mm_f16_exponent(amax, -135) : 0;
    const float s = !sh.nvfp4 ? 1.0f : sh.bf16_act ? ldexpf(1.0f, e16 - 14) : mm_activation_scale(amax);
    stage_hand_over<RW>(h, nq, finite, s);
    if (!finite) {
        if (threadIdx.x == 0) state[t] = MM_TOKEN_POISONED;
        return;
    }
    if (threadIdx.x == 0) state[t] = MM_TOKEN_LIVE;
    if (!sh.nvfp4) {
        uint4 *dst = (uint4 *)((uint16_t *)(base + L.x) + (size_t)t * H);
        for (int i = threadIdx.x; i < H / 8; i += nq)
            dst[i] = ((const uint4 *)x)[i];
        return;
    }
    if (threadIdx.x == 0) ((float *)(base + L.x_scale))[t] = s;
    if (sh.bf16_act) { /* x itself for the gate/up GEMM: f16 x * 2^-e16, exact */
        uint4 *x16 = (uint4 *)((uint16_t *)(base + L.x_f16) + (size_t)t * H);
        for (int i = threadIdx.x; i < H / 8; i += nq) {
            const uint4 v = ((const uint4 *)x)[i];
            uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++)
                w[j] = (uint32_t)to_f16_bits(ldexpf(mm_bf16_to_f32((uint16_t)(w[j] & 0xFFFFu)), -e16)) |
                       (uint32_t)to_f16_bits(ldexpf(mm_bf16_to_f32((uint16_t)(w[j] >> 16)), -e16)) << 16;
            x16[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
        return;
    }
    uint8_t *codes = base + L.x + (size_t)t * H / 2;                      /* [H/2]  */
    uint8_t *sf = base + L.x_sf + (size_t)t * H / 16;                     /* [H/16] */
    uint4 *x16 = (uint4 *)((uint16_t *)(base + L.x_f16) + (size_t)t * H); /* [H] biased f16 */
    for (int b = threadIdx.x; b < nblocks; b += nq) {
        const uint4 *src = (const uint4 *)(x + b * 16); /* in L1 from the first pass */
        const uint4 v0 = src[0], v1 = src[1];
        const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        float block[16];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            block[2 * i] = mm_bf16_to_f32((uint16_t)(w[i] & 0xFFFFu));
            block[2 * i + 1] = mm_bf16_to_f32((uint16_t)(w[i] >> 16));
        }
        uint2 cw;
        const uint8_t bsf = mm_quantize_block16(block, s, (uint8_t *)&cw);
        sf[b] = bsf;
        ((uint2 *)codes)[b] = cw;
        /* The gate/up GEMM's operand, decoded once here instead of in every block that reads it. */
        x16[2 * b] = decode8_biased(cw.x, bsf);
        x16[2 * b + 1] = decode8_biased(cw.y, bsf);
    }
}

/* One block per token. RW (plan_route ROUTE_WARP: a one-token forward of one rank): the block's last
 * warp builds the routing tables from the token's ids while the other threads stage it
 * (route_one_warp), instead of a routing kernel after it: the routing then overlaps the
 * quantization. */
template <bool RW>
__global__ void sm90_stage_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *base, uint8_t *err_base,
                                  int rank, mm_dev_rank_args a) {
    mm_wait_previous();
    if (RW) {
        __shared__ stage_handoff handoff;
        const int nq = blockDim.x - 32;
        if ((int)threadIdx.x < nq) {
            stage_token<true>(sh, L, base, err_base, rank, a, nq, &handoff);
            return;
        }
        /* The routing warp: the token's ids now (their latency beside the x loads), its liveness
         * and scale once the staging threads hand them over. */
        const int lane = threadIdx.x & 31;
        int id = -1;
        if (a.T > 0 && lane < sh.K) id = a.ids[lane];
        mm_bar_sync<2>(nq + 32);
        route_one_warp(sh, L, base, handoff.live ? id : -1, handoff.scale);
        return;
    }
    stage_token<false>(sh, L, base, err_base, rank, a, blockDim.x, NULL);
}

megamoe_status sm90_stage_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *base,
                                 uint8_t *err_base, int rank, const mm_dev_rank_args &a, bool route_warp,
                                 cudaStream_t s) {
    const int blocks = a.T > 0 ? a.T : 1; /* block 0 also writes the token count */
    const int threads = plan_stage_threads(sh.H);
    if (route_warp)
        MM_CUDA_TRY(
            mm_launch(sm90_stage_kernel<true>, blocks, threads + 32, 0, s, sh, L, base, err_base, rank, a));
    else
        MM_CUDA_TRY(
            mm_launch(sm90_stage_kernel<false>, blocks, threads, 0, s, sh, L, base, err_base, rank, a));
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
