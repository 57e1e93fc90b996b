/*
 * sm90_gemm_common.cuh -- what the two expert GEMM kernels share: the weight fragments of
 * weight_layout.h (loading, copying into shared memory, decoding to A registers), the slots of a
 * token tile, the split-K plan, the choice between the kernels, and the epilogue that turns a warp's
 * accumulators into act (gate/up: SwiGLU + requant) or p (down).
 *   sm90_expert_gemm.cu:  mma.sync m16n8k16, 4 warps x 2 groups, split-K: few tokens per expert;
 *   sm90_expert_wgmma.cu: wgmma m64n64k16 with A from registers, 8 warps x 2 groups: many tokens.
 * Both leave the accumulators of a warp's two 16-row groups q over the tile's 64 token columns in
 * acc[q][4 * nt + j]: row g + 8 (j >> 1), column 8 nt + 2c + (j & 1) (lane = 4g + c), the C layout
 * of mma.sync and the D layout of wgmma alike.
 */
#ifndef MEGAMOE_SM90_GEMM_COMMON_CUH
#define MEGAMOE_SM90_GEMM_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "sm90_async.cuh" /* mm_bulk_store */
#include "weight_layout.h"

#define BK MM_FRAG_K            /* K per step: 64 */
#define GROUPS_PER_WARP 2       /* 16-row groups per warp: 32 rows, one NVFP4 block of gate/up  */
#define A_SLOT 576              /* one 16-row group's K step: 32 lanes x 16 B codes + 8 x 8 B scales */

enum { PHASE_GATE_UP = 0, PHASE_DOWN = 1 };

/* BF16 gate/up: each 64-wide K step's tensor-core sums go into a fresh accumulator, added into the
 * running f32 sums with a round-to-nearest FADD, instead of one tensor-core chain over all of H. The
 * tensor cores' accumulation truncates (dev/sm90_accum_probe.cu: a bias toward zero growing with the
 * chain), and SPEC's a = bf16_rn(silu(g) . u) and y = bf16_rn(...) amplify an f32-level difference d
 * in g, u to about sqrt(d . 2^-8) in y: one chain put test_gpu's BF16 cases at 9.7e-4 to 1.08e-3 of
 * the 1e-3 bound against the CPU (MEGAMOE_TEST_SEED 0-4), a chain per K step at most 3.9e-4 in an
 * emulation of the arithmetic (docs/DECISIONS.md 85). The down projection's chain (over I, after the
 * rounding of a) moves y far less and keeps one chain; NVFP4 keeps one chain (its worst case,
 * 8.47e-4, is E2M1 code flips of the down input, and promoting would cost its prefill speed). */
template <int PHASE, bool NVFP4>
constexpr bool bf16_promote() {
    return !NVFP4 && PHASE == PHASE_GATE_UP;
}

/* Where a gate/up column reads its 16-bit activation row: the staged token on its home rank (x_f16 or
 * x at row `token` of peers[src]), or where the ranks gathered (g = rank_gathered) rank me's own copy
 * at the slot's row (L.xg, sm90_gather_kernel). Its scale s is the routing's per-row copy, slot_scale. */
__device__ __forceinline__ slot_info gate_up_source(const mm_dev_shape &sh, bool g, int me, int code, int row) {
    if (g) return {me, row, 0};
    return decode_slot(sh, code);
}

/* A token tile of a rank's routing: its local expert, its first row of the rank's slots (and of act)
 * and its tokens (at most MM_TILE_TOKENS). */
struct tile_info {
    int e, first, ncols;
};

/* Two independent loads (the tile's expert, its rows): one memory latency, where reading the
 * expert's offset and count through its id took two. */
__device__ __forceinline__ tile_info load_tile(const mm_buffer_layout &L, const uint8_t *mine, int tile) {
    tile_info t;
    t.e = ((const int32_t *)(mine + L.tile_expert))[tile];
    const int2 rows = ((const int2 *)(mine + L.tile_rows))[tile];
    t.first = rows.x;
    t.ncols = rows.y;
    return t;
}

