/*
 * sm90_expert_ws.cu -- the expert GEMMs when the experts have many tokens (prefill), warp-specialized
 * (dev/sm90_fp4_ws_gemm_probe.cu measured the design on the H200: 708-815 TFLOP/s on one expert's
 * NVFP4 gate/up and down at 8192 tokens, against ~300 for the one-role wgmma kernel).
 *
 * Block: 256 weight rows (two slabs of 128, weight_layout.h) x 128 tokens (two 64-token tiles of the
 * tile list: the block of an expert's even tile takes the odd one after it too; the odd tiles' blocks
 * leave at once), three warpgroups:
 *   - the producer (setmaxnreg 40): thread 0 copies the two slabs' weights of each K step, each one
 *     contiguous run of the kernel layout, with bulk copies (TMA 1D). The token tile (128-byte
 *     swizzled, 128 bytes per token and step): where the item's rows are consecutive rows of one
 *     matrix (act in the down projection, the gathered gate/up input xg) and the process drives one
 *     rank, thread 0 copies it too, as one box of a 2D tensor map (TMA); else thread t copies token
 *     t's 128 bytes with cp.async (rows gathered by token), waits for them WS_LAG steps later and
 *     fences them for the async proxy (wgmma reads shared memory through it). A stage is full when
 *     the bulk bytes have landed and every producer thread has arrived.
 *   - two consumers (setmaxnreg 232), one slab each as two m64 blocks: each warp decodes two 16-row
 *     groups per K step (`decode_a`, as every kernel of the library) into the A registers of
 *     wgmma.m64n128k16 (RS) over the stage's token tile, keeps one step's group of wgmma in flight
 *     while it decodes the next (two register sets), and releases a stage once the step after it has
 *     been issued. No block barrier after the start.
 * Warp w of a consumer holds the slab's groups 2w and 2w + 1 (m64 block q takes group 2w + q from
 * warp w): a warp's two groups are then one NVFP4 block of 16 intermediate indices, and its
 * accumulators are exactly what gemm_epilogue takes (NT = 16 n-tiles of 8 tokens).
 * BF16 takes its A operand from shared memory instead (SS wgmma): a slab's K step is stored in the
 * K-major core-matrix order (weight_layout.h), so the bulk-copied 16 KB is the operand as it lands.
 */
#include <array>
#include <type_traits>
#include <utility>

#include "gemm/epilogue.cuh"
#include "gemm/fragments.cuh"
#include "launch.h"
#include "ptx/barrier.cuh"
#include "ptx/bulk_copy.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/wgmma.cuh"

#define WS_THREADS 384
/* Tokens per block, the wgmma N (template NTOK): 128 (two 64-token tiles of the list: GEMM_WS) or
 * 64 (one tile: GEMM_WS64, for 16-64 tokens per expert, where the weights' bandwidth bounds). */
#define WS_LAG 2 /* K steps of token copies a producer thread keeps in flight before signalling */
/* Registers: 168 per thread at launch (384 x 168 = 63K of the SM's 64K), then 40 for the producer and
 * 232 for the consumers (128 x 40 + 256 x 232, the same 63K). At 216 for the consumers (a launch at
 * 160) ptxas serializes the wgmma (C7512). */
#define WS_PRODUCER_REGS 40
#define WS_CONSUMER_REGS 232
static_assert(MM_TILE_TOKENS == 64, "a block takes one or two tiles of the tile list");
static_assert(MM_WS_ROWS == 2 * MM_SLAB_GROUPS * 16, "two slabs per block (gemm_plan.h)");
static_assert(MM_WS_ROWS == 256, "staged_epilogue's row blocks");

template <bool NVFP4, int NTOK> struct ws_cfg {
    static constexpr int tok_bytes = NTOK * BK * 2;               /* 16 / 8 KB of 16-bit tokens per step */
    static constexpr int slab_bytes = NVFP4 ? 4096 + 512 : 16384; /* a slab's step: codes + scales | bf16 */
    static constexpr int stage_bytes = tok_bytes + 2 * slab_bytes;
    static constexpr int stages = NVFP4 ? (NTOK == 128 ? 6 : 8) : (NTOK == 128 ? 4 : 5);
    static constexpr int smem = stages * stage_bytes + 1024; /* + alignment to 1024 (swizzle) */
    static_assert(stage_bytes % 1024 == 0, "each stage's token tile 1024-byte aligned");
    static_assert(WS_LAG <= stages - 2, "the producer must signal a stage before it waits for a later one");
};

/* The walking form stages its epilogue in a tile of its own past the ring, so the producer fills the
 * ring with the next item's steps meanwhile: NVFP4 gate/up's NTOK columns of 128 16-bit values; the
 * other phases 64 columns a pass, in one or two passes (down's f32 columns are 1 KB each: 128 of them
 * would leave the ring three stages; BF16's ring leaves no more room). BF16 down walks (NCCL) with
 * scattered stores: its ring leaves no room for a tile. The one-item form stages in the ring. */
