/*
 * sm90_expert_wgmma.cu -- the expert GEMMs when the experts have many tokens (prefill): Hopper's
 * warpgroup MMA, wgmma.mma_async m64n64k16 with f32 accumulation, weights as the A operand straight
 * from registers (RS form) and the token tile as the B operand from shared memory.
 *
 * Block: 8 warps = 2 warpgroups, 256 weight rows (each warp its two 16-row groups, as in the
 * mma.sync kernel) x one token tile of 64. A warp's A registers are exactly the mma.sync A fragments
 * of weight_layout.h, so the NVFP4 decode is the same ~1 integer op per weight, now amortized over
 * 64 tokens per instruction and with no shared-memory traffic for the weights' decoded values:
 * a warpgroup's wgmma takes each warp's 16 rows from that warp's registers (dev/sm90_wgmma_probe.cu
 * checked the register order and the biased FP4 operand on the H200). The warp's two groups are the
 * two wgmma of a k16 step, so the accumulators and the epilogue are the mma.sync kernel's.
 *
 * Pipeline, one K step (64) at a time, WG_STAGES slots: every thread copies its part of the step's
 * token tile (64 tokens x 64 K, no-swizzle K-major core matrices: LBO = K-adjacent core matrices,
 * SBO = token-adjacent) and each warp its own weight fragments (cp.async), WG_STAGES - 2 steps
 * ahead; a slot is refilled once the wgmma that read it have retired (wait_group 1 at the end of each
 * step, then the block barrier of the next). Rows past the tile's tokens stay zero and their columns
 * are dropped by the epilogue.
 */
#include <array>
#include <type_traits>
#include <utility>

#include "gemm/epilogue.cuh"
#include "gemm/fragments.cuh"
#include "gemm/splitk.cuh"
#include "launch.h"
#include "ptx/wgmma.cuh"

#define WG_WARPS 8
#define WG_THREADS (WG_WARPS * 32)
#define WG_ROWS (WG_WARPS * GROUPS_PER_WARP * 16) /* 256 weight rows per block */
#define WG_STAGES 5                               /* pipeline slots */
#define B_SLOT (MM_TILE_TOKENS * BK * 2)          /* 8 KB: one K step of the token tile, 16-bit */
static_assert(MM_TILE_TOKENS == 64, "the wgmma N is the token tile");
static_assert(WG_ROWS == MM_WGMMA_ROWS, "the split plan's row blocks (gemm_plan.h)");
static_assert(WG_ROWS == 256, "staged_epilogue's row blocks");

__host__ __device__ constexpr int a_slot_bytes(bool nvfp4) { return nvfp4 ? A_SLOT : 2048; }
__host__ __device__ constexpr int wgmma_smem_bytes(bool nvfp4) {
    return WG_STAGES * B_SLOT + WG_WARPS * WG_STAGES * GROUPS_PER_WARP * a_slot_bytes(nvfp4);
}
static_assert(MM_TILE_TOKENS * epi_stage_row<PHASE_DOWN>() <= wgmma_smem_bytes(true) &&
                  MM_TILE_TOKENS * epi_stage_row<PHASE_DOWN>() <= wgmma_smem_bytes(false),
              "the staged tile fits the rings");

/* The kernel in parts: a tile (its token rows, K loop and epilogue), its copies of one K step, and
 * one K step's wgmma, each run as the kernel's own code. Each part takes the kernel's variables it
 * reads by reference, as a lambda of the kernel would. NOTE: in the order the kernel's lambdas
 * captured them (their first use), which keeps every instruction of the 12 instances what it was when
 * the parts were lambdas of one 185-line kernel (dev/sass_diff.sh); another order is as correct. */

/* Issues the copies of K step kc (none past kc1): each warp its weight fragments, every thread its
 * two 16-byte pieces of the token tile. */