/* Column i of rank me's token tile whose slots start at `first` (mine = peers[me]): the slot's code
 * (-1 from ncols on), its home rank and token (gate/up: its gate_up_source; 0 for -1), and in *scale
 * the token's activation scale s for the NVFP4 gate/up (1 otherwise), read beside the code from the
 * routing's slot_scale. */
template <int PHASE, bool nvfp4>
__device__ __forceinline__ int tile_column(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                           const uint8_t *mine, bool g, int me, int first, int ncols, int i,
                                           slot_info *si, float *scale) {
    const int code = i < ncols ? ((const int32_t *)(mine + L.slots))[first + i] : -1;
    *si = {0, 0, 0};
    if (code >= 0) *si = PHASE == PHASE_GATE_UP ? gate_up_source(sh, g, me, code, first + i) : decode_slot(sh, code);
    *scale = i < ncols && nvfp4 && PHASE == PHASE_GATE_UP ? ((const float *)(mine + L.slot_scale))[first + i] : 1.0f;
    return code;
}

/* The token tile's columns, by threads 0..63 (tile_column). The caller synchronizes. */
template <int PHASE, bool nvfp4>
__device__ __forceinline__ void tile_columns(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                             const uint8_t *mine, bool g, int me, int first, int ncols, int *col_code, int *col_src,
                                             int *col_token, float *col_scale) {
    const int tid = threadIdx.x;
    if (tid < MM_TILE_TOKENS) {
        slot_info si;
        col_code[tid] = tile_column<PHASE, nvfp4>(sh, L, peers, mine, g, me, first, ncols, tid, &si, &col_scale[tid]);
        col_src[tid] = si.src;
        col_token[tid] = si.token;
    }
}

/* The raw fragment data of one 16-row group for one K step. */
template <bool NVFP4>
struct a_raw {
    uint4 w[NVFP4 ? 1 : 4]; /* NVFP4: codes of 4 k16 steps; BF16: k16 step i's registers 0..3 in w[i] */
    uint2 sf;               /* NVFP4: scales, bytes 2s / 2s+1 = rows g / g+8 of k16 step s */
};

template <bool nvfp4>
__device__ __forceinline__ void load_a(a_raw<nvfp4> &r, const uint8_t *codes, const uint8_t *sf,
                                       const uint16_t *bf16, size_t group, int kc, int nkc, int lane) {
    const size_t unit = (size_t)mm_layout_unit((int64_t)group, kc, nkc), frag = unit * 32 + lane;
    if constexpr (nvfp4) {
        r.w[0] = __ldg((const uint4 *)codes + frag);
        r.sf = __ldg((const uint2 *)sf + unit * 8 + (lane >> 2));
    } else { /* register j of step s: element 8g + 2c of piece (s, j >> 1, j & 1): 128 B per warp load */
        const int off = 8 * (lane >> 2) + 2 * (lane & 3);
        (void)unit;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            uint32_t v[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[j] = __ldg((const uint32_t *)(bf16 + mm_layout_bf16_piece((int64_t)group, kc, nkc, s, j >> 1, j & 1) + off));
            r.w[s] = make_uint4(v[0], v[1], v[2], v[3]);
        }
    }
}

/* The A registers of k16 step s from the raw data. */
template <bool nvfp4>
__device__ __forceinline__ void decode_a(const a_raw<nvfp4> &r, int s, uint32_t *a) {
    if constexpr (!nvfp4) {
        const uint32_t *w = (const uint32_t *)&r.w[s];
        for (int j = 0; j < 4; j++) a[j] = w[j];
        return;
    } else {
    /* weight_layout.h: A-form bits are f16 high bytes (code * 2^-14); B form becomes A form with two
     * shifts and two logic ops; one PRMT per register places two codes under zero low bytes. */
    const uint32_t word = ((const uint32_t *)&r.w[0])[s];
    const uint32_t a_form = word & 0x8E8E8E8Eu;
    const uint32_t b_form = ((word << 7) & 0x80808080u) | ((word >> 3) & 0x0E0E0E0Eu);
    const uint32_t sfw = (s < 2 ? r.sf.x : r.sf.y) >> (16 * (s & 1)); /* scale bytes of rows g, g+8 */
    const __half2_raw sr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(sfw & 0xFFFFu), __NV_E4M3);
    const __half2 s2 = *reinterpret_cast<const __half2 *>(&sr);
    const __half2 s_g = __low2half2(s2), s_g8 = __high2half2(s2);
    a[0] = hmul2_bits(__byte_perm(a_form, 0u, 0x1404), s_g);
    a[1] = hmul2_bits(__byte_perm(a_form, 0u, 0x3424), s_g8);
    a[2] = hmul2_bits(__byte_perm(b_form, 0u, 0x1404), s_g);
    a[3] = hmul2_bits(__byte_perm(b_form, 0u, 0x3424), s_g8);
    }
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(void *smem, const void *gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Issues the copies of K step kc of a warp's groups into its ring of STAGES_ slots (none past the
 * end; the caller commits, so empty groups keep the wait counts uniform). NVFP4: 512 B of codes and
 * 64 of scales per group; BF16: 2 KB per group (slot = A_SLOT or 2048 bytes per group). */
