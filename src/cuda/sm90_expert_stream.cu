/*
 * sm90_expert_stream.cu -- the two NVFP4 expert GEMMs when the experts have few tokens (decode),
 * where the forward is bound by streaming the weights from HBM. A persistent grid (4 blocks per SM)
 * walks work items (rank, token tile, 128-row slab, K split); in each block
 *   - one producer warp issues, per ring slot of two K steps, one bulk copy (cp.async.bulk, TMA 1D)
 *     of the slab's 8192 B of codes, one of its 1024 B of scales (each one contiguous run of the
 *     kernel layout, weight_layout.h) and one of 256 B per token of the activations, into a ring of
 *     4 slots (8 K steps) completed by mbarriers; the ring runs on across items, so it never drains;
 *   - four consumer warps (32 rows each, as in sm90_expert_mma.cu) wait on a slot, copy a step
 *     into registers, decode it and issue mma.sync m16n8k16, then the slot's second step, releasing
 *     the slot once its last step is read; no block barrier anywhere.
 * (The instantiation with a block per SM more keeps one K step per slot.)
 * A token tile of the routing (64 tokens) is taken 16 tokens at a time ("chunks"; decode tiles
 * rarely hold more). The producer decides the work and writes, with the first step of each chunk,
 * a header (steps, tokens, rows, expert, slab, split) and per token its slot code and scale in the
 * row's padding, so the consumers never wait for the routing tables. From 4 slots per expert the
 * kernel runs in a second layout (st_lay below) whose token rows hold the steps of every slot, so
 * one copy per token brings 4 K steps (two slots); a third instantiation runs 5 blocks per SM of 6
 * stages where a phase's items would leave a short second round on 4 (plan_stream_more_blocks). At
 * decode each block runs its code once per forward, fetched cold after an L2 flush, so the epilogues
 * are written compact (gemm_epilogue's COMPACT form) and code on that path is kept short (DECISIONS
 * 36).
 * Split-K: the plan (plan_stream_splits) depends on the group's slot count and the shape only and
 * makes at most about one item per resident block, so a split only happens when a phase has fewer
 * (tile, slab) pairs than blocks (few tokens on many weights: T = 1). Each consumer warp stores its
 * partial sums, fences and counts itself in for its (tile, slab) rows; the warp that comes last adds
 * the splits in split order (deterministic, so y stays bitwise independent of R and of the number
 * of GPUs) and runs the epilogue. The fence and returning atomic stall a warp ~2 us, once per item:
 * once per block at most with this plan (with several items per block the stalls add up; a finish
 * kernel per phase instead costs ~10 us each).
 * Hand-offs are those of CUTLASS's TMA pipelines: consumers wait on the phase parity of `full`
 * without arriving on it, the producer on that of `empty`. compute-sanitizer's racecheck reports
 * such hand-offs as hazards even in a minimal correct kernel (dev/sm90_racecheck_probe.cu: modes 0,
 * 1, 3, 4 reported, 2 and 5 clean); it is clean only when every thread that writes or waits also
 * arrives, which couples the four consumer warps like a block barrier, 10-15% slower at decode
 * (DECISIONS 48). So racecheck runs with this kernel excluded
 * (bench/device/check.sh); memcheck covers it.
 * Measured (dev/sm90_stream_probe.cu, H200): bulk copies of 4.6 KB per block step stream at
 * 4.4-4.5 TB/s (the copy engine's 4.28); the decode-GEMM prototype of this design reached 3.2 TB/s.
 */
#include "gemm/epilogue.cuh"
#include "gemm/fragments.cuh"
#include "launch.h"
#include "ptx/bulk_copy.cuh"
#include "ptx/mbarrier.cuh"

#define ST_WARPS MM_STREAM_WARPS /* consumer warps (4); one producer warp more */
#define ST_THREADS ((ST_WARPS + 1) * 32)
#define ST_COLS 16 /* tokens per chunk */
/* tokens per chunk of the wide instantiation (STREAM_WIDE: 8-16 tokens per expert) */
#define ST_COLS_WIDE 32
#define ST_CODES 4096      /* one slab step: 8 groups x 512 B of codes */
#define ST_SCALES 512      /*                8 groups x 64 B of scales */
#define MM_STREAM_UNROLL 4 /* K steps per consumer loop iteration (4 beats 1 at 8-128 tokens, DECISIONS) */
#define ST_STAGES 8        /* K steps the ring holds */
#define ST_BLOCKS_PER_SM MM_STREAM_BLOCKS_PER_SM
/* K steps the ring holds in the instantiation with one block per SM more (plan_stream_more_blocks) */
#define ST_STAGES_MORE 6
/* K steps per ring slot (one bulk copy each of codes and scales; per-slot layout: token row) */
#define ST_PAIR 2
#define ST_XG 4 /* grouped layout: K steps per activation copy (ST_XG / ST_PAIR neighbouring ring slots) */
/* grouped layout: chunks of fewer tokens still copy per slot (a group's copy waits for the slot of
 * its last step: a slot less lookahead) */