struct wgmma_issue {
    const int &kc1;
    uint8_t *const &aring;
    const uint8_t *const &codes, *const &sfs;
    const uint16_t *const &wb;
    const size_t &group0;
    const int &nkc, &lane;
    uint8_t *const &bring;
    const uint16_t *const (&bsrc)[2];
    const int (&boff)[2];
    template <bool NVFP4> __device__ void run(int kc) const {
        if (kc < kc1) {
            issue_a<WG_STAGES, NVFP4>(aring, codes, sfs, wb, group0, kc, kc1, nkc, lane);
            uint8_t *slot = bring + (kc % WG_STAGES) * B_SLOT;
#pragma unroll
            for (int h = 0; h < 2; h++)
                if (bsrc[h]) cp_async16(slot + boff[h], bsrc[h] + (size_t)kc * BK);
        }
        cp_async_commit();
    }
};

/* One K step. The A registers are read by the wgmma asynchronously: those of step kc - 1 (prev)
 * stay untouched, and live for the compiler, until wait_group 1 has retired that step; so the loop
 * alternates two register sets. nw: the instruction N. */
template <int PHASE, bool NVFP4> struct wgmma_step {
    static constexpr bool promote = bf16_promote<PHASE, NVFP4>();
    const wgmma_issue &issue;
    uint8_t *const &aring;
    const int &lane;
    uint8_t *const &bring;
    float (&part)[promote ? 32 : 1];
    float (&acc)[GROUPS_PER_WARP][32];
    const int &kc0;
    template <class NW> __device__ void operator()(int kc, a_regs &a, a_regs &prev, NW nw) const {
        cp_async_wait<WG_STAGES - 3>(); /* this thread's copies of step kc */
        mm_fence_proxy_async();         /* visible to the wgmma (async proxy) */
        __syncthreads(); /* everyone's copies landed; the wgmma of step kc - 2 retired in every warp */
        issue.run<NVFP4>(kc + WG_STAGES - 2); /* into the slot of step kc - 2 */
        a_raw<NVFP4> cur[GROUPS_PER_WARP];
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
            ring_read<WG_STAGES, NVFP4>(cur[q], aring, kc, q, lane);
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
            for (int s = 0; s < 4; s++)
                decode_a<NVFP4>(cur[q], s, a[q][s]);
        const uint8_t *bslot = bring + (kc % WG_STAGES) * B_SLOT;
        /* k16 step s: K core-matrix columns 2s, 2s + 1 */
        auto db_at = [&](int s) {
            return smem_desc(bslot + 2 * s * (MM_TILE_TOKENS * 16), MM_TILE_TOKENS * 16, 128);
        };
        if constexpr (promote) {
            /* A group's four k16 steps into part, added into acc once retired; the groups in turn. Every
             * wgmma has retired at the end, so neither A register set needs keeping (with both kept
             * and a part per group: 254 registers, a block too large to run beside test_gpu's occupier).
             */
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++) {
                wgmma_fence();
#pragma unroll
                for (int s = 0; s < 4; s++)
                    wgmma_rs<64, !NVFP4>(part, a[q][s], db_at(s), s > 0);
                wgmma_commit();
                wgmma_wait<0>();
#pragma unroll
                for (int i = 0; i < 32; i++)
                    acc[q][i] = mm_add(acc[q][i], part[i]);
            }
        } else {
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const uint64_t db = db_at(s);
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++) {
                    wgmma_rs<decltype(nw)::value, !NVFP4>(acc[q], a[q][s], db, kc > kc0 || s > 0);
                }
            }
            wgmma_commit();
            wgmma_wait<1>();
            keep_alive(prev);
        }
    }
};