template <int STAGES_, bool nvfp4>
__device__ __forceinline__ void issue_a(uint8_t *ring, const uint8_t *codes, const uint8_t *sf, const uint16_t *wb,
                                        size_t group0, int kc, int kc_end, int nkc, int lane) {
    constexpr int slot_bytes = nvfp4 ? A_SLOT : 2048;
    if (kc < kc_end) {
#pragma unroll
        for (int q = 0; q < GROUPS_PER_WARP; q++) {
            uint8_t *slot = ring + ((kc % STAGES_) * GROUPS_PER_WARP + q) * slot_bytes;
            const size_t unit = (size_t)mm_layout_unit((int64_t)(group0 + q), kc, nkc);
            if constexpr (nvfp4) {
                cp_async16(slot + lane * 16, codes + unit * 512 + lane * 16);
                if (lane < 8) cp_async8(slot + 512 + lane * 8, sf + unit * 64 + lane * 8);
            } else { /* the group's 16 pieces of 128 B into the slot in (s, register j) order */
#pragma unroll
                for (int it = 0; it < 4; it++) {
                    const int i = lane + 32 * it, p = i >> 3, s = p >> 2, j = p & 3;
                    const uint16_t *piece = wb + mm_layout_bf16_piece((int64_t)(group0 + q), kc, nkc, s, j >> 1, j & 1);
                    cp_async16(slot + p * 128 + (i & 7) * 16, piece + (i & 7) * 8);
                }
                (void)unit;
            }
        }
    }
}

/* The raw data of a warp's group q for K step kc from its ring. */
template <int STAGES_, bool nvfp4>
__device__ __forceinline__ void ring_read(a_raw<nvfp4> &r, const uint8_t *ring, int kc, int q, int lane) {
    constexpr int slot_bytes = nvfp4 ? A_SLOT : 2048;
    const uint8_t *slot = ring + ((kc % STAGES_) * GROUPS_PER_WARP + q) * slot_bytes;
    if constexpr (nvfp4) {
        r.w[0] = *(const uint4 *)(slot + lane * 16);
        r.sf = *(const uint2 *)(slot + 512 + (lane >> 2) * 8);
    } else { /* matrix j of step s at slot + (4 s + j) * 128: one ldmatrix.x4 gives registers 0..3 */
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const uint32_t a = (uint32_t)__cvta_generic_to_shared(slot + (4 * s + (lane >> 3)) * 128 + (lane & 7) * 16);
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(r.w[s].x), "=r"(r.w[s].y), "=r"(r.w[s].z), "=r"(r.w[s].w)
                         : "r"(a));
        }
    }
}

__device__ __forceinline__ uint16_t to_f16_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }

/* ---- warpgroup MMA (the wgmma and warp-specialized kernels) ---------------------------------- */

/* Shared-memory matrix descriptor, no swizzle (dev/sm90_wgmma_probe.cu). */
__device__ __forceinline__ uint64_t smem_desc(const void *p, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}

/* K-major operand in 128-byte swizzled shared memory (1024-byte aligned): rows of 128 bytes, 8-row
 * groups 1024 bytes apart; +2 advances 32 bytes (one k16 step) within the swizzle atom. */