template <int PHASE, bool NVFP4, bool LOOP> constexpr bool ws_own_tile() {
    return LOOP && (NVFP4 || PHASE == PHASE_GATE_UP);
}
template <int PHASE, bool NVFP4> constexpr int ws_tile_cols(int ntok) {
    return PHASE == PHASE_GATE_UP && NVFP4 ? ntok : 64;
}
template <int PHASE, bool NVFP4, int NTOK, bool LOOP> constexpr int ws_smem() {
    return ws_cfg<NVFP4, NTOK>::smem + (ws_own_tile<PHASE, NVFP4, LOOP>()
                                            ? ws_tile_cols<PHASE, NVFP4>(NTOK) * epi_stage_row<PHASE>()
                                            : 0);
}
static_assert(ws_smem<PHASE_DOWN, true, 128, true>() + 4096 <= 227 * 1024, "the walking down's tile fits");
static_assert(ws_smem<PHASE_GATE_UP, false, 128, true>() + 4096 <= 227 * 1024 &&
                  ws_smem<PHASE_GATE_UP, false, 64, true>() + 4096 <= 227 * 1024,
              "the walking BF16 gate/up's tile fits");

/* A position in the stage ring: stage s, the parity of its current use, and whether the ring has
 * wrapped once (a producer waits for a stage's release only from its second use on). Carried step by
 * step, so no step divides by the stage count (a walking block's step count is a runtime value). */
template <int STAGES> struct ws_ring_pos {
    int s = 0;
    uint32_t ph = 0;
    bool lapped = false;
    __device__ __forceinline__ void next() {
        if (++s == STAGES) s = 0, ph ^= 1u, lapped = true;
    }
    __device__ __forceinline__ int back(int d) const {
        return s >= d ? s - d : s - d + STAGES;
    } /* d <= STAGES */
};

/* A work item: one row block of 256 x one NTOK-token block of an expert. */
struct ws_item {
    int rb, e, first, ncols; /* ncols 0: nothing to do (an odd tile, or past the rank's tiles) */
};

/* Item `item` of a rank (ws_item_place's order, gemm_plan.h). NTOK 128: the block of an expert's
 * even tile takes the odd one after it (128 tokens from `start`); odd tiles are empty items. */
template <int NTOK>
__device__ __forceinline__ ws_item ws_decode(const mm_buffer_layout &L, const uint8_t *mine, int item,
                                             int nrb, int tiles, int num_tiles) {
    int tile, rb;
    ws_item_place(item, nrb, tiles, &tile, &rb);
    ws_item it = {rb, 0, 0, 0};
    if (tile >= num_tiles) return it;
    const int start = ((const int32_t *)(mine + L.tile_start))[tile];
    if (start % NTOK != 0) return it;
    it.e = ((const int32_t *)(mine + L.tile_expert))[tile];
    it.first = ((const int32_t *)(mine + L.expert_offset))[it.e] + start;
    it.ncols = min(NTOK, ((const int32_t *)(mine + L.expert_count))[it.e] - start);
    return it;
}

/* The kernel in parts: column fill, producer (next item, one item's copies), consumer (next item, one
 * K step, one item) and epilogue, each run as the kernel's own code. Each part takes the kernel's
 * variables it reads (and the ring position and item count it advances) by reference, as a lambda of
 * the kernel would. NOTE: the fields are in the order the kernel's lambdas captured them (their first
 * use), which keeps the promotion order of the loop-carried values, and with it every instruction of
 * the 15 instances, what it was when the parts were lambdas of one 360-line kernel (dev/sass_diff.sh);
 * another order is as correct. */

/* Column i of item it (i < NTOK) into buffer buf: its slot code and, NVFP4 gate/up, its token's
 * activation scale. LOOP: the producer writes each item's; else the block's only item, the kernel. */
template <int PHASE, bool NVFP4, int NTOK, int NBUF> struct ws_fill_column {
    int (&col_code)[NBUF][NTOK];
    const mm_dev_shape &sh;
    const mm_buffer_layout &L;
    uint8_t *const *const &peers;
    uint8_t *const &mine;
    const bool &gth;
    const int &me;
    float (&col_scale)[NBUF][NTOK];
    __device__ void operator()(const ws_item &it, int i, int buf) const {
        slot_info si;
        col_code[buf][i] = tile_column<PHASE, NVFP4>(sh, L, peers, mine, gth, me, it.first, it.ncols, i, &si,
                                                     &col_scale[buf][i]);
    }
};

/* ---- producer: thread 0 bulk-copies the weights (and the TMA token tile), thread t token t's row ---- */

/* LOOP: thread 0 takes the next non-empty item for buffer n & 1 once the consumers let the buffer
 * go; at the end the ring's next stage completes with no bytes (item -1), which is how the consumers
 * learn it. */