#define ST_XG_MIN_COLS 3

/* Two shared-memory layouts of the ring, one kernel instantiation each (DECISIONS 35). In both a
 * slot holds `steps` K steps (ST_PAIR; 1 in the instantiation with a block per SM more): their
 * weights (the steps' codes, then their scales: each one contiguous run of the kernel layout, so one
 * bulk copy each). A chunk of an odd number of K steps leaves its last slot half used. Two steps per
 * slot halve the bulk copies, barrier waits and releases per byte (work per copy rather than bytes
 * is the likeliest bound of a one-step slot: docs/CUDA_BACKEND.md).
 * - per-slot (XG false): a slot holds, per token, a row of the token's ST_PAIR steps (128 B each)
 *   and 16 B of padding with the token's slot code and scale;
 * - grouped (XG true): a slot holds its weights and the column table (8 B per token); the token rows
 *   live in one region, a token's row holding its steps of every slot (slot s at s * steps * 128),
 *   so one bulk copy per token brings ST_XG steps, `group` slots. Faster from ~4 tokens per expert,
 *   slower at ~1 (the layout, not the grouping, costs there): DECISIONS 35. */
template <bool XG, int B = ST_BLOCKS_PER_SM, int COLS = ST_COLS> struct st_lay {
    static constexpr bool grouped = XG;
    static constexpr int blocks = B;
    static constexpr int cols = COLS;                                /* tokens per chunk */
    static constexpr int steps = B > ST_BLOCKS_PER_SM ? 1 : ST_PAIR; /* K steps per slot */
    static constexpr int stages = (B > ST_BLOCKS_PER_SM ? ST_STAGES_MORE : ST_STAGES) / steps; /* slots */
    static constexpr int wbytes = steps * (ST_CODES + ST_SCALES); /* a slot's weights: codes, then scales */
    static constexpr int gxrow =
        stages * steps * 128 + 16; /* grouped layout: a token's row, its steps of every slot */
    static constexpr int pxrow = steps * 128 + 16; /* per-slot layout: a token's row, its steps and 16 B */
    static constexpr int slot = wbytes + (XG ? COLS * 8 : COLS * pxrow);
    static constexpr int xrow = XG ? gxrow : pxrow;
    static constexpr int smem = stages * slot + (XG ? COLS * gxrow : 0);
    static constexpr int group = XG ? ST_XG / steps : 1; /* slots per token-row copy */
    static_assert(xrow % 16 == 0 && (xrow / 4) % 32 == 4, "16-byte rows, conflict-free B reads");
    static_assert(slot % 128 == 0 && stages % group == 0 && (!XG || ST_XG % steps == 0),
                  "aligned slots, whole groups");
    /* At most 2048 B of static shared memory (ptxas: 768-1152) and the 1 KB the system reserves per
     * block; the 4-block rings leave 4-5 KB of an SM's 228 KB. */
    static_assert(B * (smem + 2048 + 1024) <= 233472,
                  "the blocks fit an SM's shared memory (static + 1 KB reserved each)");
    /* The weights of a slot (step j's codes at + j * ST_CODES, its scales at + sf(j)); its token rows
     * (token t's at + t * xrow, step j's 128 B at + j * 128); token t's code and scale. */
    static __device__ __forceinline__ uint8_t *w(uint8_t *ring, int s) { return ring + s * slot; }
    static constexpr int sf(int j) { return steps * ST_CODES + j * ST_SCALES; }
    static __device__ __forceinline__ uint8_t *x(uint8_t *ring, int s) {
        return XG ? ring + stages * slot + s * steps * 128 : ring + s * slot + wbytes;
    }
    static __device__ __forceinline__ uint8_t *meta(uint8_t *ring, int s, int t) {
        return ring + s * slot + wbytes + (XG ? t * 8 : t * pxrow + steps * 128);
    }
};

/* Split-K partial sums: [split][slab][row of the rank's slots][128 rows of the slab] f32 in the
 * split-K workspace (plan_stream_splits keeps them inside it). */
__device__ __forceinline__ float *st_partial(float *ws, int Y, long slots, int split, int y, int slot_row,
                                             int row) {
    return ws + (((size_t)split * Y + y) * slots + slot_row) * 128 + row;
}