__device__ __forceinline__ uint64_t desc_sw128(const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* The "+f" operands of a wgmma accumulator in inline assembly: 32 floats from d[o] (m64n64), 64 from
 * d[0] (m64n128). */
#define MM_ACC8(d, o)                                                                                            \
    "+f"(d[(o) + 0]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3]), "+f"(d[(o) + 4]), "+f"(d[(o) + 5]),     \
        "+f"(d[(o) + 6]), "+f"(d[(o) + 7])
#define MM_ACC32(d, o) MM_ACC8(d, o), MM_ACC8(d, (o) + 8), MM_ACC8(d, (o) + 16), MM_ACC8(d, (o) + 24)
#define MM_ACC64(d) MM_ACC32(d, 0), MM_ACC32(d, 32)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* A warp's RS-wgmma A registers: [16-row group q][k16 step s][register]. */
using a_regs = uint32_t[GROUPS_PER_WARP][4][4];
/* Makes the compiler keep registers (an RS wgmma's A operand) unchanged and live up to here. */
__device__ __forceinline__ void keep_alive(a_regs &a) {
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) asm volatile("" : "+r"(a[q][s][j])::"memory");
}

#include "gemm_plan.h" /* split-K plans and the kernel choice, shared with the host tests */

/* The group's token count, read from every rank's staged count through the peer table. */
__device__ inline long global_slots(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers) {
    long t = 0;
    for (int p = 0; p < sh.R; p++) t += *(const int32_t *)(peers[p] + L.num_tokens);
    return t * sh.K;
}

/* The wgmma kernel of one phase over `tiles` token tiles of every local rank (host side). */
megamoe_status sm90_expert_wgmma_launch(int phase, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                        uint8_t *const *peers, const mm_dev_weights *weights, int tiles, int splits,
                                        int force, cudaStream_t s);
megamoe_status sm90_expert_wgmma_prepare();
/* The warp-specialized kernel of one phase over `tiles` token tiles of every local rank (host side),
 * with blocks of ntok (128: GEMM_WS, 64: GEMM_WS64) tokens. base0: local rank 0's buffer (the token
 * tiles' tensor map where the rows are slot-ordered and the process drives one rank). */
megamoe_status sm90_expert_ws_launch(int phase, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                     uint8_t *const *peers, uint8_t *base0, const mm_dev_weights *weights, int tiles,
                                     int ntok, int force, cudaStream_t s);
megamoe_status sm90_expert_ws_prepare();
/* The streaming kernel of one phase (NVFP4), a persistent grid over the tiles of every local rank. */
megamoe_status sm90_expert_stream_launch(int phase, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                         uint8_t *const *peers, const mm_dev_weights *weights, int tiles, long slots,
                                         int force, cudaStream_t s);
megamoe_status sm90_expert_stream_prepare();

/* Split-K across the blocks of one (row block, tile) workspace entry, for a block of THREADS threads
 * holding acc[q][n-tile * 4 + j] (8 n-tiles of 8 tokens, as the mma.sync and wgmma kernels do): the
 * block's values out (value v of thread tid at v * THREADS + tid: coalesced; only the n-tiles that
 * hold tokens), a fence, and a count on the entry's counter (self-reset). Every block but the last
 * of the entry returns false; the last adds all splits into acc in split order (deterministic) and
 * returns true. */
template <int THREADS>
__device__ __forceinline__ bool splitk_block_reduce(float (&acc)[GROUPS_PER_WARP][32], float *ws, int *counters,
                                                    size_t entry, int splits, int split, int ntiles_n, int tid) {
    __shared__ int is_last;
    constexpr size_t per_split = (size_t)GROUPS_PER_WARP * 32 * THREADS;
    float *mine = ws + (entry * splits + split) * per_split + tid;
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < ntiles_n)
#pragma unroll
                for (int j = 0; j < 4; j++) __stcg(mine + (size_t)((q * 8 + i) * 4 + j) * THREADS, acc[q][i * 4 + j]);
    __syncthreads(); /* the block's partial sums before thread 0's release */
    if (tid == 0) {
        mm_fence_acq_rel_gpu(); /* release: the partial sums before the count */
        int *counter = counters + entry;
        is_last = atomicAdd(counter, 1) == splits - 1;
        if (is_last) {
            *counter = 0;           /* ready for the next forward */
            mm_fence_acq_rel_gpu(); /* acquire: the other splits' partial sums after the count */
        }
    }
    __syncthreads();
    if (!is_last) return false;
    const float *all = ws + entry * splits * per_split + tid;