template <int NTOK, int STAGES, int NBUF> struct ws_producer_next {
    const int &n;
    uint64_t (&colfree)[NBUF];
    const int &t;
    int *const &next_item;
    const int &nitems;
    const mm_buffer_layout &L;
    uint8_t *const &mine;
    const int &nrb, &ntiles;
    int (&item_id)[NBUF];
    ws_ring_pos<STAGES> &pos;
    uint64_t (&empty)[STAGES];
    uint64_t (&full)[STAGES];
    int *const &finished;
    __device__ ws_item operator()() const {
        const int buf = n & 1;
        if (n >= 2) mm_mbar_wait_parity(&colfree[buf], ((n >> 1) - 1) & 1);
        if (t == 0) {
            int id;
            ws_item it;
            do {
                id = atomicAdd(next_item, 1);
                it = id < nitems ? ws_decode<NTOK>(L, mine, id, nrb, ntiles, ntiles) : ws_item{0, 0, 0, 0};
            } while (id < nitems && it.ncols == 0);
            item_id[buf] = id < nitems ? id : -1;
        }
        mm_bar_sync<2, 128>();
        const int id = item_id[buf];
        if (id >= 0) return ws_decode<NTOK>(L, mine, id, nrb, ntiles, ntiles);
        if (pos.lapped) mm_mbar_wait_parity(&empty[pos.s], pos.ph ^ 1u);
        if (t == 0) {
            mm_mbar_arrive(&full[pos.s]); /* in place of the expect_tx */
            /* Every block's last add on next_item returned (its value ended the loop) before
             * its add on finished was issued, so the reset follows every add of this launch;
             * the next kernel on these counters reads them after griddepcontrol.wait (this
             * grid complete). */
            if (atomicAdd(finished, 1) == (int)gridDim.x - 1) {
                atomicExch(next_item, 0);
                atomicExch(finished, 0);
            }
        }
        mm_mbar_arrive(&full[pos.s]);
        return ws_item{0, 0, 0, 0};
    }
};

/* One item's K steps into the ring: each stage's two slabs of weights (and the token tile by TMA)
 * by thread 0's bulk copies, or token t's row by thread t's cp.async, signalled WS_LAG steps later. */
template <int PHASE, bool NVFP4, int NTOK, bool LOOP> struct ws_producer_item {
    using C = ws_cfg<NVFP4, NTOK>;
    static constexpr int NBUF = LOOP ? 2 : 1;
    const int &n, &t;
    const ws_fill_column<PHASE, NVFP4, NTOK, NBUF> &fill_column;
    const bool &tma;
    int (&col_code)[NBUF][NTOK];
    uint8_t *const &mine;
    const mm_buffer_layout &L;
    const mm_dev_shape &sh;
    const bool &gth;
    const int &me;
    uint8_t *const *const &peers;
    const int &rows_total, &nkc;
    ws_ring_pos<C::stages> &pos; /* runs on across the block's items */
    uint64_t (&empty)[C::stages];
    uint8_t *const &smem;
    uint64_t (&full)[C::stages];
    const CUtensorMap &tok_map;
    const uint8_t *const &wsrc0, *const &wsf0, *const &wbf0; /* the phase's codes and scales | bf16 weights */
    __device__ void operator()(const ws_item &it) const {
        const int buf = LOOP ? n & 1 : 0;
        /* LOOP: the item's columns; the consumers read them after their wait on the stages'
         * `full`, on which every producer thread arrives after these stores. */
        if (LOOP && t < NTOK) fill_column(it, t, buf);
        const int code = t < NTOK && !tma ? col_code[buf][t] : -1;
        const uint16_t *row = NULL;
        if (code >= 0) {
            if (PHASE == PHASE_DOWN)
                row = (const uint16_t *)(mine + L.act) + (size_t)(it.first + t) * sh.I;
            else {
                const slot_info si = gate_up_source(sh, gth, me, code, it.first + t);
                row = (const uint16_t *)(peers[si.src] + gate_up_rows(sh, L, gth)) + (size_t)si.token * sh.H;
            }
        }
        /* Token t's row: 128 bytes per K step at t * 128 of the stage, 16-byte chunk j at (j ^ (t & 7))
         * (the 128-byte swizzle). A token past the item copies zeros (src size 0) from a valid address. */
        const int src_bytes = row ? 16 : 0;
        if (!row) row = (const uint16_t *)(mine + L.slots);
        /* The item's two slabs, as slab indices of the whole weight matrix (all experts). */
        const long slab0 = (long)it.e * (rows_total / 128) + 2 * it.rb;
        for (int kc = 0; kc < nkc; kc++) {
            /* One item (LOOP false): the step is kc, and the compiler does better with it. */
            const int s = LOOP ? pos.s : kc % C::stages;
            if (LOOP ? pos.lapped : kc >= C::stages) /* its use before released */
                mm_mbar_wait_parity(&empty[s], LOOP ? pos.ph ^ 1u : ((kc / C::stages) - 1) & 1);
            uint8_t *st = smem + s * C::stage_bytes;
            if (t == 0) {
                mm_mbar_expect_tx(&full[s], 2 * C::slab_bytes + (tma ? C::tok_bytes : 0));
                /* Rows past the item (the next expert's, or past the matrix: zeros) fill columns
                 * the epilogue never stores; a wgmma column does not mix with the others. */
                if (tma) mm_tma_load_2d(st, &tok_map, kc * BK, it.first, &full[s]);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const size_t unit =
                        (size_t)((slab0 + j) * nkc + kc) * MM_SLAB_GROUPS; /* mm_layout_unit */
                    uint8_t *dst = st + C::tok_bytes + j * C::slab_bytes;
                    if (NVFP4) {
                        mm_bulk_copy(dst, wsrc0 + unit * 512, 4096, &full[s]);
                        mm_bulk_copy(dst + 4096, wsf0 + unit * 64, 512, &full[s]);
                    } else {
                        mm_bulk_copy(dst, wbf0 + unit * 2048, 16384, &full[s]);
                    }
                }
            }
            if (tma) { /* every producer thread arrives, as with copies of its own */
                mm_mbar_arrive(&full[s]);
                if (LOOP) pos.next();
                continue;
            }
            const uint32_t dst = mm_smem_u32(st) + t * 128;
            const uint16_t *src = row + (src_bytes ? (size_t)kc * BK : 0);
            if (t < NTOK) /* NTOK 64: threads 64..127 copy nothing but signal like the others */
#pragma unroll
                for (int j = 0; j < 8; j++)
                    cp_async16_zfill(dst + ((j ^ (t & 7)) << 4), src + (src_bytes ? 8 * j : 0), src_bytes);
            cp_async_commit();
            if (kc >= WS_LAG) {
                cp_async_wait<WS_LAG>(); /* this thread's copies of step kc - WS_LAG landed */
                mm_fence_proxy_async();
                mm_mbar_arrive(&full[LOOP ? pos.back(WS_LAG) : (kc - WS_LAG) % C::stages]);
            }
            if (LOOP) pos.next();
        }
        if (tma) return;
        cp_async_wait<0>();
        mm_fence_proxy_async();
        for (int d = min(WS_LAG, nkc); d >= 1; d--) /* steps nkc - d */
            mm_mbar_arrive(&full[LOOP ? pos.back(d) : (nkc - d) % C::stages]);
    }
};