/* One token tile of the block: its columns and rows, the K loop over [kc0, kc1), split-K, epilogue. */
template <int PHASE, bool NVFP4, bool SPLIT, bool LOOP> struct wgmma_tile {
    const mm_buffer_layout &L;
    uint8_t *const &mine;
    uint8_t *smem;
    const int &warp, &tid;
    const mm_dev_shape &sh;
    uint8_t *const *const &peers;
    const bool &gth;
    const int &r;
    int *col_code, *col_src, *col_token;
    float *col_scale;
    const mm_dev_weights &W;
    const int &groups_per_expert, &kc1, &nkc, &lane, &kc0, &splits;
    const splitk_plan &wplan;
    const int &split;
    __device__ void operator()(int tile) const {
        constexpr bool nvfp4 = NVFP4;
        const tile_info ti = load_tile(L, mine, tile);
        const int e = ti.e, first = ti.first, ncols = ti.ncols, ntiles_n = (ncols + 7) / 8;

        uint8_t *bring = smem;
        uint8_t *aring = smem + WG_STAGES * B_SLOT + warp * WG_STAGES * GROUPS_PER_WARP * a_slot_bytes(nvfp4);
        for (int i = tid; i < WG_STAGES * B_SLOT / 16; i += WG_THREADS)
            ((uint4 *)bring)[i] = make_uint4(0, 0, 0, 0);
        tile_columns<PHASE, nvfp4>(sh, L, peers, mine, gth, r, first, ncols, col_code, col_src, col_token,
                                   col_scale);
        __syncthreads();

        /* This thread's two 16-byte pieces of each step's token tile: piece i -> token (i >> 1) & 63,
         * K chunk (i & 1) + 2 (i >> 7); neighbouring lanes fill neighbouring core-matrix rows. */
        const uint16_t *bsrc[2];
        int boff[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int i = tid + WG_THREADS * h, tok = (i >> 1) & 63, kq = (i & 1) + 2 * (i >> 7);
            boff[h] = kq * (MM_TILE_TOKENS * 16) + (tok >> 3) * 128 + (tok & 7) * 16;
            const uint16_t *row = NULL;
            if (tok < ncols) {
                if (PHASE == PHASE_DOWN)
                    row = (const uint16_t *)(mine + L.act) + (size_t)(first + tok) * sh.I;
                else
                    row = (const uint16_t *)(peers[col_src[tok]] + gate_up_rows(sh, L, gth)) +
                          (size_t)col_token[tok] * sh.H;
            }
            bsrc[h] = row ? row + kq * 8 : NULL;
        }

        const uint8_t *codes = PHASE == PHASE_GATE_UP ? W.w13 : W.w2;
        const uint8_t *sfs = PHASE == PHASE_GATE_UP ? W.w13_sf : W.w2_sf;
        const uint16_t *wb = PHASE == PHASE_GATE_UP ? W.w13_bf16 : W.w2_bf16;
        const int wgroup = blockIdx.y * (WG_ROWS / 16) + warp * GROUPS_PER_WARP; /* within the expert */
        const size_t group0 = (size_t)e * groups_per_expert + wgroup;
        const wgmma_issue issue = {kc1, aring, codes, sfs, wb, group0, nkc, lane, bring, bsrc, boff};

        float acc[GROUPS_PER_WARP][32]; /* the first k16 step writes them (accumulate = 0) */
        /* BF16 gate/up (bf16_promote): each step's wgmma chain goes into part, added into acc in f32 once
         * it retired -- a wait for the step's own wgmma, not the previous one's (BF16 runs this kernel only
         * when MEGAMOE_GEMM forces it: gemm_choice takes ws64 / ws or mma.sync). */
        constexpr bool promote = bf16_promote<PHASE, nvfp4>();
        float part[promote ? 32 : 1];
        if constexpr (promote)
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int i = 0; i < 32; i++)
                    acc[q][i] = 0.0f;
        const wgmma_step<PHASE, NVFP4> step = {issue, aring, lane, bring, part, acc, kc0};
        a_regs a0, a1;
#pragma unroll
        for (int st = 0; st < WG_STAGES - 2; st++)
            issue.run<nvfp4>(kc0 + st);
        auto k_loop = [&](auto nw) {
            int kc = kc0;
            for (; kc + 1 < kc1; kc += 2) {
                step(kc, a0, a1, nw);
                step(kc + 1, a1, a0, nw);
            }
            if (kc < kc1) step(kc, a0, a1, nw);
        };
        /* An instruction N of 32 or 16 tokens (accumulators d[0..N/2)) for token tiles of at most N
         * tokens: a tile is 64 tokens in the routing, but at 16-32 tokens per expert most hold 32 or
         * fewer, and an m64n64 wgmma spends the tensor cores' time on empty columns. The B descriptor is
         * the 64-token tile's: N = 32 reads its first 4 core-matrix groups (the gain: DECISIONS 37).
         * The tile's token count is the block's, so every warpgroup takes the same instruction N. NVFP4
         * in one process only: the NCCL (LOOP) forms spill with the extra loops, BF16 takes ws64 there. */
        if constexpr (nvfp4 && !LOOP) {
            if (ncols <= 16)
                k_loop(std::integral_constant<int, 16>());
            else if (ncols <= 32)
                k_loop(std::integral_constant<int, 32>());
            else
                k_loop(std::integral_constant<int, 64>());
        } else {
            k_loop(std::integral_constant<int, 64>());
        }
        wgmma_wait<0>();
        if constexpr (!promote) {
            keep_alive(a0);
            keep_alive(a1);
        }

        if (SPLIT && splits > 1) { /* 64 KB per block and split: two workspace entries (plan_wgmma_splits) */
            const size_t entry = (size_t)blockIdx.y * wplan.ws_tiles + tile;
            if (!splitk_block_reduce<WG_THREADS>(acc, (float *)(mine + L.splitk_ws),
                                                 (int *)(mine + L.splitk_counters), entry, splits, split,
                                                 ntiles_n, tid))
                return;
        }

        if constexpr (!LOOP) { /* one tile per block: the rings are free once every warp's wgmma retired */
            staged_epilogue<PHASE, nvfp4, 8, false>(acc, sh, L, peers, mine, W, e, first, ncols, wgroup,
                                                    col_code, col_scale, lane, smem, blockIdx.y, tid,
                                                    [] { __syncthreads(); });
            return;
        }
        gemm_epilogue<PHASE, nvfp4>(acc, sh, L, peers, mine, W, e, first, ncols, ntiles_n, wgroup, col_code,
                                    col_scale, lane);
    }
};