#pragma unroll
    for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < ntiles_n)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const size_t v = (size_t)((q * 8 + i) * 4 + j) * THREADS;
                    float sum = __ldcg(all + v); /* split 0 first: no 0 + (-0) */
                    for (int sp = 1; sp < splits; sp++) sum += __ldcg(all + sp * per_split + v);
                    acc[q][i * 4 + j] = sum;
                }
    return true;
}

/* v[0] <- v[1] <- ... <- v[N-1] <- v[0]: constant indices only, so a loop that is not unrolled can
 * walk an array that stays in registers (a run-time index would put it in local memory). */
template <int N, class T>
__device__ __forceinline__ void rotate_left(T (&v)[N]) {
    const T first = v[0];
#pragma unroll
    for (int k = 0; k + 1 < N; k++) v[k] = v[k + 1];
    v[N - 1] = first;
}

/* The epilogue of one warp: its groups wgroup, wgroup + 1 (index within the expert's rows).
 * COMPACT: the loop over the warp's values is not unrolled (they rotate through registers), for a
 * caller that runs it once or a few times per block -- the streaming kernel at decode, where the
 * unrolled epilogue (~13 KB of code in the split-K finisher) was fetched cold by every SM at once
 * (the L2 flush evicts code too): the trace of Qwen3-like T = 1 showed the finishers ending ~6 us
 * after their sums, all at one instant). */
/* STAGED (the ws and wgmma kernels' one-item blocks): the values go to shared memory instead, column
 * col's row at `stage` + col * EPI_STAGE_ROW bytes (down: f32 of rows row0.., gate/up: 16-bit act of
 * intermediate indices row0..), for the block's bulk stores (staged_epilogue). */
