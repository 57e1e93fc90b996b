/*
 * sm90_combine.cu -- on the home rank: the post-expert RMSNorm of each slot's p and the weighted sum
 * in ascending slot order (SPEC §5), y = bf16_rn(sum_j w_j * (p_j * rms_j) * gamma). Padding tokens
 * get zeros, non-finite ones NaN.
 * A slot's sum of squares is taken in one fixed order whatever the launch: per 128-column chunk by
 * one warp (lane l squares and adds the 4 floats at 4 l, then a shuffle tree), then the chunk sums
 * added in chunk order by one thread. So the two forms below give the same bits, and y stays bitwise
 * independent of how the tokens are split over ranks (each rank picks its form from its own count):
 *   - many tokens: one block per token;
 *   - few tokens (gemm_plan.h plan_combine): a cluster of MM_COMBINE_CLUSTER blocks per token,
 *     block b taking a b-th of the chunks for both passes; the chunk sums are read across the cluster
 *     through distributed shared memory. At T = 1 this spreads a token's K rows of p (229 KB for
 *     DSv3) over 8 SMs instead of one.
 * The last combine of a forward also hands the forward's error words (bad ids, a late peer) to the
 * host through mapped pinned memory and resets them for the next forward, so a forward needs no
 * memset or copy nodes around its kernels.
 */
#include <cooperative_groups.h>

#include "launch.h"

namespace cg = cooperative_groups;

/* Sum of squares of the 128 floats of chunk c of a p row, in the canonical order (every lane gets it). */
__device__ __forceinline__ float chunk_ssq(const float4 *row, int c, int lane) {
    const float4 v = row[c * 32 + lane];
    return mm_warp_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w);
}