/* What the producer tells the consumers with the first step of a chunk (steps == 0: no more work). */
struct st_header {
    int steps, ncols, first, e; /* K steps; tokens (<= 16); their first row of slots / act; expert */
    int y, split, r, tc;        /* slab; K split; local rank; tile << 9 | chunk << 7 | the tile's tokens */
};
/* The packed field tc (split-K's last arriver): tile, the chunk's index in it, the tile's tokens. */
__device__ __forceinline__ int st_tile(const st_header &h) { return h.tc >> 9; }
__device__ __forceinline__ int st_tcols(const st_header &h) { return h.tc & 127; }
__device__ __forceinline__ int st_tfirst(const st_header &h, int cols) {
    return h.first - ((h.tc >> 7) & 3) * cols;
}

struct st_params {
    int Y, nkc, splits, items;
    int ordered; /* the routing wrote L.tile_order: items walk the tiles in it (most tokens first) */
    long slots;
};

/* Work item i (< items) -> local rank, tile, slab, split; split fastest, so neighbouring blocks
 * stream neighbouring runs of one slab. */
__device__ __forceinline__ void st_item(int i, const int *base, int local_ranks, const st_params &p, int &r,
                                        int &tile, int &y, int &split) {
    r = 0;
    while (r + 1 < local_ranks && i >= base[r + 1])
        r++;
    const int local = i - base[r];
    split = local % p.splits;
    y = (local / p.splits) % p.Y;
    tile = local / (p.splits * p.Y);
}

/* The down kernel's wait for the kernel before it (gate/up, or W4A16's sm90_act_f16; each triggers
 * launch_dependents early): its blocks may enter while that kernel still runs, so everything that
 * reads only the routing (written kernels before, whose completion the previous kernel had waited
 * for before it let this kernel in) runs first, and the wait comes before the first copy of act rows
 * (W4A16: before the first slot_scale read, sm90_act_f16's output too) -- in the producer warp, whose
 * block therefore cannot end before the previous kernel has; a block that leaves without streaming
 * waits first as well, so this kernel's end always implies the previous kernel's (the completion
 * chain of DECISIONS 41). Elsewhere the kernel's first act. */
template <int PHASE> __device__ __forceinline__ void st_wait_for_inputs() {
    if (PHASE == PHASE_DOWN) {
        mm_wait_previous();
    }
}

