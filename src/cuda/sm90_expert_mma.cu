/*
 * sm90_expert_mma.cu -- the two expert GEMMs of SPEC §3-4 over the token tiles of every local
 * expert when the experts have few tokens (decode; sm90_expert_wgmma.cu takes many), on the tensor
 * cores (mma.sync m16n8k16, f32 accumulation), with split-K when the tiles cannot fill the GPU;
 * weights stream through a cp.async ring per warp in the fragment order the finalize step packed
 * (weight_layout.h):
 *   gate/up: 128 weight rows (64 intermediate indices, gate and up interleaved by 8 so both land in
 *            one thread) x 64 tokens over K = H; epilogue in registers: s and alpha, clamp, SwiGLU,
 *            the static-a2 NVFP4 requant with the 16-block amax from 3 lane shuffles (or bf16);
 *   down:    128 rows of W2 x 64 tokens over K = I; epilogue a2 and alpha_2, p written into the home
 *            rank's buffer at (token, slot) through the peer table.
 * NVFP4 weights decode to f16 code * 2^-14 * block scale: the code's bits go straight into the f16
 * lane (sign to bit 15, e1 e0 m to bits 11..9), one HMUL2 applies the E4M3 scale (converted by the
 * hardware), and every product is exact (KERNEL_NOTES §2; HMMA keeps f16 subnormals, measured).
 * The 2^14 goes back in the epilogue, where multiplying by a power of two is exact.
 * Activations are staged in shared memory (double-buffered) as exact f16 code * scale (NVFP4) or
 * bf16, one 64-wide K step per block barrier, or four when the tile has at most 16 tokens.
 */
#include <array>
#include <utility>

#include "gemm/epilogue.cuh"
#include "gemm/fragments.cuh"
#include "gemm/splitk.cuh"
#include "launch.h"

#define WARPS 4
#define BN MM_TILE_TOKENS /* tokens per tile */
#define LDB (BK + 8)      /* 16-bit elements per staged activation row (conflict-free) */
#define ROWS_PER_BLOCK (WARPS * GROUPS_PER_WARP * 16)

static_assert(BN == 64 && BK == 64, "tile shape");
static_assert(ROWS_PER_BLOCK == MM_MMA_ROWS, "the split plan's row blocks (gemm_plan.h)");

/* NVFP4 weights travel through a per-warp ring of STAGES shared-memory slots filled by cp.async: the
 * copies in flight hold no registers, so more of them fit. Eight stages keep ~97 KB in flight per SM
 * at 3 blocks per SM (four kept 41 KB); a power of two. */
#define STAGES 8
#define RING_BYTES (WARPS * STAGES * GROUPS_PER_WARP * A_SLOT) /* dynamic shared memory, NVFP4 */
/* Few tokens in a tile (decode): the activations of KCH_FEW K steps are staged at once, so the block
 * meets at a barrier once per KCH_FEW steps instead of every step (a barrier per step made every warp
 * wait for the slowest weight copy of the four). 16 rows x (4 x 64 + 8) fits the buffer of 64 x LDB. */
#define FEW_COLS 16
#define KCH_FEW 4
static_assert(FEW_COLS * (KCH_FEW * BK + 8) <= BN * LDB, "chunked activations fit the staging buffer");

/* Raw activation data of this thread's part of a staged chunk: 4 pieces of 8 values. */
struct b_raw {
    uint4 v[4];
};

/* A chunk is 64 rows x 64 values (kch = 1) or 16 rows x 256 values (kch = 4): 512 pieces of 8 either
 * way, 4 per thread (piece = tid + 128 * i); row = piece >> shift with shift = log2(8 * kch). */
template <int PHASE>
__device__ __forceinline__ void load_b(b_raw &r, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                       uint8_t *const *peers, const uint8_t *mine, bool gth,
                                       const int *col_src, const int *col_token, int first, int ncols, int k0,
                                       int k_end, int shift) {
    for (int i = 0; i < 4; i++) {
        const int chunk = threadIdx.x + 128 * i, row = chunk >> shift, q = chunk & ((1 << shift) - 1);
        if (row >= ncols) break; /* rows grow with i: the rest are past ncols too */
        const int k = k0 + q * 8;
        if (k >= k_end) continue; /* the last chunk of a split may be short */
        if (PHASE == PHASE_DOWN) {
            r.v[i] = *(const uint4 *)((const uint16_t *)(mine + L.act) + (size_t)(first + row) * sh.I + k);
        } else { /* NVFP4: decoded once by the stage kernel (biased f16, exact); BF16: x (gate_up_rows) */
            r.v[i] = *(const uint4 *)((const uint16_t *)(peers[col_src[row]] + gate_up_rows(sh, L, gth)) +
                                      (size_t)col_token[row] * sh.H + k);
        }
    }
}