/* ---- consumers: two warpgroups, a slab each, the wgmma over each stage's token tile ------------ */

/* LOOP: the next item, once the producer completed its first stage (or -1 there: the end). */
template <int NTOK, int STAGES, int NBUF> struct ws_consumer_next {
    uint64_t (&full)[STAGES];
    ws_ring_pos<STAGES> &pos;
    int (&item_id)[NBUF];
    const int &n;
    const mm_buffer_layout &L;
    uint8_t *const &mine;
    const int &nrb, &ntiles;
    __device__ ws_item operator()() const {
        mm_mbar_wait_parity(&full[pos.s], pos.ph);
        const int id = item_id[n & 1];
        return id >= 0 ? ws_decode<NTOK>(L, mine, id, nrb, ntiles, ntiles) : ws_item{0, 0, 0, 0};
    }
};

/* K step kc of consumer c: the stage's weights as A (NVFP4: decoded into registers a; BF16: read
 * by descriptor), the wgmma over its token tile; step kc - 1's registers (prev) and stage released. */
template <int PHASE, bool NVFP4, int NTOK, bool LOOP, bool SPLIT> struct ws_consumer_kstep {
    using C = ws_cfg<NVFP4, NTOK>;
    static constexpr bool promote = bf16_promote<PHASE, NVFP4>();
    ws_ring_pos<C::stages> &pos; /* runs on across the block's items */
    uint64_t (&full)[C::stages];
    uint8_t *const &smem;
    const int &c, &w, &lane; /* the consumer (slab), the warp in it, the lane */
    float (&acc)[GROUPS_PER_WARP][NTOK / 2];
    const bool &past64, &past96; /* SPLIT: the item has tokens past 64 / 96 (warp-uniform) */
    float (&part)[promote ? NTOK / 2 : 1];
    uint64_t (&empty)[C::stages];
    __device__ void operator()(int kc, a_regs &a, a_regs &prev) const {
        const int s = LOOP ? pos.s : kc % C::stages;
        mm_mbar_wait_parity(&full[s], LOOP ? pos.ph : (kc / C::stages) & 1);
        const uint8_t *st = smem + s * C::stage_bytes, *slab = st + C::tok_bytes + c * C::slab_bytes;
        const uint64_t db = desc_sw128(st);
        if constexpr (NVFP4) {
            a_raw<NVFP4> raw[GROUPS_PER_WARP];
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++) { /* group 2w + q of the slab */
                const int gq = 2 * w + q;
                raw[q].w[0] = *(const uint4 *)(slab + gq * 512 + lane * 16);
                raw[q].sf = *(const uint2 *)(slab + 4096 + gq * 64 + (lane >> 2) * 8);
            }
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int k = 0; k < 4; k++)
                    decode_a<NVFP4>(raw[q], k, a[q][k]);
            wgmma_fence();
            /* The wgmma over tokens t0 .. t0 + N - 1: t0 rows of 128 B into the token tile (t0 x 8 in
             * the descriptor's 16 B units), at accumulator t0 / 2. */
            auto token_part = [&](auto n, int t0) {
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int q = 0; q < GROUPS_PER_WARP; q++)
                        wgmma_rs<decltype(n)::value, !NVFP4>(acc[q] + t0 / 2, a[q][k], db + t0 * 8 + 2 * k,
                                                             kc > 0 || k > 0);
            };
            if constexpr (SPLIT) {
                /* Tokens 0-63, then 64-95 and 96-127 where the item has them; each element's chain
                 * is the same k16 steps as on m64n128. */
                token_part(std::integral_constant<int, 64>(), 0);
                if (past64) token_part(std::integral_constant<int, 32>(), 64);
                if (past96) token_part(std::integral_constant<int, 32>(), 96);
            } else {
                token_part(std::integral_constant<int, NTOK>(), 0);
            }
        } else {
            /* The slab step in core-matrix order (weight_layout.h): m64 block q of k16 step k starts
             * at 8-row block 8 q of piece row (k, h = 0); LBO 2 KB (k half), SBO 128 B (8 rows). */
            auto a_desc = [&](int q, int k) {
                return smem_desc(slab + ((2 * k) * 16 + 8 * q) * 128, 2048, 128);
            };
            if constexpr (promote) {
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++) {
                    wgmma_fence();
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        wgmma_ss_bf16<NTOK>(part, a_desc(q, k), db + 2 * k, k > 0);
                    wgmma_commit();
                    wgmma_wait<0>();
#pragma unroll
                    for (int i = 0; i < NTOK / 2; i++)
                        acc[q][i] = mm_add(acc[q][i], part[i]);
                }
            } else {
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int q = 0; q < GROUPS_PER_WARP; q++)
                        wgmma_ss_bf16<NTOK>(acc[q], a_desc(q, k), db + 2 * k, kc > 0 || k > 0);
            }
        }
        wgmma_commit();  /* (promote: an empty group, everything has retired) */
        wgmma_wait<1>(); /* step kc - 1 retired: its registers and its stage are free */
        if constexpr (NVFP4) keep_alive(prev);
        if (kc > 0 && lane == 0) mm_mbar_arrive(&empty[LOOP ? pos.back(1) : (kc - 1) % C::stages]);
        if (LOOP) pos.next();
    }
};

