/*
 * gemm/epilogue.cuh -- the epilogue that turns a warp's accumulators into act (gate/up: scales,
 * clamp, SwiGLU, the NVFP4 requantization or bf16) or p (down: a2 -- with bf16 activations the act
 * row's power of two (sm90_act_f16.cu) -- and alpha_2, written into the home
 * rank's buffer), either straight from registers or staged through shared memory and sent with one
 * bulk store per token column.
 */
#ifndef MEGAMOE_GEMM_EPILOGUE_CUH
#define MEGAMOE_GEMM_EPILOGUE_CUH

#include "fragments.cuh"
#include "../ptx/bulk_copy.cuh"
#include "../ptx/sync.cuh"

/* v[0] <- v[1] <- ... <- v[N-1] <- v[0]: constant indices only, so a loop that is not unrolled can
 * walk an array that stays in registers (a run-time index would put it in local memory). */
template <int N, class T> __device__ __forceinline__ void rotate_left(T (&v)[N]) {
    const T first = v[0];
#pragma unroll
    for (int k = 0; k + 1 < N; k++)
        v[k] = v[k + 1];
    v[N - 1] = first;
}

/* The epilogue of one warp: its groups wgroup, wgroup + 1 (index within the expert's rows).
 * COMPACT: the loop over the warp's values is not unrolled (they rotate through registers), for a
 * caller that runs it once or a few times per block -- the streaming kernel at decode, where the
 * unrolled epilogue (~13 KB of code in the split-K finisher) is fetched cold by every SM at once
 * (an L2 flush evicts code too) and the finishers end microseconds after their sums, all at one
 * instant. */
/* STAGED (the ws and wgmma kernels' one-item blocks): the values go to shared memory instead, column
 * col's row at `stage` + col * epi_stage_row bytes (down: f32 of rows row0.., gate/up: 16-bit act of
 * intermediate indices row0..), for the block's bulk stores (staged_epilogue). */
/* Bytes per staged column: down 256 f32, gate/up 128 16-bit values, + 16 B so that a warp's stores
 * (four columns 2 apart, 16 B each) fall on other banks. */
template <int PHASE> constexpr int epi_stage_row() {
    return PHASE == PHASE_DOWN ? 256 * 4 + 16 : 128 * 2 + 16;
}
/* The epilogue's column of each phase, run as gemm_epilogue's own code: it takes gemm_epilogue's
 * variables by reference, as a lambda of it would. NOTE: in the order such a lambda captured them
 * (first use), which keeps every instruction of the GEMM kernels what it was with the columns as
 * lambdas (dev/sass_diff.sh); another order is as correct. */

/* Down: column j (0 .. 2 NT - 1) of this lane is token column (j >> 1) * 8 + 2c + (j & 1); its values
 * v[2 q + r] = acc[q][(j >> 1) * 4 + 2 r + (j & 1)] are rows g + 8 r of group q. The column's p row is
 * decoded once for its four values (decoded per value, with a peer-table load each, it costs ~80
 * instructions a value). */
template <bool nvfp4, bool STAGED> struct epi_down_column {
    const int &c, &ncols;
    const mm_dev_shape &sh;
    const float *const &col_scale;
    const float &a2;
    uint8_t *const &stage;
    const int &row0;
    const int *const &col_code;
    uint8_t *const *const &peers;
    const mm_buffer_layout &L;
    const float &unbias, &alpha2;
    const int &wgroup, &g;
    __device__ void operator()(int j, const float (&v)[GROUPS_PER_WARP * 2]) const {
        const int col = (j >> 1) * 8 + 2 * c + (j & 1);
        if (col >= ncols) return;
        const float in_scale = sh.bf16_act ? col_scale[col] : a2; /* W4A16: the row's 2^e, else a2 */
        float *row;
        int h0 = 0;
        if constexpr (STAGED) {
            row = (float *)(stage + col * epi_stage_row<PHASE_DOWN>());
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
                if (nvfp4) p = mm_mul(mm_mul(mm_mul(p, unbias), in_scale), alpha2);
                row[(wgroup + q) * 16 + g + 8 * r - h0] = p;
            }
    }
};