template <bool CLUSTER>
__global__ void sm90_combine_kernel(mm_dev_shape sh, mm_buffer_layout L, const uint8_t *base,
                                    const float *gamma, mm_dev_rank_args a, uint8_t *err_words,
                                    uint8_t *host_err) {
    extern __shared__ float css[]; /* [K][H / 128] chunk sums of squares (this block's chunks) */
    __shared__ float rms[32];
    __shared__ int live[32];
    __shared__ float wt[32];
    const int K = sh.K, H = sh.H, nch = H / 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int t = CLUSTER ? blockIdx.x / MM_COMBINE_CLUSTER : blockIdx.x;
    const int b = CLUSTER ? blockIdx.x % MM_COMBINE_CLUSTER : 0, nb = CLUSTER ? MM_COMBINE_CLUSTER : 1;
    /* This block's chunks [c0, c1) (both passes); t and the token's state are the same for the
     * whole cluster, so every block of it leaves here or none does. */
    const int c0 = b * nch / nb, c1 = (b + 1) * nch / nb;
    /* Before the wait: the token's state and its slots' ids and weights, the stage kernel's output
     * (kernels before the down projection, which lets this kernel in only after its own wait:
     * st_wait_for_inputs) -- so the loads of p below do not wait on them. */
    uint8_t state = MM_TOKEN_PADDING;
    if (t < a.T) {
        state = (base + L.token_state)[t];
        if (threadIdx.x < K) {
            const int id = ((const int32_t *)(base + L.topk_ids))[(size_t)t * K + threadIdx.x];
            live[threadIdx.x] = id >= 0 && id < sh.E;
            wt[threadIdx.x] = ((const float *)(base + L.topk_weights))[(size_t)t * K + threadIdx.x];
        }
    }
    mm_wait_previous();
    if (host_err && blockIdx.x == 0 && threadIdx.x == 0) { /* every writer of the words has finished */
        uint4 *words = (uint4 *)err_words;
        *(uint4 *)host_err = *words;
        *words = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0u, 0u); /* first bad key: none; counts: 0 */
    }
    if (t >= a.T) return;
    uint16_t *y = a.y + (size_t)t * H;
    if (state != MM_TOKEN_LIVE) {
        const uint32_t fill = state == MM_TOKEN_POISONED ? 0x7FC07FC0u : 0u;
        for (int i = c0 * 16 + threadIdx.x; i < c1 * 16; i += blockDim.x)
            ((uint4 *)y)[i] = make_uint4(fill, fill, fill, fill);
        return;
    }
    __syncthreads(); /* the slots' ids and weights */
    const float4 *p = (const float4 *)((const float *)(base + L.p) + (size_t)t * K * H); /* [K, H/4] */
    const int H4 = H / 4;
    if (gamma) {
        for (int k = 0; k < K; k++) {
            if (!live[k]) continue;
            for (int c = c0 + warp; c < c1; c += nwarps) {
                const float s = chunk_ssq(p + (size_t)k * H4, c, lane);
                if (lane == 0) css[k * nch + c] = s;
            }
        }
        if constexpr (CLUSTER) {
            cg::cluster_group cluster = cg::this_cluster();
            cluster.sync(); /* every block's chunk sums are written */
            if (threadIdx.x < K && live[threadIdx.x]) {
                float ss = 0.0f;
                for (int owner = 0; owner < nb; owner++) {
                    const float *theirs = cluster.map_shared_rank(css, owner);
                    for (int c = owner * nch / nb; c < (owner + 1) * nch / nb; c++)
                        ss += theirs[threadIdx.x * nch + c];
                }
                rms[threadIdx.x] = 1.0f / sqrtf(ss / (float)H + sh.eps);
            }
            cluster.sync(); /* no block leaves (or rewrites) while another still reads its sums */
        } else {
            __syncthreads();
            if (threadIdx.x < K && live[threadIdx.x]) {
                float ss = 0.0f;
                for (int c = 0; c < nch; c++)
                    ss += css[threadIdx.x * nch + c];
                rms[threadIdx.x] = 1.0f / sqrtf(ss / (float)H + sh.eps);
            }
            __syncthreads();
        }
    }
    const float4 *g4 = (const float4 *)gamma;
    for (int i = c0 * 32 + threadIdx.x; i < c1 * 32; i += blockDim.x) {
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

/* The chunk sums take K x H / 128 floats of dynamic shared memory: opted in at finalize, on the
 * layer's device, outside any capture. The opt-in is the device's, per kernel, shared by every layer
 * on it: it is raised to what this layer needs, never lowered below what the device already allows
 * another (read back from the runtime, which holds it). */
megamoe_status sm90_combine_prepare(int K, int H) {
    const int bytes = K * (H / 128) * 4;
    if (bytes <= 48 * 1024) return MEGAMOE_OK;
    const void *forms[2] = {(const void *)sm90_combine_kernel<false>,
                            (const void *)sm90_combine_kernel<true>};
    for (const void *f : forms) {
        cudaFuncAttributes attr;
        MM_CUDA_TRY(cudaFuncGetAttributes(&attr, f));
        if (attr.maxDynamicSharedSizeBytes < bytes)
            MM_CUDA_TRY(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    }
    return MEGAMOE_OK;
}

megamoe_status sm90_combine_launch(const combine_plan &c, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                   const uint8_t *base, const float *gamma, const mm_dev_rank_args &a,
                                   uint8_t *err_words, uint8_t *host_err, cudaStream_t s) {
    if (a.T == 0 && !host_err) return MEGAMOE_OK;
    if (c.cluster) {
        cudaLaunchAttribute attr[2];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        attr[1].id = cudaLaunchAttributeClusterDimension;
        attr[1].val.clusterDim.x = MM_COMBINE_CLUSTER;
        attr[1].val.clusterDim.y = 1;
        attr[1].val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(c.blocks);
        cfg.blockDim = dim3(c.threads);
        cfg.dynamicSmemBytes = c.smem;
        cfg.stream = s;
        cfg.attrs = attr;
        cfg.numAttrs = 2;
        MM_CUDA_TRY(
            cudaLaunchKernelEx(&cfg, sm90_combine_kernel<true>, sh, L, base, gamma, a, err_words, host_err));
    } else {
        MM_CUDA_TRY(mm_launch(sm90_combine_kernel<false>, c.blocks, c.threads, c.smem, s, sh, L, base, gamma,
                              a, err_words, host_err));
    }
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