/* ---- epilogue: an item's accumulators out, staged in shared memory where there is room --------- */
template <int PHASE, bool NVFP4, int NTOK, bool LOOP>
__device__ __forceinline__ void
ws_epilogue(const float (&acc)[GROUPS_PER_WARP][NTOK / 2], const mm_dev_shape &sh, const mm_buffer_layout &L,
            uint8_t *const *peers, uint8_t *mine, const mm_dev_weights &W, const ws_item &it, int wgroup,
            int *col_code, float *col_scale, int lane, uint8_t *smem, int c, int t) {
    using C = ws_cfg<NVFP4, NTOK>;
    if constexpr (!LOOP) {
        /* The block's only item: the producer issued nothing past it, so every stage has landed
         * and, once both consumer warpgroups' wgmma retired (named barrier 1 over their 256
         * threads), been read. Not with LOOP: its producer fills the ring with the next item's
         * steps during the epilogue. */
        static_assert(NTOK * epi_stage_row<PHASE>() <= C::stages * C::stage_bytes,
                      "the staged tile fits the ring");
        static_assert(PHASE == PHASE_DOWN, "one item per block: down only (ws_instance_built)");
        staged_epilogue<PHASE, NVFP4, NTOK / 8, false>(acc, sh, L, peers, mine, W, it.e, it.first, it.ncols,
                                                       wgroup, col_code, col_scale, lane, smem, it.rb,
                                                       c * 128 + t, [] { mm_bar_sync<1, 256>(); });
        return;
    }
    uint8_t *const tile = smem + C::stages * C::stage_bytes;
    if constexpr (ws_own_tile<PHASE, NVFP4, LOOP>() && PHASE == PHASE_GATE_UP && NVFP4) {
        /* W4A16: the unrolled loop (the compact one is slower there); NVFP4 activations: the
         * compact one (their quantization unrolled does not fit beside the walk's state). */
        if (sh.bf16_act)
            staged_epilogue<PHASE, NVFP4, NTOK / 8, false>(acc, sh, L, peers, mine, W, it.e, it.first,
                                                           it.ncols, wgroup, col_code, col_scale, lane, tile,
                                                           it.rb, c * 128 + t, [] { mm_bar_sync<1, 256>(); });
        else
            staged_epilogue<PHASE, NVFP4, NTOK / 8, true>(acc, sh, L, peers, mine, W, it.e, it.first,
                                                          it.ncols, wgroup, col_code, col_scale, lane, tile,
                                                          it.rb, c * 128 + t, [] { mm_bar_sync<1, 256>(); });
    } else if (ws_own_tile<PHASE, NVFP4, LOOP>() && (PHASE == PHASE_GATE_UP || sh.local_ranks == sh.R)) {
        /* 64 token columns a pass (n-tiles 8 h .. 8 h + 7 of the accumulators). Under NCCL down's
         * p rows go to other GPUs: scattered stores there, as before (bulk stores to a peer's
         * memory not yet tried). */
#pragma unroll
        for (int h = 0; h < NTOK / 64; h++) {
            if (64 * h >= it.ncols) break; /* uniform over the block */
            float pass[GROUPS_PER_WARP][32];
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int i = 0; i < 32; i++)
                    pass[q][i] = acc[q][32 * h + i];
            staged_epilogue<PHASE, NVFP4, 8, false>(pass, sh, L, peers, mine, W, it.e, it.first + 64 * h,
                                                    min(64, it.ncols - 64 * h), wgroup, col_code + 64 * h,
                                                    col_scale + 64 * h, lane, tile, it.rb, c * 128 + t,
                                                    [] { mm_bar_sync<1, 256>(); });
        }
    } else
        gemm_epilogue<PHASE, NVFP4, NTOK / 8>(acc, sh, L, peers, mine, W, it.e, it.first, it.ncols,
                                              (it.ncols + 7) / 8, wgroup, col_code, col_scale, lane);
}