/* Gate/up: column col's gate and up values of both groups: SwiGLU, the NVFP4 block quantization (the
 * block's amax over the 8 lanes of the column), the stores. Rows g (gate) and g+8 (up) of group q
 * are intermediate index i = 8 * group + g; the warp's two groups are one NVFP4 block of 16 indices
 * of the down projection's input. */
template <bool nvfp4, bool STAGED> struct epi_gate_up_column {
    const float *const &col_scale;
    const float &unbias, &alpha_g, &alpha_u, &C;
    const mm_dev_shape &sh;
    const float &a2;
    const int &ncols;
    uint8_t *const &stage;
    const int &i_base, &g, &row0;
    uint16_t *const &act;
    const int &first;
    __device__ void operator()(int col, const float (&gate)[GROUPS_PER_WARP],
                               const float (&up)[GROUPS_PER_WARP]) const {
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
        if (nvfp4 && !sh.bf16_act) {
            for (int o = 4; o <= 16; o <<= 1)
                amax = mm_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
            const float sf = mm_e4m3_to_f32(mm_e4m3_rn(mm_div(amax, mm_mul(a2, 6.0f))));
            for (int q = 0; q < GROUPS_PER_WARP; q++) {
                const float v =
                    sf == 0.0f ? 0.0f : mm_e2m1_to_f32(mm_e2m1_rn(mm_div(a[q], mm_mul(sf, a2)))) * sf;
                out[q] = to_f16_bits(v);
            }
        } else { /* BF16, and W4A16 (sm90_act_f16 makes it f16 for the down GEMM) */
            for (int q = 0; q < GROUPS_PER_WARP; q++)
                out[q] = mm_f32_to_bf16(a[q]);
        }
        if (col < ncols)
            for (int q = 0; q < GROUPS_PER_WARP; q++) {
                if constexpr (STAGED)
                    ((uint16_t *)(stage + col * epi_stage_row<PHASE_GATE_UP>()))[i_base + q * 8 + g - row0] =
                        out[q];
                else
                    act[(size_t)(first + col) * sh.I + i_base + q * 8 + g] = out[q];
            }
    }
};