#define EPI_STAGE_ROW 1040 /* 256 f32 or 128 16-bit values + 16 B: a column's 8 lanes (c) on other banks */
template <int PHASE, bool nvfp4, int NT = 8, bool COMPACT = false, bool STAGED = false>
__device__ __forceinline__ void gemm_epilogue(const float (&acc)[GROUPS_PER_WARP][NT * 4], const mm_dev_shape &sh,
                                              const mm_buffer_layout &L, uint8_t *const *peers, uint8_t *mine,
                                              const mm_dev_weights &W, int e, int first, int ncols, int ntiles_n,
                                              int wgroup, const int *col_code, const float *col_scale, int lane,
                                              uint8_t *stage = nullptr, int row0 = 0) {
    const int g = lane >> 2, c = lane & 3;
    /* The 2^-14 of each biased f16 decode: weights always, activations in gate/up. Exact. */
    const float unbias = !nvfp4 ? 1.0f : PHASE == PHASE_GATE_UP ? 268435456.0f : 16384.0f;
    if constexpr (PHASE == PHASE_DOWN) {
        const float a2 = nvfp4 ? W.w2_in[e] : 1.0f, alpha2 = nvfp4 ? W.w2_alpha[e] : 1.0f;
        /* Column j (0 .. 2 NT - 1) of this lane is token column (j >> 1) * 8 + 2c + (j & 1); its values
         * v[2 q + r] = acc[q][(j >> 1) * 4 + 2 r + (j & 1)] are rows g + 8 r of group q. The column's p
         * row is decoded once for its four values (decoded per value, with a peer-table load each, it
         * was ~80 instructions a value: 17% of the streaming down kernel's warp samples at Qwen3-like
         * T = 128, session 14 call 7). */
        static_assert(GROUPS_PER_WARP == 2, "a column's four values: two groups, two rows each");
        auto column = [&](int j, const float (&v)[GROUPS_PER_WARP * 2]) {
            const int col = (j >> 1) * 8 + 2 * c + (j & 1);
            if (col >= ncols) return;
            float *row;
            int h0 = 0;
            if constexpr (STAGED) {
                row = (float *)(stage + col * EPI_STAGE_ROW);
                h0 = row0;
            } else {
                const slot_info si = decode_slot(sh, col_code[col]);
                row = (float *)(peers[si.src] + L.p) + ((size_t)si.token * sh.K + si.slot) * sh.H;
            }
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float p = v[2 * q + r];
                    if (nvfp4) p = mm_mul(mm_mul(mm_mul(p, unbias), a2), alpha2);
                    row[(wgroup + q) * 16 + g + 8 * r - h0] = p;
                }
        };
        if constexpr (COMPACT) {
            float v[GROUPS_PER_WARP * NT * 4]; /* column j's four values at 4 j */
#pragma unroll
            for (int j = 0; j < 2 * NT; j++)
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                    for (int r = 0; r < 2; r++) v[4 * j + 2 * q + r] = acc[q][(j >> 1) * 4 + 2 * r + (j & 1)];
#pragma unroll 1
            for (int j = 0; j < 2 * NT; j++) { /* column j's values in v[0..3] */
                const float cv[GROUPS_PER_WARP * 2] = {v[0], v[1], v[2], v[3]};
                column(j, cv);
#pragma unroll
                for (int k = 0; k < GROUPS_PER_WARP * 2; k++) rotate_left(v);
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                if (nt >= ntiles_n) break;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const float cv[GROUPS_PER_WARP * 2] = {acc[0][nt * 4 + half], acc[0][nt * 4 + 2 + half],
                                                           acc[1][nt * 4 + half], acc[1][nt * 4 + 2 + half]};
                    column(2 * nt + half, cv);
                }
            }
        }
    } else {
        /* Rows g (gate) and g+8 (up) of group q are intermediate index i = 8 * group + g. The warp's two
         * groups are one NVFP4 block of 16 indices of the down projection's input. */
        const float alpha_g = nvfp4 ? W.w13_alpha[e * 2] : 1.0f, alpha_u = nvfp4 ? W.w13_alpha[e * 2 + 1] : 1.0f;
        const float a2 = nvfp4 ? W.w2_in[e] : 1.0f, C = sh.clamp;
        const int i_base = wgroup * 8;
        uint16_t *act = (uint16_t *)(mine + L.act);
        /* Column col's gate and up values of both groups: SwiGLU, the NVFP4 block quantization (the
         * block's amax over the 8 lanes of the column), the stores. */
        auto column = [&](int col, const float (&gate)[GROUPS_PER_WARP], const float (&up)[GROUPS_PER_WARP]) {
            const float s = col_scale[col];
            float a[GROUPS_PER_WARP];
            float amax = 0.0f;
            for (int q = 0; q < GROUPS_PER_WARP; q++) {
                float gv = gate[q], uv = up[q];
                if (nvfp4) {
                    gv = mm_mul(mm_mul(mm_mul(gv, unbias), s), alpha_g);
                    uv = mm_mul(mm_mul(mm_mul(uv, unbias), s), alpha_u);
                }
                if (C > 0.0f) {
                    gv = fminf(gv, C);
                    uv = fminf(fmaxf(uv, -C), C);
                }
                a[q] = mm_mul(mm_div(gv, mm_add(1.0f, expf(-gv))), uv);
                amax = mm_max_nan(amax, mm_fabs(a[q]));
            }
            uint16_t out[GROUPS_PER_WARP];
            if (nvfp4) {
                for (int o = 4; o <= 16; o <<= 1) amax = mm_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
                const float sf = mm_e4m3_to_f32(mm_e4m3_rn(mm_div(amax, mm_mul(a2, 6.0f))));
                for (int q = 0; q < GROUPS_PER_WARP; q++) {
                    const float v = sf == 0.0f ? 0.0f : mm_e2m1_to_f32(mm_e2m1_rn(mm_div(a[q], mm_mul(sf, a2)))) * sf;
                    out[q] = to_f16_bits(v);
                }
            } else {
                for (int q = 0; q < GROUPS_PER_WARP; q++) out[q] = mm_f32_to_bf16(a[q]);
            }
            if (col < ncols)
                for (int q = 0; q < GROUPS_PER_WARP; q++) {
                    if constexpr (STAGED)
                        ((uint16_t *)(stage + col * EPI_STAGE_ROW))[i_base + q * 8 + g - row0] = out[q];
                    else
                        act[(size_t)(first + col) * sh.I + i_base + q * 8 + g] = out[q];
                }
        };
        if constexpr (COMPACT) {
            /* (n-tile, half) pair j: gate values i = 4 (j >> 1) + (j & 1), up values i + 2, in gate[][0] / up[][0] */
            float gate[GROUPS_PER_WARP][2 * NT], up[GROUPS_PER_WARP][2 * NT];
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int j = 0; j < 2 * NT; j++) {
                    gate[q][j] = acc[q][(j >> 1) * 4 + (j & 1)];
                    up[q][j] = acc[q][(j >> 1) * 4 + 2 + (j & 1)];
                }
#pragma unroll 1
            for (int j = 0; j < 2 * ntiles_n; j++) { /* column half j & 1: uniform across the column's 8 lanes */
                float g0[GROUPS_PER_WARP], u0[GROUPS_PER_WARP];
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++) g0[q] = gate[q][0], u0[q] = up[q][0];
                column((j >> 1) * 8 + 2 * c + (j & 1), g0, u0);
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++) rotate_left(gate[q]), rotate_left(up[q]);
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                if (nt >= ntiles_n) break;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    float gate[GROUPS_PER_WARP], up[GROUPS_PER_WARP];
                    for (int q = 0; q < GROUPS_PER_WARP; q++) gate[q] = acc[q][nt * 4 + half], up[q] = acc[q][nt * 4 + 2 + half];
                    column(nt * 8 + 2 * c + half, gate, up); /* uniform validity across the 8 lanes of a column */
                }
            }
        }
    }
}