/* Rows past ncols are neither loaded nor stored: an MMA column never mixes with another, and the
 * epilogue drops every column >= ncols (the rows are zeroed once so no stale value is read). */
__device__ __forceinline__ void store_b(const b_raw &r, int ncols, uint16_t *bs, int ldb, int shift,
                                        int k_left) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int chunk = threadIdx.x + 128 * i, row = chunk >> shift, q = chunk & ((1 << shift) - 1);
        if (row >= ncols) break;
        if (q * 8 >= k_left) continue;
        *(uint4 *)(bs + row * ldb + q * 8) = r.v[i];
    }
}

/* K step kc of one warp: its A fragments (NVFP4: from the cp.async ring, the copies of step
 * kc + STAGES - 1 issued; BF16: prefetched in nxt one step ahead), then the mma.sync over the tile's
 * n-tiles of 8 tokens into acc, B from the chunk of staged activations Bs[buf] that began at step kb.
 * NOTE: its arrays (cur, part, a) are the kernel's, declared where this code was: that keeps the order
 * of the kernel's local arrays, and with it every instruction of the 8 instances, what it was with the
 * step written in the kernel (dev/sass_diff.sh). */
template <int PHASE, bool nvfp4>
__device__ __forceinline__ void
mma_kstep(float (&acc)[GROUPS_PER_WARP][32], a_raw<nvfp4> (&nxt)[GROUPS_PER_WARP],
          a_raw<nvfp4> (&cur)[GROUPS_PER_WARP],
          float (&part)[GROUPS_PER_WARP][bf16_promote<PHASE, nvfp4>() ? 32 : 1],
          uint32_t (&a)[GROUPS_PER_WARP][4], uint8_t *ring, const uint8_t *codes, const uint8_t *sfs,
          const uint16_t *wb, size_t group0, int kc, int kc1, int nkc, int lane, const uint16_t *Bs, int buf,
          int kb, int ldb, int ntiles_n, int g, int c) {
    if constexpr (nvfp4) {
        __syncwarp(); /* every lane is done with the slot the next copies overwrite */
        issue_a<STAGES, true>(ring, codes, sfs, wb, group0, kc + STAGES - 1, kc1, nkc, lane);
        cp_async_commit();
        cp_async_wait<STAGES - 1>(); /* this lane's copies of step kc have landed */
        __syncwarp();                /* and so have the other lanes' */
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
            ring_read<STAGES, true>(cur[q], ring, kc, q, lane);
    } else {
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
            cur[q] = nxt[q];
        if (kc + 1 < kc1)
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
                load_a<nvfp4>(nxt[q], codes, sfs, wb, group0 + q, kc + 1, nkc, lane);
    }
    const uint16_t *bs = Bs + buf * (BN * LDB) + (kc - kb) * BK;
    /* BF16 gate/up: the step's sums in part, added into acc in f32 (bf16_promote) */
    constexpr bool promote = bf16_promote<PHASE, nvfp4>();
    if constexpr (promote)
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
            for (int i = 0; i < 32; i++)
                part[q][i] = 0.0f;
#pragma unroll
    for (int s = 0; s < BK / 16; s++) {
        for (int q = 0; q < GROUPS_PER_WARP; q++)
            decode_a<nvfp4>(cur[q], s, a[q]);
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            if (nt >= ntiles_n) break;
            const uint16_t *brow = bs + (nt * 8 + g) * ldb + 16 * s + 2 * c;
            const uint32_t b0 = *(const uint32_t *)brow, b1 = *(const uint32_t *)(brow + 8);
            for (int q = 0; q < GROUPS_PER_WARP; q++) {
                float *d = &acc[q][nt * 4];
                if constexpr (promote) d = &part[q][nt * 4];
                mma_m16n8k16<!nvfp4>(d, a[q], b0, b1);
            }
        }
    }
    if constexpr (promote)
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
            for (int i = 0; i < 32; i++)
                acc[q][i] = mm_add(acc[q][i], part[q][i]);
}