/* One item of consumer c: its K steps into the accumulators, two A register sets in turn, then
 * the epilogue and (LOOP) the item's columns let go. */
template <int PHASE, bool NVFP4, int NTOK, bool LOOP, bool SPLIT> struct ws_consumer_item {
    using C = ws_cfg<NVFP4, NTOK>;
    static constexpr int NBUF = LOOP ? 2 : 1;
    static constexpr bool promote = bf16_promote<PHASE, NVFP4>();
    float (&acc)[GROUPS_PER_WARP][NTOK / 2];
    bool &past64, &past96;
    const int &nkc;
    const ws_consumer_kstep<PHASE, NVFP4, NTOK, LOOP, SPLIT> &kstep;
    const int &lane;
    uint64_t (&empty)[C::stages];
    ws_ring_pos<C::stages> &pos;
    const int &n, &c, &w;
    const mm_dev_shape &sh;
    const mm_buffer_layout &L;
    uint8_t *const *const &peers;
    uint8_t *const &mine;
    const mm_dev_weights &W;
    int (&col_code)[NBUF][NTOK];
    float (&col_scale)[NBUF][NTOK];
    uint8_t *const &smem;
    const int &t;
    uint64_t (&colfree)[NBUF];
    __device__ void operator()(const ws_item &it) const {
        /* nkc is even (H and I are multiples of 256; the launcher checks). */
        a_regs a0, a1;
        /* LOOP: zeroed per item as well, so the accumulators are dead once the compact epilogue has
         * copied them (the wgmma's in-out operands would otherwise carry them through it: spills). */
        if constexpr (promote || LOOP)
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int i = 0; i < NTOK / 2; i++)
                    acc[q][i] = 0.0f;
        /* Votes: ptxas must see the branches around the wgmma as uniform, or it serializes them
         * (C7520). */
        if constexpr (SPLIT) {
            past64 = __all_sync(0xffffffffu, it.ncols > 64);
            past96 = __all_sync(0xffffffffu, it.ncols > 96);
        }
        for (int kc = 0; kc < nkc; kc += 2) {
            kstep(kc, a0, a1);
            kstep(kc + 1, a1, a0);
        }
        wgmma_wait<0>();
        if constexpr (SPLIT && !LOOP) { /* (LOOP zeroed them above) */
            if (!past96) {
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                    for (int i = 48; i < 64; i++)
                        acc[q][i] = 0.0f; /* columns the epilogue drops */
            }
            if (!past64) {
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                    for (int i = 32; i < 48; i++)
                        acc[q][i] = 0.0f;
            }
        }
        if constexpr (NVFP4) {
            keep_alive(a0);
            keep_alive(a1);
        }
        if (LOOP && lane == 0) mm_mbar_arrive(&empty[pos.back(1)]); /* the last step's stage */
        const int buf = LOOP ? n & 1 : 0,
                  wgroup = (2 * it.rb + c) * MM_SLAB_GROUPS + 2 * w; /* within the expert's rows */
        ws_epilogue<PHASE, NVFP4, NTOK, LOOP>(acc, sh, L, peers, mine, W, it, wgroup, col_code[buf],
                                              col_scale[buf], lane, smem, c, t);
        if (LOOP) {
            __syncwarp();
            if (lane == 0) mm_mbar_arrive(&colfree[buf]);
        }
    }
};

/* One block per item (LOOP false): blockIdx.x is the item of the launch's tile bound, in ws_decode's
 * order (the host knows the count, so the bound is tight). The walking grid (LOOP true): one block
 * per SM, each taking the rank's next non-empty item from a counter (the hardware's dynamic order
 * kept: the items in flight stay consecutive, no block idles with items left). Under NCCL, where
 * the host knows only a bound for every rank at T_max, and on one process for gate/up and, below
 * MM_WS_DOWN_WALK_MAX_K, NVFP4 down, where the epilogue (staged in a tile of its own) then overlaps
 * the next item's fill (gemm_plan.h ws_walks). Over a block's items the ring's stages run on (the
 * block's step, not the item's, picks the stage and the phase); the item number, column codes and
 * scales are double-buffered, the producer writing an item's buffer once the consumers' epilogue of
 * the item two before has let it go (colfree). Blocks never wait for each other. */
