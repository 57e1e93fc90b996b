/*
 * gemm/fragments.cuh -- what every expert GEMM kernel takes its operands with: the K step and the
 * weight fragments of weight_layout.h (loading, copying into shared memory, decoding to the A
 * registers of mma.sync and of wgmma's RS form), and the slots of a token tile (the B operand's
 * rows: where each token column reads its 16-bit activation row, and its scale).
 * Every kernel leaves the accumulators of a warp's two 16-row groups q over a tile's token columns in
 * acc[q][4 * nt + j]: row g + 8 (j >> 1), column 8 nt + 2c + (j & 1) (lane = 4g + c), the C layout
 * of mma.sync and the D layout of wgmma alike; gemm/epilogue.cuh takes them from there.
 */
#ifndef MEGAMOE_GEMM_FRAGMENTS_CUH
#define MEGAMOE_GEMM_FRAGMENTS_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../common.cuh"
#include "../gemm_plan.h" /* split-K plans and the kernel choice, shared with the host tests */
#include "../ptx/cp_async.cuh"
#include "../ptx/mma.cuh"
#include "weight_layout.h"

#define BK MM_FRAG_K      /* K per step: 64 */
#define GROUPS_PER_WARP 2 /* 16-row groups per warp: 32 rows, one NVFP4 block of gate/up  */
#define A_SLOT 576        /* one 16-row group's K step: 32 lanes x 16 B codes + 8 x 8 B scales */

/* BF16 gate/up: each 64-wide K step's tensor-core sums go into a fresh accumulator, added into the
 * running f32 sums with a round-to-nearest FADD, instead of one tensor-core chain over all of H. The
 * tensor cores' accumulation truncates (dev/sm90_accum_probe.cu: a bias toward zero growing with the
 * chain), and SPEC's a = bf16_rn(silu(g) . u) and y = bf16_rn(...) amplify an f32-level difference d
 * in g, u to about sqrt(d . 2^-8) in y: one chain put test_gpu's BF16 cases at 9.7e-4 to 1.08e-3 of
 * the 1e-3 bound against the CPU (MEGAMOE_TEST_SEED 0-4), a chain per K step at most 3.9e-4 in an
 * emulation of the arithmetic (docs/DECISIONS.md 30). The down projection's chain (over I, after the
 * rounding of a) moves y far less and keeps one chain; NVFP4 keeps one chain (its worst case,
 * 8.47e-4, is E2M1 code flips of the down input, and promoting would cost its prefill speed). */
template <int PHASE, bool NVFP4> constexpr bool bf16_promote() { return !NVFP4 && PHASE == PHASE_GATE_UP; }

static_assert(GROUPS_PER_WARP == 2, "ptx/wgmma.cuh a_regs: two groups per warp");

/* Where a gate/up column reads its 16-bit activation row: the staged token on its home rank (x_f16 or
 * x at row `token` of peers[src]), or where the ranks gathered (g = rank_gathered) rank me's own copy
 * at the slot's row (L.xg, sm90_gather_kernel). Its scale s is the routing's per-row copy, slot_scale. */
__device__ __forceinline__ slot_info gate_up_source(const mm_dev_shape &sh, bool g, int me, int code,
                                                    int row) {
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
 * the token's activation scale s for the NVFP4 gate/up -- or, with bf16 activations (W4A16), the
 * down input row's power of two for the down phase, which sm90_act_f16 wrote there -- (1 otherwise),
 * read beside the code from slot_scale. */
template <int PHASE, bool nvfp4>
__device__ __forceinline__ int tile_column(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                           uint8_t *const *peers, const uint8_t *mine, bool g, int me,
                                           int first, int ncols, int i, slot_info *si, float *scale) {
    const int code = i < ncols ? ((const int32_t *)(mine + L.slots))[first + i] : -1;
    *si = {0, 0, 0};
    if (code >= 0)
        *si = PHASE == PHASE_GATE_UP ? gate_up_source(sh, g, me, code, first + i) : decode_slot(sh, code);
    *scale = i < ncols && nvfp4 && (PHASE == PHASE_GATE_UP || sh.bf16_act)
                 ? ((const float *)(mine + L.slot_scale))[first + i]
                 : 1.0f;
    return code;
}

/* The token tile's columns, by threads 0..63 (tile_column). The caller synchronizes. */
template <int PHASE, bool nvfp4>
__device__ __forceinline__ void tile_columns(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                             uint8_t *const *peers, const uint8_t *mine, bool g, int me,
                                             int first, int ncols, int *col_code, int *col_src,
                                             int *col_token, float *col_scale) {
    const int tid = threadIdx.x;
    if (tid < MM_TILE_TOKENS) {
        slot_info si;
        col_code[tid] =
            tile_column<PHASE, nvfp4>(sh, L, peers, mine, g, me, first, ncols, tid, &si, &col_scale[tid]);
        col_src[tid] = si.src;
        col_token[tid] = si.token;
    }
}

/* The raw fragment data of one 16-row group for one K step. */
template <bool NVFP4> struct a_raw {
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
                v[j] = __ldg((
                    const uint32_t *)(bf16 + mm_layout_bf16_piece((int64_t)group, kc, nkc, s, j >> 1, j & 1) +
                                      off));
            r.w[s] = make_uint4(v[0], v[1], v[2], v[3]);
        }
    }
}