template <int PHASE, class lay>
__device__ __forceinline__ void st_produce(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                           uint8_t *const *peers, const mm_dev_weights *weights,
                                           const st_params &p, const int *base, uint8_t *ring, uint64_t *full,
                                           uint64_t *empty, st_header *hdr) {
    const int lane = threadIdx.x & 31;
    const int groups_per_expert = (PHASE == PHASE_GATE_UP ? 2 * sh.I : sh.H) / 16;
    constexpr bool XG = lay::grouped;
    constexpr int S = lay::stages;
    int n = 0; /* slots issued */
    /* Waits until the consumers have released slot m % S from its use before m (use m - S). */
    auto wait_free = [&](int m) {
        if (m >= S && lane == 0) mm_mbar_wait_parity(&empty[m % S], ((m / S) - 1) & 1);
        __syncwarp();
    };
    for (int i = blockIdx.x; i < p.items; i += gridDim.x) {
        int r, tile, y, split;
        st_item(i, base, sh.local_ranks, p, r, tile, y, split);
        uint8_t *mine = peers[sh.first_rank + r];
        if (p.ordered) tile = ((const int32_t *)(mine + L.tile_order))[tile];
        const tile_info ti = load_tile(L, mine, tile);
        const int e = ti.e, first = ti.first, ncols = ti.ncols;
        const int kc0 = split * p.nkc / p.splits, kc1 = (split + 1) * p.nkc / p.splits;
        const mm_dev_weights W = weights[r];
        const size_t unit0 = (size_t)mm_layout_unit((int64_t)e * groups_per_expert + 8 * y, 0, p.nkc);
        const uint8_t *codes = (PHASE == PHASE_GATE_UP ? W.w13 : W.w2) + unit0 * 512;
        const uint8_t *sfs = (PHASE == PHASE_GATE_UP ? W.w13_sf : W.w2_sf) + unit0 * 64;
        for (int chunk = 0; chunk * lay::cols < ncols; chunk++) {
            const int nc = min(lay::cols, ncols - chunk * lay::cols), row0 = first + chunk * lay::cols;
            /* Lane t < nc: token t's activation row (set with the chunk's first slot). */
            const uint8_t *xsrc = NULL;
            for (int kc = kc0; kc < kc1; kc += lay::steps, n++) {
                const int slot = n % S;
                const int ks = min(lay::steps, kc1 - kc); /* K steps in this slot */
                /* xsteps: the K steps of token rows copied with this slot, from its first step on.
                 * Per-slot layout (and grouped chunks of fewer than ST_XG_MIN_COLS tokens): the slot's
                 * own. Grouped: the rows of a group of `group` slots (ST_XG steps) come in one copy
                 * per token, issued with the group's first slot (or the chunk's first, mid-group) for
                 * the steps up to the group's end or the chunk's; their bytes complete on this slot's
                 * barrier, which the consumers wait on before the later slots'. The rows are
                 * rewritten only once the last slot that held them before is released: slot
                 * n + (xsteps - 1) / steps holds the copy's last step. */
                const int gpos = n % lay::group;
                const int xsteps = !XG || nc < ST_XG_MIN_COLS ? ks
                                   : gpos == 0 || kc == kc0 ? min((lay::group - gpos) * lay::steps, kc1 - kc)
                                                            : 0;
                wait_free(n);
                if (XG && xsteps > lay::steps) wait_free(n + (xsteps - 1) / lay::steps);
                uint8_t *dst = lay::w(ring, slot);
                const uint32_t wbytes = ks * (ST_CODES + ST_SCALES), xbytes = nc * 128 * xsteps;
                auto copy_weights = [&] {
                    mm_bulk_copy(dst, codes + (size_t)kc * ST_CODES, ks * ST_CODES, &full[slot]);
                    mm_bulk_copy(dst + lay::sf(0), sfs + (size_t)kc * ST_SCALES, ks * ST_SCALES, &full[slot]);
                };
                if (kc == kc0) {
                    /* The slab's weights need only the item's expert: they are on their way before
                     * the chunk's columns are read (and, for W4A16's down, before sm90_act_f16 has
                     * ended); the slot's one arrive follows the header. */
                    if (lane == 0) {
                        mm_mbar_add_tx(&full[slot], wbytes);
                        copy_weights();
                    }
                    /* W4A16's down scale (the act row's power of two) is sm90_act_f16's output, which
                     * lets this kernel in before it ends: read only after the wait. */
                    if (PHASE == PHASE_DOWN && sh.bf16_act && n == 0) st_wait_for_inputs<PHASE>();
                    int code = -1;
                    float scale = 1.0f;
                    if (lane < nc) {
                        const bool gth = PHASE == PHASE_GATE_UP && rank_gathered(sh, L, mine);
                        slot_info si;
                        code = tile_column<PHASE, true>(sh, L, peers, mine, gth, sh.first_rank + r, row0, nc,
                                                        lane, &si, &scale);
                        xsrc = PHASE == PHASE_DOWN
                                   ? mine + L.act + (size_t)(row0 + lane) * sh.I * 2
                                   : peers[si.src] + gate_up_rows(sh, L, gth) + (size_t)si.token * sh.H * 2;
                    }
                    if (lane < lay::cols) {
                        *(int *)lay::meta(ring, slot, lane) = code;
                        *(float *)(lay::meta(ring, slot, lane) + 4) = scale;
                    }
                    if (lane == 0)
                        hdr[slot] = {kc1 - kc0, nc, row0, e, y, split, r, tile << 9 | chunk << 7 | ncols};
                    __syncwarp(); /* the header is written before lane 0 arrives (release) */
                    if (lane == 0) mm_mbar_expect_tx(&full[slot], xbytes);
                } else if (lane == 0) {
                    mm_mbar_expect_tx(&full[slot], wbytes + xbytes);
                    copy_weights();
                }
                /* The token rows are the previous kernel's output: wait before the first copy of
                 * them, after the first weights are on their way (W4A16's down waited above, before
                 * its scale read: the same wait, once per block, in one of the two places). */
                if (n == 0 && !(PHASE == PHASE_DOWN && sh.bf16_act)) st_wait_for_inputs<PHASE>();
                __syncwarp();                         /* expect_tx before any completion */
                if (lane < nc && (!XG || xsteps > 0)) /* per-slot: every slot has rows */
                    mm_bulk_copy(lay::x(ring, slot) + lane * lay::xrow, xsrc + (size_t)kc * 128, 128 * xsteps,
                                 &full[slot]);
            }
        }
    }
    const int slot = n % S; /* the end marker */
    wait_free(n);
    if (lane == 0) {
        hdr[slot].steps = 0;
        mm_mbar_arrive(&full[slot]);
    }
    /* Every copy of this block is issued: the next kernel may be scheduled (it waits for this one
     * before it reads what this one writes: st_wait_for_inputs, mm_wait_previous). */
    mm_launch_dependents();
}