template <int PHASE, bool NVFP4, int NTOK, bool LOOP, bool SPLIT>
__global__ void __launch_bounds__(WS_THREADS, 1)
    sm90_expert_ws_kernel(mm_dev_shape sh, mm_buffer_layout L, uint8_t *const *peers,
                          const mm_dev_weights *weights, int tiles, gemm_rule rule,
                          const __grid_constant__ CUtensorMap tok_map, int tok_tma) {
    using C = ws_cfg<NVFP4, NTOK>;
    constexpr int NBUF = LOOP ? 2 : 1;
    mm_wait_previous();
    extern __shared__ uint8_t ws_smem_raw[];
    __shared__ __align__(8) uint64_t full[C::stages], empty[C::stages], colfree[NBUF];
    __shared__ int col_code[NBUF][NTOK];
    __shared__ float col_scale[NBUF][NTOK];
    __shared__ int item_id[NBUF]; /* LOOP: the block's items in turn, taken from the rank's counter */

    const int Kdim = PHASE == PHASE_GATE_UP ? sh.H : sh.I, nkc = Kdim / BK;
    const int rows_total = PHASE == PHASE_GATE_UP ? 2 * sh.I : sh.H, nrb = rows_total / MM_WS_ROWS;
    const int me = sh.first_rank + (int)blockIdx.z;
    uint8_t *mine = peers[me];
    /* Gate/up: this rank's gathered copy (then the token tile by TMA where the host made the map). */
    const bool gth = PHASE == PHASE_GATE_UP && rank_gathered(sh, L, mine);
    const bool tma = tok_tma && (PHASE == PHASE_DOWN || gth);
    const int num_tiles = *(const int32_t *)(mine + L.num_tiles);
    const int ntiles = min(tiles, num_tiles), nitems = nrb * ntiles;
    ws_item only = {0, 0, 0, 0}; /* LOOP false: the block's item */
    if constexpr (!LOOP) {
        only = ws_decode<NTOK>(L, mine, (int)blockIdx.x, nrb, tiles, num_tiles);
        if (only.ncols == 0) return;
    }
    const long slots = global_slots(sh, L, peers);
    if (gemm_device_choice<PHASE, NVFP4>(rule, sh, slots, nkc).kernel != (NTOK == 128 ? GEMM_WS : GEMM_WS64))
        return;                                                                  /* another kernel has it */
    if (NVFP4 && NTOK == 128 && (ws_split_n(slots, sh.E) != 0) != SPLIT) return; /* the other form has it */

    uint8_t *smem = ws_smem_raw + ((1024 - (mm_smem_u32(ws_smem_raw) & 1023)) & 1023); /* stays shared */
    const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127;
    const ws_fill_column<PHASE, NVFP4, NTOK, NBUF> fill_column = {col_code, sh,  L,  peers,
                                                                  mine,     gth, me, col_scale};
    if (!LOOP && tid < NTOK) fill_column(only, tid, 0);
    if (tid == 0) {
        for (int s = 0; s < C::stages; s++) {
            mm_mbar_init(&full[s], 128 + 1); /* every producer thread, and thread 0's expect_tx */
            mm_mbar_init(&empty[s], 8);      /* one arrival per consumer warp */
        }
        for (int b = 0; b < NBUF; b++)
            mm_mbar_init(&colfree[b], 8);
        mm_mbar_init_fence();
    }
    __syncthreads();
    const mm_dev_weights W = weights[blockIdx.z];
    int n = 0; /* items of this block so far (LOOP) */
    /* LOOP: the blocks take the rank's items in order from a counter (an atomic per item, so the
     * items in flight stay consecutive and no block waits with work left); the last block to find
     * none left resets it and its companion for the next launch. */
    int *const next_item = (int *)(mine + L.splitk_counters) + MM_WS_COUNTERS, *const finished =
                                                                                   next_item + 1;
    /* Runs role(item) over the block's non-empty items, counting them; next() gives each in turn,
     * ncols 0 at the end. */
    auto walk = [&](auto &&next, auto &&role) {
        if constexpr (LOOP) {
            for (;;) {
                const ws_item it = next();
                if (it.ncols == 0) break;
                role(it);
                n++;
            }
        } else {
            role(only);
        }
    };

    if (wg == 0) { /* producer */
        mm_setmaxnreg_dec<WS_PRODUCER_REGS>();
        const uint8_t *wsrc0 = PHASE == PHASE_GATE_UP ? W.w13 : W.w2;
        const uint8_t *wsf0 = PHASE == PHASE_GATE_UP ? W.w13_sf : W.w2_sf;
        const uint8_t *wbf0 = (const uint8_t *)(PHASE == PHASE_GATE_UP ? W.w13_bf16 : W.w2_bf16);
        ws_ring_pos<C::stages> pos; /* runs on across the block's items */
        const ws_producer_next<NTOK, C::stages, NBUF> next = {
            n, colfree, t, next_item, nitems, L, mine, nrb, ntiles, item_id, pos, empty, full, finished};
        walk(next, ws_producer_item<PHASE, NVFP4, NTOK, LOOP>{
                       n,          t,   fill_column, tma,   col_code, mine, L,       sh,    gth,  me,  peers,
                       rows_total, nkc, pos,         empty, smem,     full, tok_map, wsrc0, wsf0, wbf0});
        return;
    }

    /* consumers */
    mm_setmaxnreg_inc<WS_CONSUMER_REGS>();
    const int c = wg - 1, w = t >> 5, lane = t & 31;
    float acc[GROUPS_PER_WARP][NTOK / 2]; /* the first k16 step writes them (accumulate = 0) */
    /* BF16 gate/up (bf16_promote): the four k16 steps of a group and all NTOK tokens go into part
     * (m64nNTOK), added into acc in f32 once they retired; the two groups in turn (two waits per K
     * step), the other consumer warpgroup keeping the tensor cores busy meanwhile. A part of both
     * groups does not fit the registers at NTOK 128, nor do two parts in flight (144 B of spills in
     * the K loop); one of 128 tokens does, acc starting at zero per item (ptxas stack 0). */
    constexpr bool promote = bf16_promote<PHASE, NVFP4>();
    float part[promote ? NTOK / 2 : 1];
    ws_ring_pos<C::stages> pos;        /* runs on across the block's items */
    bool past64 = true, past96 = true; /* SPLIT: the item has tokens past 64 / 96 (warp-uniform) */
    const ws_consumer_next<NTOK, C::stages, NBUF> next = {full, pos, item_id, n, L, mine, nrb, ntiles};
    const ws_consumer_kstep<PHASE, NVFP4, NTOK, LOOP, SPLIT> kstep = {pos, full,   smem,   c,    w,    lane,
                                                                      acc, past64, past96, part, empty};
    walk(next, ws_consumer_item<PHASE, NVFP4, NTOK, LOOP, SPLIT>{
                   acc, past64, past96, nkc,  kstep, lane,     empty,     pos,  n, c,      w,
                   sh,  L,      peers,  mine, W,     col_code, col_scale, smem, t, colfree});
}