template <int PHASE, bool nvfp4, int NT = 8, bool COMPACT = false, bool STAGED = false>
__device__ __forceinline__ void
gemm_epilogue(const float (&acc)[GROUPS_PER_WARP][NT * 4], const mm_dev_shape &sh, const mm_buffer_layout &L,
              uint8_t *const *peers, uint8_t *mine, const mm_dev_weights &W, int e, int first, int ncols,
              int ntiles_n, int wgroup, const int *col_code, const float *col_scale, int lane,
              uint8_t *stage = nullptr, int row0 = 0) {
    const int g = lane >> 2, c = lane & 3;
    /* The 2^-14 of each biased f16 decode: weights always, activations in gate/up. Exact. */
    const float unbias = !nvfp4 ? 1.0f : PHASE == PHASE_GATE_UP ? 268435456.0f : 16384.0f;
    if constexpr (PHASE == PHASE_DOWN) {
        const float a2 = nvfp4 ? W.w2_in[e] : 1.0f, alpha2 = nvfp4 ? W.w2_alpha[e] : 1.0f;
        static_assert(GROUPS_PER_WARP == 2, "a column's four values: two groups, two rows each");
        const epi_down_column<nvfp4, STAGED> column = {c,        ncols, sh, col_scale, a2,     stage,  row0,
                                                       col_code, peers, L,  unbias,    alpha2, wgroup, g};
        if constexpr (COMPACT) {
            float v[GROUPS_PER_WARP * NT * 4]; /* column j's four values at 4 j */
#pragma unroll
            for (int j = 0; j < 2 * NT; j++)
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                    for (int r = 0; r < 2; r++)
                        v[4 * j + 2 * q + r] = acc[q][(j >> 1) * 4 + 2 * r + (j & 1)];
#pragma unroll 1
            for (int j = 0; j < 2 * NT; j++) { /* column j's values in v[0..3] */
                const float cv[GROUPS_PER_WARP * 2] = {v[0], v[1], v[2], v[3]};
                column(j, cv);
#pragma unroll
                for (int k = 0; k < GROUPS_PER_WARP * 2; k++)
                    rotate_left(v);
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
        const float alpha_g = nvfp4 ? W.w13_alpha[e * 2] : 1.0f,
                    alpha_u = nvfp4 ? W.w13_alpha[e * 2 + 1] : 1.0f;
        const float a2 = nvfp4 ? W.w2_in[e] : 1.0f, C = sh.clamp;
        const int i_base = wgroup * 8;
        uint16_t *act = (uint16_t *)(mine + L.act);
        const epi_gate_up_column<nvfp4, STAGED> column = {
            col_scale, unbias, alpha_g, alpha_u, C, sh, a2, ncols, stage, i_base, g, row0, act, first};
        if constexpr (COMPACT) {
            /* (n-tile, half) pair j: gate values i = 4 (j >> 1) + (j & 1), up values i + 2, in gate[][0] /
             * up[][0] */
            float gate[GROUPS_PER_WARP][2 * NT], up[GROUPS_PER_WARP][2 * NT];
#pragma unroll
            for (int q = 0; q < GROUPS_PER_WARP; q++)
#pragma unroll
                for (int j = 0; j < 2 * NT; j++) {
                    gate[q][j] = acc[q][(j >> 1) * 4 + (j & 1)];
                    up[q][j] = acc[q][(j >> 1) * 4 + 2 + (j & 1)];
                }
#pragma unroll 1
            /* column half j & 1: uniform across the column's 8 lanes */
            for (int j = 0; j < 2 * ntiles_n; j++) {
                float g0[GROUPS_PER_WARP], u0[GROUPS_PER_WARP];
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++)
                    g0[q] = gate[q][0], u0[q] = up[q][0];
                column((j >> 1) * 8 + 2 * c + (j & 1), g0, u0);
#pragma unroll
                for (int q = 0; q < GROUPS_PER_WARP; q++)
                    rotate_left(gate[q]), rotate_left(up[q]);
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                if (nt >= ntiles_n) break;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    float gate[GROUPS_PER_WARP], up[GROUPS_PER_WARP];
                    for (int q = 0; q < GROUPS_PER_WARP; q++)
                        gate[q] = acc[q][nt * 4 + half], up[q] = acc[q][nt * 4 + 2 + half];
                    /* uniform validity across the 8 lanes of a column */
                    column(nt * 8 + 2 * c + half, gate, up);
                }
            }
        }
    }
}

/* A one-item block's epilogue through shared memory (the ws and wgmma kernels): once sync() has
 * passed (every wgmma of the block retired, so its rings are free), the warps write their values
 * into `stage` (gemm_epilogue STAGED: rows of epi_stage_row bytes per token column of the block's 256
 * rows, row block rb), fence them for the async proxy, and after a second sync() thread ct < ncols
 * sends token column ct's row with one bulk store -- 1 KB of f32 p (down) or 256 B of act (gate/up) --
 * instead of one 4- or 2-byte scattered store per value, each down value with its own slot decode
 * (the scattered stores dominate the ws kernels' warp samples at prefill). sync: a barrier over the
 * threads that hold accumulators. */
template <int PHASE, bool nvfp4, int NT, bool COMPACT, class Sync>
__device__ __forceinline__ void
staged_epilogue(const float (&acc)[GROUPS_PER_WARP][NT * 4], const mm_dev_shape &sh,
                const mm_buffer_layout &L, uint8_t *const *peers, uint8_t *mine, const mm_dev_weights &W,
                int e, int first, int ncols, int wgroup, const int *col_code, const float *col_scale,
                int lane, uint8_t *stage, int rb, int ct, Sync sync) {
    const int row0 = PHASE == PHASE_DOWN ? rb * 256 : rb * 128;
    sync();
    gemm_epilogue<PHASE, nvfp4, NT, COMPACT, true>(acc, sh, L, peers, mine, W, e, first, ncols,
                                                   (ncols + 7) / 8, wgroup, col_code, col_scale, lane, stage,
                                                   row0);
    mm_fence_proxy_async(); /* this thread's rows, for the bulk stores */
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
    mm_bulk_store(dst, stage + ct * epi_stage_row<PHASE>(), bytes);
    mm_bulk_store_drain();
}

#endif /* MEGAMOE_GEMM_EPILOGUE_CUH */