/* acc = the splits' partials of a lane's values i < NI added in split order (split 0 first: no
 * 0 + (-0)), U splits per round trip (U * NI * 2 loads in flight); values i >= NI of N are zero.
 * Element (q, i): column (i >> 2) * 8 + 2c + (i & 1), row 16 (2 warp + q) + g + 8 ((i & 3) >> 1) of
 * the slab, at constant offsets from base. */
template <int NI, int U, int N>
__device__ __forceinline__ void st_sum_splits(float (&acc)[GROUPS_PER_WARP][N], const float *base,
                                              size_t split_stride, int splits, int nc, int c) {
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int i = 0; i < N; i++)
            acc[q][i] = 0.0f;
    for (int sp0 = 0; sp0 < splits; sp0 += U) {
        float v[U][GROUPS_PER_WARP][NI];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int i = 0; i < NI; i++) {
                    const int col = (i >> 2) * 8 + 2 * c + (i & 1);
                    const size_t off = (size_t)(sp0 + u) * split_stride + ((i >> 2) * 8 + (i & 1)) * 128 +
                                       16 * q + 8 * ((i & 3) >> 1);
                    v[u][q][i] = col < nc && sp0 + u < splits ? __ldcg(base + off) : 0.0f;
                }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int i = 0; i < NI; i++)
                    if (sp0 + u < splits) acc[q][i] = sp0 + u == 0 ? v[u][q][i] : acc[q][i] + v[u][q][i];
    }
}

/* Split-K, by the warp that stored a (tile, slab)'s partial sums last: for each 16-token chunk of the
 * tile, its 32 rows' partials added in split order (deterministic: y independent of R, of the number
 * of GPUs and of which block came last), then the phase's epilogue. The splits are read one at a
 * time, a lane's 16 loads in flight (two at a time spilled registers of the streaming loop).
 * col_code / col_scale: this warp's column table. */
template <int PHASE, int COLS>
__device__ __forceinline__ void st_finish_warp(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                               uint8_t *const *peers, const mm_dev_weights *weights,
                                               const st_params &p, const st_header &h, uint8_t *mine,
                                               int *col_code, float *col_scale) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const float *ws = (const float *)(mine + L.splitk_ws);
    const size_t split_stride = (size_t)p.Y * p.slots * 128;
    const int tcols = st_tcols(h), tfirst = st_tfirst(h, COLS);
    for (int chunk = 0; chunk * COLS < tcols; chunk++) {
        const int nc = min(COLS, tcols - chunk * COLS), first = tfirst + chunk * COLS;
        __syncwarp(); /* the previous chunk's epilogue has read the column table */
        if (lane < COLS) {
            slot_info si; /* unused: the epilogue decodes the codes itself */
            col_code[lane] = tile_column<PHASE, true>(sh, L, peers, mine, false, sh.first_rank + h.r, first,
                                                      nc, lane, &si, &col_scale[lane]);
        }
        __syncwarp();
        /* Element (q, i) of the lane: column (i >> 2) * 8 + 2c + (i & 1),
         * row 16 (2 warp + q) + g + 8 ((i & 3) >> 1) of the slab; offsets from one base are constants. */
        const float *base = st_partial((float *)ws, p.Y, p.slots, 0, h.y, first + 2 * c, 32 * warp + g);
        float acc[GROUPS_PER_WARP][COLS / 2];
        st_sum_splits<COLS / 2, 1>(acc, base, split_stride, p.splits, nc, c);
        gemm_epilogue<PHASE, true, COLS / 8, true>(acc, sh, L, peers, mine, weights[h.r], h.e, first, nc,
                                                   (nc + 7) / 8, 8 * h.y + GROUPS_PER_WARP * warp, col_code,
                                                   col_scale, lane);
    }
}

/* A consumer thread's shared-memory addresses for ring slot 0 (slot s: + s * lay::slot, the grouped
 * layout's token rows + s * lay::steps * 128): its 16 B of codes of group 2 warp, its 8 B of scales (row g)
 * of that group, its row of the first ldmatrix of the token rows; and the full barriers (the empty ones
 * follow them, lay::stages * 8 bytes on: one array, so a slot's empty barrier is an immediate offset from its
 * full one). Computed once per chunk and kept opaque to the compiler, which otherwise recomputes them from
 * the thread index and the shared window in K loop iterations; not at 5 blocks per SM, whose 72 registers
 * spill more when they stay in registers. */
struct st_addr {
    uint32_t codes, scales, rows, full;
};
template <class lay> __device__ __forceinline__ st_addr st_thread_addr(uint8_t *ring, uint64_t *full) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    st_addr a = {mm_smem_u32(ring + GROUPS_PER_WARP * warp * 512 + lane * 16),
                 mm_smem_u32(ring + lay::sf(0) + GROUPS_PER_WARP * warp * 64 + g * 8),
                 mm_smem_u32(lay::x(ring, 0) + (lane & 7) * lay::xrow + 16 * (lane >> 3)), mm_smem_u32(full)};
    if (lay::blocks <= ST_BLOCKS_PER_SM) {
        mm_opaque(a.codes);
        mm_opaque(a.scales);
        mm_opaque(a.rows);
        mm_opaque(a.full);
    }
    return a;
}