/* SPLIT: the split-K instantiation (plan_splitk), blockIdx.z = rank x grid_splits + split; the plain
 * one keeps its registers. */
template <int PHASE, bool NVFP4, bool SPLIT>
__global__ void __launch_bounds__(WARPS * 32)
    sm90_expert_mma_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers,
                           const mm_dev_weights *weights, int grid_splits, gemm_rule rule) {
    mm_wait_previous();
    __shared__ __align__(16) uint16_t Bs[2 * BN * LDB];
    extern __shared__ __align__(16) uint8_t a_ring[]; /* RING_BYTES for NVFP4, none for BF16 */
    __shared__ int col_code[BN], col_src[BN], col_token[BN];
    __shared__ float col_scale[BN];

    const int r = sh.first_rank + (int)blockIdx.z / grid_splits, split = blockIdx.z % grid_splits,
              tile = blockIdx.x;
    uint8_t *mine = peers[r];
    if (tile >= *(const int32_t *)(mine + L.num_tiles)) return;
    const tile_info ti = load_tile(L, mine, tile);
    const int e = ti.e, first = ti.first, ncols = ti.ncols, ntiles_n = (ncols + 7) / 8;
    constexpr bool nvfp4 = NVFP4;
    const int Kdim = PHASE == PHASE_GATE_UP ? sh.H : sh.I, nkc = Kdim / BK;
    /* The phase's plan at the group's count (the host may launch more splits than it: NCCL ranks do
     * not know the other ranks' counts; the extra blocks leave here). */
    const gemm_phase_choice plan =
        gemm_device_choice<PHASE, nvfp4>(rule, sh, global_slots(sh, L, peers), nkc);
    if (plan.kernel != GEMM_MMA) return; /* another kernel has it */
    const int splits = SPLIT ? plan.mma.splits : 1, ws_tiles = plan.mma.ws_tiles;
    if (split >= splits) return;
    /* Split-K: this block sums K steps [kc0, kc1); the last of the splits to finish adds the partial
     * sums in split order (deterministic) and runs the epilogue. */
    const int kc0 = split * nkc / splits, kc1 = (split + 1) * nkc / splits;
    const int rows_total = PHASE == PHASE_GATE_UP ? 2 * sh.I : sh.H, groups_per_expert = rows_total / 16;
    const mm_dev_weights W = weights[r - sh.first_rank]; /* the table holds the local ranks */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;

    for (int i = tid; i < 2 * BN * LDB / 8; i += WARPS * 32)
        ((uint4 *)Bs)[i] = make_uint4(0, 0, 0, 0);
    const bool gth = PHASE == PHASE_GATE_UP && rank_gathered(sh, L, mine);
    tile_columns<PHASE, nvfp4>(sh, L, peers, mine, gth, r, first, ncols, col_code, col_src, col_token,
                               col_scale);
    __syncthreads();

    const uint8_t *codes = PHASE == PHASE_GATE_UP ? W.w13 : W.w2;
    const uint8_t *sfs = PHASE == PHASE_GATE_UP ? W.w13_sf : W.w2_sf;
    const uint16_t *wb = PHASE == PHASE_GATE_UP ? W.w13_bf16 : W.w2_bf16;
    const size_t group0 = (size_t)e * groups_per_expert + (size_t)blockIdx.y * (ROWS_PER_BLOCK / 16) +
                          (size_t)warp * GROUPS_PER_WARP;

    float acc[GROUPS_PER_WARP][32];
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                acc[q][i * 4 + j] = 0.0f;

    /* BF16 weights are prefetched one K step ahead in registers; NVFP4 through the cp.async ring.
     * Activations are staged a chunk of kch K steps at a time, double-buffered. */
    a_raw<nvfp4> nxt[GROUPS_PER_WARP];
    b_raw br;
    uint8_t *ring = a_ring + warp * STAGES * GROUPS_PER_WARP * A_SLOT;
    const int kch = ncols <= FEW_COLS ? KCH_FEW : 1, shift = kch == 1 ? 3 : 5, ldb = kch * BK + 8;
    if constexpr (nvfp4) {
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) {
            issue_a<STAGES, true>(ring, codes, sfs, wb, group0, kc0 + st, kc1, nkc, lane);
            cp_async_commit();
        }
    } else {
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
            load_a<nvfp4>(nxt[q], codes, sfs, wb, group0 + q, kc0, nkc, lane);
    }
    load_b<PHASE>(br, sh, L, peers, mine, gth, col_src, col_token, first, ncols, kc0 * BK, kc1 * BK, shift);
    store_b(br, ncols, Bs, ldb, shift, (kc1 - kc0) * BK);
    __syncthreads();

    int buf = 0;
    for (int kb = kc0; kb < kc1; kb += kch, buf ^= 1) {
        const int kb_end = min(kb + kch, kc1);
        if (kb_end < kc1)
            load_b<PHASE>(br, sh, L, peers, mine, gth, col_src, col_token, first, ncols, kb_end * BK,
                          kc1 * BK, shift);
        for (int kc = kb; kc < kb_end; kc++) {
            a_raw<nvfp4> cur[GROUPS_PER_WARP];
            float part[GROUPS_PER_WARP][bf16_promote<PHASE, nvfp4>() ? 32 : 1];
            uint32_t a[GROUPS_PER_WARP][4];
            mma_kstep<PHASE, nvfp4>(acc, nxt, cur, part, a, ring, codes, sfs, wb, group0, kc, kc1, nkc, lane,
                                    Bs, buf, kb, ldb, ntiles_n, g, c);
        }
        if (kb_end < kc1) store_b(br, ncols, Bs + (buf ^ 1) * (BN * LDB), ldb, shift, (kc1 - kb_end) * BK);
        __syncthreads();
    }

    if (SPLIT && splits > 1) { /* the entry (row block, tile) is within the workspace (plan_splitk) */
        const size_t entry = (size_t)blockIdx.y * ws_tiles + tile;
        if (!splitk_block_reduce<WARPS * 32>(acc, (float *)(mine + L.splitk_ws),
                                             (int *)(mine + L.splitk_counters), entry, splits, split,
                                             ntiles_n, tid))
            return;
    }

    gemm_epilogue<PHASE, nvfp4>(acc, sh, L, peers, mine, W, e, first, ncols, ntiles_n,
                                (blockIdx.y * (ROWS_PER_BLOCK / 16) + warp * GROUPS_PER_WARP), col_code,
                                col_scale, lane);
}

