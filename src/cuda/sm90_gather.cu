/*
 * sm90_gather.cu -- for the forwards that gather (sh.gathered: across GPUs always, on one GPU when the
 * warp-specialized kernels take gate/up), each routed slot's gate/up input row copied from its home
 * rank into the rank's slot-ordered copy (L.xg), once: across GPUs the GEMM kernels then read local
 * rows instead of re-reading remote ones over NVLink for every row block, and the warp-specialized
 * kernels' token tiles are consecutive rows (one TMA box).
 */
#include "launch.h"

/* One warp per slot row of rank first_rank + blockIdx.y (rows walked by the grid): the row's H 16-bit
 * values (x_f16 for NVFP4, x for BF16) from the token's home rank to row `row` of xg (its scale is
 * the routing's slot_scale). The copies are exact, so y does not depend on whether a rank gathered. */
#define GATHER_THREADS 256
#define GATHER_UNROLL 4
__global__ void __launch_bounds__(GATHER_THREADS)
    sm90_gather_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers) {
    mm_wait_previous();
    uint8_t *mine = peers[sh.first_rank + blockIdx.y];
    if (!rank_gathered(sh, L, mine)) return; /* across GPUs: few slot rows, read where they are */
    const int lane = threadIdx.x & 31, warps = GATHER_THREADS / 32;
    const int n = ((const int32_t *)(mine + L.expert_offset))[sh.E_r], chunks = sh.H / 8;
    const uint64_t src_rows = gate_up_rows(sh, L, false); /* where the staged tokens are */
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < n; row += gridDim.x * warps) {
        const slot_info si = decode_slot(sh, ((const int32_t *)(mine + L.slots))[row]);
        const uint4 *src = (const uint4 *)(peers[si.src] + src_rows + (size_t)si.token * sh.H * 2);
        uint4 *dst = (uint4 *)(mine + L.xg + (size_t)row * sh.H * 2);
        for (int c0 = 0; c0 < chunks; c0 += 32 * GATHER_UNROLL) {
            uint4 v[GATHER_UNROLL]; /* the loads in flight before the stores */
#pragma unroll
            for (int u = 0; u < GATHER_UNROLL; u++) {
                const int c = c0 + 32 * u + lane;
                if (c < chunks) v[u] = __ldg(src + c);
            }
#pragma unroll
            for (int u = 0; u < GATHER_UNROLL; u++) {
                const int c = c0 + 32 * u + lane;
                if (c < chunks) dst[c] = v[u];
            }
        }
    }
}

megamoe_status sm90_gather_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                  cudaStream_t s) {
    int sms = 0;
    MM_CUDA_TRY(mm_device_sms(&sms));
    /* Enough warps for every slot row the rank can hold, at most 4 blocks per SM. */
    const long rows = L.xg_rows, warps = GATHER_THREADS / 32;
    const long want = (rows + warps - 1) / warps;
    const dim3 grid((unsigned)(want < 4L * sms ? want : 4L * sms), sh.local_ranks);
    MM_CUDA_TRY(mm_launch(sm90_gather_kernel, grid, GATHER_THREADS, 0, s, sh, L, peers));
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}