/* K step j of a landed ring slot into one consumer warp's accumulators: the warp's two groups'
 * codes and scales and the chunk's token rows into registers (then, after the slot's last step is
 * read, `release`, the warp releases the slot), then decode and mma.sync, k16 steps in order. */
template <class lay, int NT>
__device__ __forceinline__ void st_slot_step(float (&acc)[GROUPS_PER_WARP][NT * 4], const st_addr &ad,
                                             uint32_t slot, int j, bool release) {
    const int lane = threadIdx.x & 31;
    const uint32_t wo = slot * lay::slot; /* the slot's weights */
    a_raw<true> w[GROUPS_PER_WARP];
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++) { /* the warp's groups 2 warp + q of the slab */
        w[q].w[0] = ld_shared_v4(ad.codes + wo + j * ST_CODES + q * 512);
        w[q].sf = ld_shared_v2(ad.scales + wo + (lay::sf(j) - lay::sf(0)) + q * 64);
    }
    uint32_t b[4][NT][2];
    /* Two ldmatrix.x4 per n-tile instead of eight 32-bit loads: matrix i is k 8i..8i+7 of the
     * step for the n-tile's 8 tokens (lane l gives row l & 7 of matrix l >> 3, + 4 in the second),
     * and thread (g, c) receives token g's k 8i + 2c, 8i + 2c + 1 -- b[i / 2][nt][i % 2]. Rows past
     * the chunk's tokens hold stale bytes whose products land in columns the epilogue never stores. */
    const uint32_t rows = ad.rows + (lay::grouped ? slot * lay::steps * 128 : wo);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            ldmatrix_x4(b[2 * hh][nt][0], b[2 * hh][nt][1], b[2 * hh + 1][nt][0], b[2 * hh + 1][nt][1],
                        rows + nt * 8 * lay::xrow + j * 128 + 64 * hh);
    if (release) {
        __syncwarp();
        if (lane == 0)
            mm_mbar_arrive(ad.full + slot * 8 + lay::stages * 8); /* this warp is done with the slot */
    }
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++) {
            uint32_t a[4];
            decode_a<true>(w[q], s, a);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                mma_m16n8k16<false>(&acc[q][nt * 4], a, b[s][nt][0], b[s][nt][1]);
        }
}

/* One consumer warp's K steps of one chunk of NT n-tiles (8 tokens each), then split-K and the
 * epilogue. n: the block's slot count, advanced past the chunk's slots (lay::steps K steps each; a
 * chunk of an odd number of steps ends on a half-used slot). The K steps are added in order, one
 * after the other, whatever the slots: the sums are those of one step per slot. */
template <int PHASE, class lay, int NT, int U>
__device__ __forceinline__ bool
st_consume_chunk(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                 const mm_dev_weights *weights, const st_params &p, const st_header &h, uint8_t *ring,
                 uint64_t *full, int *col_code, float *col_scale, uint32_t &n) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    constexpr int P = lay::steps, UR = U / P > 0 ? U / P : 1; /* slots per unrolled iteration */
    float acc[GROUPS_PER_WARP][NT * 4];
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int i = 0; i < NT * 4; i++)
            acc[q][i] = 0.0f;
    const int full_slots = h.steps / P;
    const st_addr ad = st_thread_addr<lay>(ring, full);