/* The A registers of k16 step s from the raw data. */
template <bool nvfp4> __device__ __forceinline__ void decode_a(const a_raw<nvfp4> &r, int s, uint32_t *a) {
    if constexpr (!nvfp4) {
        const uint32_t *w = (const uint32_t *)&r.w[s];
        for (int j = 0; j < 4; j++)
            a[j] = w[j];
        return;
    } else {
        /* weight_layout.h: A-form bits are f16 high bytes (code * 2^-14); B form becomes A form with two
         * shifts and two logic ops; one PRMT per register places two codes under zero low bytes. */
        const uint32_t word = ((const uint32_t *)&r.w[0])[s];
        const uint32_t a_form = word & 0x8E8E8E8Eu;
        const uint32_t b_form = ((word << 7) & 0x80808080u) | ((word >> 3) & 0x0E0E0E0Eu);
        const __half2 s2 = e4m3x2_to_half2(s < 2 ? r.sf.x : r.sf.y, s & 1); /* scales of rows g, g+8 */
        const __half2 s_g = __low2half2(s2), s_g8 = __high2half2(s2);
        a[0] = hmul2_bits(__byte_perm(a_form, 0u, 0x1404), s_g);
        a[1] = hmul2_bits(__byte_perm(a_form, 0u, 0x3424), s_g8);
        a[2] = hmul2_bits(__byte_perm(b_form, 0u, 0x1404), s_g);
        a[3] = hmul2_bits(__byte_perm(b_form, 0u, 0x3424), s_g8);
    }
}

/* Issues the copies of K step kc of a warp's groups into its ring of STAGES_ slots (none past the
 * end; the caller commits, so empty groups keep the wait counts uniform). NVFP4: 512 B of codes and
 * 64 of scales per group; BF16: 2 KB per group (slot = A_SLOT or 2048 bytes per group). */
template <int STAGES_, bool nvfp4>
__device__ __forceinline__ void issue_a(uint8_t *ring, const uint8_t *codes, const uint8_t *sf,
                                        const uint16_t *wb, size_t group0, int kc, int kc_end, int nkc,
                                        int lane) {
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
                    const uint16_t *piece =
                        wb + mm_layout_bf16_piece((int64_t)(group0 + q), kc, nkc, s, j >> 1, j & 1);
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
            const uint32_t a =
                (uint32_t)__cvta_generic_to_shared(slot + (4 * s + (lane >> 3)) * 128 + (lane & 7) * 16);
            ldmatrix_x4(r.w[s].x, r.w[s].y, r.w[s].z, r.w[s].w, a);
        }
    }
}

/* The group's token count, read from every rank's staged count through the peer table. */
__device__ inline long global_slots(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                    uint8_t *const *peers) {
    long t = 0;
    for (int p = 0; p < sh.R; p++)
        t += *(const int32_t *)(peers[p] + L.num_tokens);
    return t * sh.K;
}

/* plan_gemm_phase on the device, at the group's count (with NCCL only the device knows it; the host
 * launched every kernel that count may choose): the kernel gemm_choice names and the mma.sync
 * kernel's plan. Every GEMM kernel's blocks leave unless it names their family. The rules read the
 * shape's fields from sh where they use them: passed by value, they would be loaded up front, which
 * changes the kernels' code. */
template <int PHASE, bool NVFP4>
__device__ __forceinline__ gemm_phase_choice gemm_device_choice(gemm_rule rule, const mm_dev_shape &sh,
                                                                long slots, int nkc) {
    gemm_phase_choice c;
    c.mma =
        plan_splitk(slots, sh.E, PHASE == PHASE_GATE_UP ? 2 * sh.I / MM_MMA_ROWS : sh.H / MM_MMA_ROWS, nkc);
    c.kernel = gemm_choice(rule.override_kernel, slots, sh.E, c.mma.splits, NVFP4, min(sh.H, sh.I));
    return c;
}

#endif /* MEGAMOE_GEMM_FRAGMENTS_CUH */