/* The instance table (gemm_plan.h mma_instance: row = phase | nvfp4 << 1 | split << 2), read by the
 * launch and the opt-in; a row the build leaves out (mma_instance_built) holds no kernel. */
using mma_kernel_fn = void (*)(mm_dev_shape, mm_buffer_layout, uint8_t *const *, const mm_dev_weights *, int,
                               gemm_rule);
struct mma_row {
    mma_kernel_fn kernel;
    int smem; /* the NVFP4 weight ring (dynamic shared memory) */
};
template <int ROW> static constexpr mma_row mma_row_of() {
    constexpr int phase = ROW & 1;
    constexpr bool nvfp4 = (ROW >> 1) & 1, split = (ROW >> 2) & 1;
    static_assert(mma_instance(phase, nvfp4, split) == ROW, "the row's axes");
    if constexpr (mma_instance_built(nvfp4))
        return {sm90_expert_mma_kernel<phase, nvfp4, split>, nvfp4 ? RING_BYTES : 0};
    else
        return {nullptr, 0};
}
template <size_t... ROW>
static constexpr std::array<mma_row, sizeof...(ROW)> mma_rows(std::index_sequence<ROW...>) {
    return {{mma_row_of<ROW>()...}};
}
static const std::array<mma_row, MMA_INSTANCES> mma_instances =
    mma_rows(std::make_index_sequence<MMA_INSTANCES>());

megamoe_status sm90_expert_mma_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s) {
    const mma_row &k = mma_instances[g.instance];
    if (!k.kernel) return sm90_expert_gemm_unbuilt(g);
    MM_CUDA_TRY(mm_launch(k.kernel, gemm_grid(g), WARPS * 32, k.smem, s, a.sh, a.L, a.peers, a.weights,
                          g.splits, g.rule));
    return MEGAMOE_OK;
}

/* The NVFP4 kernels take more than 48 KB of shared memory (the weight ring is dynamic): the opt-in is
 * per function and device, so the layer's finalize calls this on its device, outside any capture. */
megamoe_status sm90_expert_mma_prepare() {
    for (const mma_row &k : mma_instances) {
        if (!k.kernel) continue;
        MM_CUDA_TRY(cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
        MM_CUDA_TRY(cudaFuncSetAttribute(k.kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
    }
    return MEGAMOE_OK;
}