#pragma unroll(UR)
    for (const uint32_t n_end = n + full_slots; n != n_end; n++) {
        uint32_t slot = n % lay::stages;
        mm_opaque(slot); /* slot * 8, slot * lay::slot: multiply-adds, not shifts and masks of n */
        mm_mbar_wait_parity(ad.full + slot * 8, (n / lay::stages) & 1);
#pragma unroll
        for (int j = 0; j < P; j++)
            st_slot_step<lay, NT>(acc, ad, slot, j, j == P - 1);
    }
    if (P > 1 && h.steps % P != 0) { /* the chunk's last step alone in its slot */
        const uint32_t slot = n % lay::stages;
        mm_mbar_wait_parity(ad.full + slot * 8, (n / lay::stages) & 1);
        st_slot_step<lay, NT>(acc, ad, slot, 0, true);
        n++;
    }

    uint8_t *mine = peers[sh.first_rank + h.r];
    if (p.splits > 1) { /* partial sums out; the warp that stores a (tile, slab) last adds them up */
        float *ws = (float *)(mine + L.splitk_ws);
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
            for (int i = 0; i < NT * 4; i++) {
                const int col = (i >> 2) * 8 + 2 * c + (i & 1);
                const int row = 16 * (GROUPS_PER_WARP * warp + q) + g + 8 * ((i & 3) >> 1);
                if (col < h.ncols)
                    __stcg(st_partial(ws, p.Y, p.slots, h.split, h.y, h.first + col, row), acc[q][i]);
            }
        __syncwarp(); /* the warp's partial sums before lane 0's release */
        /* One counter per (tile, slab, warp): the warp's 32 rows of every split and chunk of the tile. */
        int *counter =
            (int *)(mine + L.splitk_counters) + (((size_t)st_tile(h) * p.Y + h.y) * ST_WARPS + warp);
        int old = 0;
        if (lane == 0) {
            mm_fence_acq_rel_gpu(); /* release: the partial sums before the count */
            old = atomicAdd(counter, 1);
        }
        old = __shfl_sync(0xFFFFFFFFu, old, 0);
        if (old != p.splits * ((st_tcols(h) + lay::cols - 1) / lay::cols) - 1) return false;
        if (lane == 0) {
            *counter = 0;           /* ready for the next forward */
            mm_fence_acq_rel_gpu(); /* acquire: the other splits' partial sums after the count */
        }
        __syncwarp();
        return true; /* the caller adds the splits up (st_finish_warp, inlined once) */
    }
    gemm_epilogue<PHASE, true, NT, true>(acc, sh, L, peers, mine, weights[h.r], h.e, h.first, h.ncols, NT,
                                         8 * h.y + GROUPS_PER_WARP * warp, col_code, col_scale, lane);
    return false;
}

template <int PHASE, bool XG, int B, int U, int COLS>
__global__ void __launch_bounds__(ST_THREADS, B)
    sm90_expert_stream_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers,
                              const mm_dev_weights *weights, gemm_rule rule, long host_slots, int host_splits,
                              int host_ordered) {
    constexpr bool early = PHASE == PHASE_DOWN; /* st_wait_for_inputs */
    if (!early) {
        mm_wait_previous();
    }
    extern __shared__ __align__(128) uint8_t ring[];
    using lay = st_lay<XG, B, COLS>;
    __shared__ __align__(8) uint64_t bars[2 * lay::stages]; /* full, then empty (st_addr) */
    uint64_t *full = bars, *empty = bars + lay::stages;
    __shared__ st_header hdr[lay::stages];
    __shared__ int base[MM_MAX_RANKS + 1]; /* ranks on one GPU: at most a group's */
    __shared__ int col_code[ST_WARPS][COLS];
    __shared__ float col_scale[ST_WARPS][COLS];

    const int Kdim = PHASE == PHASE_GATE_UP ? sh.H : sh.I,
              Y = (PHASE == PHASE_GATE_UP ? 2 * sh.I : sh.H) / 128;
    st_params p;
    p.Y = Y;
    p.nkc = Kdim / BK;
    p.ordered = host_ordered;
    /* The local ranks' tile counts are read by one thread each while every thread reads the group's
     * token count (two independent latencies instead of one after the other). */
    if (threadIdx.x < sh.local_ranks)
        base[threadIdx.x + 1] = *(const int32_t *)(peers[sh.first_rank + threadIdx.x] + L.num_tiles);
    if (host_splits >
        0) { /* one process: the host's plan is this kernel's (gemm_plan.h plan_stream_launch) */
        p.slots = host_slots;
        p.splits = host_splits;
    } else {
        p.slots = global_slots(sh, L, peers);
        if (gemm_device_choice<PHASE, true>(rule, sh, p.slots, p.nkc).kernel != GEMM_STREAM) {
            if (early) mm_wait_previous(); /* the completion chain (st_wait_for_inputs) */
            return;
        }
        p.splits = plan_stream_splits(p.slots, sh.E, Y, p.nkc);
    }
    __syncthreads(); /* the tile counts */
    if (threadIdx.x == 0) {
        for (int i = 0; i < lay::stages; i++)
            mm_mbar_init(&full[i], 1), mm_mbar_init(&empty[i], ST_WARPS);
        mm_mbar_init_fence();
        base[0] = 0;
        for (int r = 0; r < sh.local_ranks; r++)
            base[r + 1] = base[r] + base[r + 1] * Y * p.splits;
    }
    __syncthreads();
    p.items = base[sh.local_ranks];
    if ((int)blockIdx.x >= p.items) {
        if (early) mm_wait_previous(); /* the completion chain (st_wait_for_inputs) */
        return;
    }

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp == ST_WARPS) {
        st_produce<PHASE, lay>(sh, L, peers, weights, p, base, ring, full, empty, hdr);
        return;
    }
    uint32_t n = 0; /* slots consumed */
    for (;;) {
        const int slot = n % lay::stages;
        mm_mbar_wait_parity(&full[slot], (n / lay::stages) & 1);
        const st_header h = hdr[slot];
        if (h.steps == 0) break;
        if (lane < COLS) {
            const uint8_t *pad = lay::meta(ring, slot, lane);
            col_code[warp][lane] = *(const int *)pad;
            col_scale[warp][lane] = *(const float *)(pad + 4);
        }
        __syncwarp();
        /* n-tiles of 8 tokens: all of a chunk's, or half of them for a chunk of at most half its tokens */
        const bool last =
            h.ncols > COLS / 2
                ? st_consume_chunk<PHASE, lay, COLS / 8, U>(sh, L, peers, weights, p, h, ring, full,
                                                            col_code[warp], col_scale[warp], n)
                : st_consume_chunk<PHASE, lay, COLS / 16, U>(sh, L, peers, weights, p, h, ring, full,
                                                             col_code[warp], col_scale[warp], n);
        if (last)
            st_finish_warp<PHASE, COLS>(sh, L, peers, weights, p, h, peers[sh.first_rank + h.r],
                                        col_code[warp], col_scale[warp]);
        __syncwarp(); /* the column table is read before the next chunk rewrites it */
    }
}