/* SPLIT: the NVFP4 split-K instantiation (plan_wgmma_splits), blockIdx.z = rank x grid_splits + split.
 * LOOP: the NCCL instantiation, whose blocks walk the tiles from blockIdx.x on, gridDim.x apart (the
 * host caps the grid: its tile bound is sized for every rank at T_max); one process launches a block
 * per tile of its exact bound and takes the one-tile form (the loop's state costs the split form
 * spills at 128 registers). */
template <int PHASE, bool NVFP4, bool SPLIT, bool LOOP>
__global__ void __launch_bounds__(WG_THREADS, NVFP4 ? MM_WGMMA_NVFP4_BLOCKS : 1)
    sm90_expert_wgmma_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers,
                             const mm_dev_weights *weights, int grid_splits, gemm_rule rule) {
    mm_wait_previous();
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ int col_code[MM_TILE_TOKENS], col_src[MM_TILE_TOKENS], col_token[MM_TILE_TOKENS];
    __shared__ float col_scale[MM_TILE_TOKENS];
    constexpr bool nvfp4 = NVFP4;

    const int r = sh.first_rank + (int)blockIdx.z / grid_splits, split = blockIdx.z % grid_splits;
    uint8_t *mine = peers[r];
    const int num_tiles = *(const int32_t *)(mine + L.num_tiles);
    if ((int)blockIdx.x >= num_tiles) return;
    const int Kdim = PHASE == PHASE_GATE_UP ? sh.H : sh.I, nkc = Kdim / BK;
    const long slots = global_slots(sh, L, peers);
    if (gemm_device_choice<PHASE, nvfp4>(rule, sh, slots, nkc).kernel != GEMM_WGMMA)
        return; /* another kernel has it */
    const int rows_total = PHASE == PHASE_GATE_UP ? 2 * sh.I : sh.H, groups_per_expert = rows_total / 16;
    /* Split-K: this block sums K steps [kc0, kc1); the last of the splits adds the partial sums in
     * split order (deterministic) and runs the epilogue. */
    const splitk_plan wplan = plan_wgmma_splits(slots, sh.E, rows_total / WG_ROWS, nkc);
    const int splits = SPLIT && nvfp4 ? wplan.splits : 1;
    if (split >= splits) return; /* NCCL: the host launched the most its own count may plan */
    const int kc0 = split * nkc / splits, kc1 = (split + 1) * nkc / splits;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const mm_dev_weights W = weights[r - sh.first_rank];
    const bool gth = PHASE == PHASE_GATE_UP && rank_gathered(sh, L, mine);

    const wgmma_tile<PHASE, NVFP4, SPLIT, LOOP> one_tile = {
        L,       mine,      smem,      warp, tid,
        sh,      peers,     gth,       r,    col_code,
        col_src, col_token, col_scale, W,    groups_per_expert,
        kc1,     nkc,       lane,      kc0,  splits,
        wplan,   split};
    if constexpr (LOOP) {
        for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
            if (tile != (int)blockIdx.x)
                __syncthreads(); /* the tile before is done with the rings and columns */
            one_tile(tile);
        }
    } else {
        one_tile(blockIdx.x);
    }
}