/* A one-item block's epilogue through shared memory (the ws and wgmma kernels): once sync() has
 * passed (every wgmma of the block retired, so its rings are free), the warps write their values
 * into `stage` (gemm_epilogue STAGED: rows of EPI_STAGE_ROW bytes per token column of the block's 256
 * rows, row block rb), fence them for the async proxy, and after a second sync() thread ct < ncols
 * sends token column ct's row with one bulk store -- 1 KB of f32 p (down) or 256 B of act (gate/up) --
 * instead of one 4- or 2-byte scattered store per value, each down value with its own slot decode
 * (ncu, session 15 call 2, DSv3 T = 8192: the scattered epilogue was 56% of the ws down kernel's
 * warp samples and 34% of gate/up's). sync: a barrier over the threads that hold accumulators. */
template <int PHASE, bool nvfp4, int NT, bool COMPACT, class Sync>
__device__ __forceinline__ void staged_epilogue(const float (&acc)[GROUPS_PER_WARP][NT * 4], const mm_dev_shape &sh,
                                                const mm_buffer_layout &L, uint8_t *const *peers, uint8_t *mine,
                                                const mm_dev_weights &W, int e, int first, int ncols, int wgroup,
                                                const int *col_code, const float *col_scale, int lane,
                                                uint8_t *stage, int rb, int ct, Sync sync) {
    const int row0 = PHASE == PHASE_DOWN ? rb * 256 : rb * 128;
    sync();
    gemm_epilogue<PHASE, nvfp4, NT, COMPACT, true>(acc, sh, L, peers, mine, W, e, first, ncols, (ncols + 7) / 8,
                                                   wgroup, col_code, col_scale, lane, stage, row0);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* this thread's rows, for the bulk stores */
    sync();
    if (ct >= ncols) return;
    uint8_t *dst;
    uint32_t bytes;
    if constexpr (PHASE == PHASE_DOWN) {
        const slot_info si = decode_slot(sh, col_code[ct]);
        dst = peers[si.src] + L.p + (((size_t)si.token * sh.K + si.slot) * sh.H + row0) * 4;
        bytes = 256 * 4;
    } else {
        dst = mine + L.act + ((size_t)(first + ct) * sh.I + row0) * 2;
        bytes = 128 * 2;
    }
    mm_bulk_store(dst, stage + ct * EPI_STAGE_ROW, bytes);
    mm_bulk_store_drain();
}

#endif /* MEGAMOE_SM90_GEMM_COMMON_CUH */