/* The instance table (gemm_plan.h ws_instance: row = phase | nvfp4 << 1 | 128 tokens << 2 | walk << 3
 * | split_n << 4), read by the launch and the opt-in; a row the plan never produces (ws_instance_built:
 * gate/up one item per block, split_n outside the NVFP4 128-token form) holds no kernel. */
using ws_kernel_fn = void (*)(mm_dev_shape, mm_buffer_layout, uint8_t *const *, const mm_dev_weights *, int,
                              gemm_rule, CUtensorMap, int);
struct ws_row {
    ws_kernel_fn kernel;
    int smem; /* the ring (+ the walking form's own epilogue tile), aligned to 1024 */
};
template <int ROW> static constexpr ws_row ws_row_of() {
    constexpr int phase = ROW & 1, ntok = (ROW >> 2) & 1 ? 128 : 64;
    constexpr bool nvfp4 = (ROW >> 1) & 1, walk = (ROW >> 3) & 1, split_n = (ROW >> 4) & 1;
    static_assert(ws_instance(phase, nvfp4, ntok == 128, walk, split_n) == ROW, "the row's axes");
    if constexpr (ws_instance_built(phase, nvfp4, ntok == 128, walk, split_n))
        return {sm90_expert_ws_kernel<phase, nvfp4, ntok, walk, split_n>,
                ws_smem<phase, nvfp4, ntok, walk>()};
    else
        return {nullptr, 0};
}
template <size_t... ROW>
static constexpr std::array<ws_row, sizeof...(ROW)> ws_rows(std::index_sequence<ROW...>) {
    return {{ws_row_of<ROW>()...}};
}
static const std::array<ws_row, WS_INSTANCES> ws_instances =
    ws_rows(std::make_index_sequence<WS_INSTANCES>());

/* The token tiles' tensor map: a box is the ws kernel's token tile of one K step. */
static megamoe_status tile_map_16bit(CUtensorMap *m, void *base, uint64_t rows, uint64_t K,
                                     uint32_t box_rows) {
    const CUresult r = mm_tile_map_16bit(m, base, rows, K, box_rows, CU_TENSOR_MAP_DATA_TYPE_UINT16);
    if (r == CUDA_ERROR_NOT_FOUND)
        return mm_cuda_error(cudaErrorNotSupported, "cuTensorMapEncodeTiled (driver entry point)", __FILE__,
                             __LINE__);
    if (r != CUDA_SUCCESS)
        return mm_cuda_error(cudaErrorInvalidValue, "cuTensorMapEncodeTiled", __FILE__, __LINE__);
    return MEGAMOE_OK;
}

megamoe_status sm90_expert_ws_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s) {
    const mm_dev_shape &sh = a.sh;
    const int rows = gemm_phase_rows(g.phase, sh.H, sh.I);
    if (sh.H % (2 * BK) != 0 || sh.I % (2 * BK) != 0 || rows % MM_WS_ROWS != 0)
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    const ws_row &k = ws_instances[g.instance];
    if (!k.kernel) return sm90_expert_gemm_unbuilt(g);
    /* The token tile by TMA (the plan's tma): down's act (every slot of the rank), or gate/up's
     * gathered copy. */
    CUtensorMap map;
    memset(&map, 0, sizeof map);
    if (g.tma) {
        const uint32_t ntok = g.kernel == GEMM_WS ? 128 : 64;
        const megamoe_status st =
            g.phase == PHASE_DOWN
                ? tile_map_16bit(&map, a.base0 + a.L.act, (uint64_t)sh.R * sh.T_max * sh.K, sh.I, ntok)
                : tile_map_16bit(&map, a.base0 + a.L.xg, (uint64_t)a.L.xg_rows, sh.H, ntok);
        if (st != MEGAMOE_OK) return st;
    }
    MM_CUDA_TRY(mm_launch(k.kernel, gemm_grid(g), WS_THREADS, k.smem, s, sh, a.L, a.peers, a.weights, g.tiles,
                          g.rule, map, g.tma));
    return MEGAMOE_OK;
}

megamoe_status sm90_expert_ws_prepare() {
    for (const ws_row &k : ws_instances) {
        if (!k.kernel) continue;
        MM_CUDA_TRY(cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
        MM_CUDA_TRY(cudaFuncSetAttribute(k.kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
    }
    return MEGAMOE_OK;
}