/* The instance table (gemm_plan.h wgmma_instance: row = phase | nvfp4 << 1 | split << 2 | walk << 3),
 * read by the launch and the opt-in; a row the build leaves out (wgmma_instance_built) holds no kernel. */
using wgmma_kernel_fn = void (*)(mm_dev_shape, mm_buffer_layout, uint8_t *const *, const mm_dev_weights *,
                                 int, gemm_rule);
struct wgmma_row {
    wgmma_kernel_fn kernel;
    int smem; /* the rings (dynamic shared memory) */
};
template <int ROW> static constexpr wgmma_row wgmma_row_of() {
    constexpr int phase = ROW & 1;
    constexpr bool nvfp4 = (ROW >> 1) & 1, split = (ROW >> 2) & 1, walk = (ROW >> 3) & 1;
    static_assert(wgmma_instance(phase, nvfp4, split, walk) == ROW, "the row's axes");
    if constexpr (wgmma_instance_built(nvfp4, split))
        return {sm90_expert_wgmma_kernel<phase, nvfp4, split, walk>, wgmma_smem_bytes(nvfp4)};
    else
        return {nullptr, 0};
}
template <size_t... ROW>
static constexpr std::array<wgmma_row, sizeof...(ROW)> wgmma_rows(std::index_sequence<ROW...>) {
    return {{wgmma_row_of<ROW>()...}};
}
static const std::array<wgmma_row, WGMMA_INSTANCES> wgmma_instances =
    wgmma_rows(std::make_index_sequence<WGMMA_INSTANCES>());

megamoe_status sm90_expert_wgmma_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s) {
    const wgmma_row &k = wgmma_instances[g.instance];
    if (!k.kernel) return sm90_expert_gemm_unbuilt(g);
    MM_CUDA_TRY(mm_launch(k.kernel, gemm_grid(g), WG_THREADS, k.smem, s, a.sh, a.L, a.peers, a.weights,
                          g.splits, g.rule));
    return MEGAMOE_OK;
}

megamoe_status sm90_expert_wgmma_prepare() {
    for (const wgmma_row &k : wgmma_instances)
        if (k.kernel)
            MM_CUDA_TRY(cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
    return MEGAMOE_OK;
}