/* The instance table, one row per variant (gemm_plan.h plan_stream_variant: STREAM_PER_SLOT, _GROUPED,
 * _MORE_BLOCKS, _ROLLED, _WIDE) with both phases, read by the launch and the opt-in: the per-slot and
 * grouped layouts at MM_STREAM_BLOCKS_PER_SM, the per-slot one at a block per SM more, the per-slot
 * one with the K loop not unrolled, and the grouped one on 32-token chunks at MM_STREAM_WIDE_BLOCKS. */
using st_kernel_fn = void (*)(mm_dev_shape, mm_buffer_layout, uint8_t *const *, const mm_dev_weights *,
                              gemm_rule, long, int, int);
struct st_variant {
    st_kernel_fn kernel[2]; /* [phase] */
    int smem, blocks_per_sm;
};
template <int VARIANT, bool XG, int U = MM_STREAM_UNROLL, int COLS = ST_COLS>
static constexpr st_variant st_variant_of() {
    constexpr int B = plan_stream_blocks_per_sm(VARIANT);
    return {{sm90_expert_stream_kernel<PHASE_GATE_UP, XG, B, U, COLS>,
             sm90_expert_stream_kernel<PHASE_DOWN, XG, B, U, COLS>},
            st_lay<XG, B, COLS>::smem,
            B};
}
static const st_variant st_variants[STREAM_VARIANTS] = {
    st_variant_of<STREAM_PER_SLOT, false>(), st_variant_of<STREAM_GROUPED, true>(),
    st_variant_of<STREAM_MORE_BLOCKS, false>(), st_variant_of<STREAM_ROLLED, false, 1>(),
    st_variant_of<STREAM_WIDE, true, MM_STREAM_UNROLL, ST_COLS_WIDE>()};

megamoe_status sm90_expert_stream_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s) {
    if (a.sh.local_ranks > MM_MAX_RANKS) return MEGAMOE_ERR_UNSUPPORTED; /* refused at group creation */
    const st_variant &v = st_variants[g.instance];
    MM_CUDA_TRY(mm_launch(v.kernel[g.phase], gemm_grid(g), ST_THREADS, v.smem, s, a.sh, a.L, a.peers,
                          a.weights, g.rule, g.host_slots, g.host_splits, g.ordered));
    return MEGAMOE_OK;
}

megamoe_status sm90_expert_stream_prepare() {
    for (const st_variant &v : st_variants)
        for (st_kernel_fn k : v.kernel) {
            MM_CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
            MM_CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared));
            /* The split plan and the persistent grid count on blocks_per_sm resident blocks; the
             * rings of 4 blocks leave 4-5 KB of the H200's 228 KB (dynamic + static + the 1 KB the
             * system reserves per block), so a little more static shared memory would leave a
             * quarter of the grid waiting for a second wave. Caught here, not in a benchmark. */
            int resident = 0;
            MM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, k, ST_THREADS, v.smem));
            if (resident < v.blocks_per_sm)
                return mm_cuda_error(cudaErrorLaunchOutOfResources,
                                     "streaming kernel residency (fewer blocks per SM than planned)",
                                     __FILE__, __LINE__);
        }
    return MEGAMOE_OK;
}
