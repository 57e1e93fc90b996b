/*
 * cpu/forward.c -- the CPU backend: SPEC §1-5 computed on the host, for R ranks inside one process.
 *
 * It is the executable specification, so it is written to be read: three phases, each a plain loop
 * nest, with the data really moving between the ranks' communication buffers.
 *   1. stage    (home rank)   x -> quantized x (NVFP4 activations) or a copy (BF16 activations: BF16
 *                             weights, and NVFP4 weights in W4A16 mode, SPEC §3b), ids, weights, state
 *   2. experts  (owner rank)  read peers' staged tokens routed to a local expert, run the SwiGLU MLP
 *                             and the post-expert norm, write p into the home rank's buffer by slot
 *   3. combine  (home rank)   y[t] = bf16( sum over slots j ascending of w[t,j] * p[t,j] )
 * A rank reaches its peers only through `base[]`, the array of the ranks' buffer addresses: the
 * same access pattern the device backends use with peer pointers.
 *
 * Arithmetic: f32 throughout. Dot products run in 8 interleaved f32 partial sums combined in a fixed
 * tree, so the result does not depend on the thread count or on R. NVFP4 operands are multiplied as
 * the exact values code * block_scale; the per-token s (or a2) and the global alpha multiply the
 * f32 sum afterwards: (sum * s) * alpha. Mathematically this is SPEC §3; see docs/DECISIONS.md.
 * With BF16 activations on NVFP4 weights (SPEC §3b) x and a stay bf16 values, and only alpha
 * multiplies the sums.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../formats.h"
#include "../internal.h"

static int mm_thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Decode tables: an E2M1 byte (two codes) to two floats; an E4M3 byte to its float. */
typedef struct decode_tables {
    float e2m1_pair[256][2];
    float e4m3[256];
} decode_tables;

static void tables_init(decode_tables *t) {
    for (int b = 0; b < 256; b++) {
        t->e2m1_pair[b][0] = mm_e2m1_to_f32((uint8_t)(b & 15));
        t->e2m1_pair[b][1] = mm_e2m1_to_f32((uint8_t)(b >> 4));
        t->e4m3[b] = mm_e4m3_to_f32((uint8_t)b);
    }
}

/* An NVFP4 row of n values -> code * block_scale (exact in f32). codes: [n/2], sf: [n/16]. */
static void decode_nvfp4_row(const decode_tables *t, const uint8_t *codes, const uint8_t *sf, int n,
                             float *out) {
    for (int b = 0; b < n / 16; b++) {
        const float s = t->e4m3[sf[b]];
        for (int j = 0; j < 8; j++) {
            const float *pair = t->e2m1_pair[codes[b * 8 + j]];
            out[b * 16 + 2 * j] = pair[0] * s;
            out[b * 16 + 2 * j + 1] = pair[1] * s;
        }
    }
}

static void decode_bf16_row(const uint16_t *in, int n, float *out) {
    for (int i = 0; i < n; i++)
        out[i] = mm_bf16_to_f32(in[i]);
}

/* NOTE: cloned for wider vector units; -ffp-contract=off keeps every clone's arithmetic identical
 * (the same lanes, the same adds, no FMA), so the result does not depend on the machine. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MM_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MM_VECTOR_CLONES
#endif

/* Fixed-order f32 dot products of four weight rows w[4][n] with one vector x[n] (n % 8 == 0). */
MM_VECTOR_CLONES static void dot4(const float *w0, const float *w1, const float *w2, const float *w3,
                                  const float *x, int n, float out[4]) {
    float a0[8] = {0}, a1[8] = {0}, a2[8] = {0}, a3[8] = {0};
    for (int k = 0; k < n; k += 8) {
        for (int j = 0; j < 8; j++) {
            a0[j] += w0[k + j] * x[k + j];
            a1[j] += w1[k + j] * x[k + j];
            a2[j] += w2[k + j] * x[k + j];
            a3[j] += w3[k + j] * x[k + j];
        }
    }
    float *acc[4] = {a0, a1, a2, a3};
    for (int r = 0; r < 4; r++) {
        const float *a = acc[r];
        out[r] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
}

static float sum_squares(const float *v, int n) {
    float a[8] = {0};
    for (int k = 0; k < n; k += 8)
        for (int j = 0; j < 8; j++)
            a[j] += v[k + j] * v[k + j];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* ---- Phase 1: stage a rank's tokens into its buffer -------------------------------------------- */

typedef struct bad_id {
    long count;
    int rank, token, slot, id;
} bad_id;

static void stage_rank(const megamoe_layer *l, int rank, const megamoe_forward_args *a, uint8_t *base,
                       bad_id *bad) {
    const mm_buffer_layout *L = &l->buffer->layout;
    const int T = a->num_tokens, K = l->config.top_k, H = l->config.hidden_size, E = l->config.num_experts;
    const int quantize_x = mm_layer_quantizes_activations(l);
    int32_t *num_tokens = (int32_t *)(base + L->num_tokens);
    int32_t *ids = (int32_t *)(base + L->topk_ids);     /* [T_max, K] */
    float *weights = (float *)(base + L->topk_weights); /* [T_max, K] */
    uint8_t *state = base + L->token_state;             /* [T_max]    */
    *num_tokens = T;
    if (T == 0) return;
    memcpy(ids, a->topk_ids, (size_t)T * (size_t)K * sizeof *ids);
    memcpy(weights, a->topk_weights, (size_t)T * (size_t)K * sizeof *weights);

#pragma omp parallel for num_threads(l->group->num_threads) schedule(static)
    for (int t = 0; t < T; t++) {
        const uint16_t *x = a->x + (size_t)t * (size_t)H; /* [H] bf16 */
        if (a->is_padding && a->is_padding[t]) {
            state[t] = MM_TOKEN_PADDING;
            continue;
        }
        int finite = 1;
        float amax = 0.0f;
        for (int h = 0; h < H; h++) {
            float v = mm_bf16_to_f32(x[h]);
            finite &= mm_isfinite(v);
            amax = mm_max_nan(amax, mm_fabs(v));
        }
        state[t] = finite ? MM_TOKEN_LIVE : MM_TOKEN_POISONED;
        if (!finite) continue;
        if (!quantize_x) {
            memcpy(base + L->x + (size_t)t * (size_t)H * 2, x, (size_t)H * 2);
            continue;
        }
        uint8_t *codes = base + L->x + (size_t)t * (size_t)H / 2;  /* [H/2]  */
        uint8_t *sf = base + L->x_sf + (size_t)t * (size_t)H / 16; /* [H/16] */
        const float s = mm_activation_scale(amax);
        ((float *)(base + L->x_scale))[t] = s;
        float block[16];
        for (int b = 0; b < H / 16; b++) {
            for (int i = 0; i < 16; i++)
                block[i] = mm_bf16_to_f32(x[b * 16 + i]);
            sf[b] = mm_quantize_block16(block, s, codes + b * 8);
        }
    }
    /* Ids are checked for every token that is not padding (padding ignores its slots). */
    for (int t = 0; t < T; t++) {
        if (state[t] == MM_TOKEN_PADDING) continue;
        for (int k = 0; k < K; k++) {
            const int id = ids[(size_t)t * K + k];
            if (id < -1 || id >= E) {
                if (bad->count++ == 0) {
                    bad->rank = rank;
                    bad->token = t;
                    bad->slot = k;
                    bad->id = id;
                }
            }
        }
    }
}

/* ---- Phase 2: one local expert ---------------------------------------------------------------- */

typedef struct slot_ref {
    int src, token, slot; /* home rank, token on that rank, top-k slot */
} slot_ref;

typedef struct expert_scratch {
    slot_ref *slots; /* [n]                                                           */
    float *x;        /* [n, H] activations: code * sf (NVFP4) or the bf16 value       */
    float *x_scale;  /* [n]    per-token s (NVFP4 activations), 1 for BF16             */
    float *gu;       /* [n, 2I] gate (0..I-1) and up (I..2I-1) after alpha and s       */
    float *act;      /* [n, I]  down-projection input: code * sf (NVFP4 activations)   */
                     /*         or the bf16 value                                      */
    float *p;        /* [n, H]  expert output                                          */
    size_t cap;      /* rows allocated                                                 */
} expert_scratch;

static void scratch_free(expert_scratch *s) {
    free(s->slots);
    free(s->x);
    free(s->x_scale);
    free(s->gu);
    free(s->act);
    free(s->p);
}

static int scratch_reserve(expert_scratch *s, size_t n, int H, int I) {
    if (n <= s->cap) return 1;
    scratch_free(s);
    s->slots = malloc(n * sizeof *s->slots);
    s->x = malloc(n * (size_t)H * sizeof(float));
    s->x_scale = malloc(n * sizeof(float));
    s->gu = malloc(n * 2 * (size_t)I * sizeof(float));
    s->act = malloc(n * (size_t)I * sizeof(float));
    s->p = malloc(n * (size_t)H * sizeof(float));
    s->cap = n;
    return s->slots && s->x && s->x_scale && s->gu && s->act && s->p;
}

/* out[i, row0..row0+nrows) = dot(w[row], x[i]) for rows decoded by `decode` into a thread buffer. */
typedef struct gemm_args {
    const decode_tables *tab;
    const uint8_t *codes; /* NVFP4: [rows, k/2] */
    const uint8_t *sf;    /* NVFP4: [rows, k/16] */
    const uint16_t *bf16; /* BF16:  [rows, k] */
    int rows, k;          /* weight matrix [rows, k] */
    const float *x;       /* [n, k] */
    int n;
    float *out; /* [n, rows] raw f32 sums */
    int num_threads;
} gemm_args;

static int gemm_rows(const gemm_args *g) {
    int ok = 1;
#pragma omp parallel num_threads(g->num_threads)
    {
        float *w = malloc((size_t)4 * (size_t)g->k * sizeof(float)); /* [4, k] decoded rows */
        if (!w) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp for schedule(dynamic, 2)
        for (int r0 = 0; r0 < g->rows; r0 += 4) {
            if (!w) continue;
            for (int q = 0; q < 4; q++) {
                const size_t row = (size_t)(r0 + q);
                if (g->codes)
                    decode_nvfp4_row(g->tab, g->codes + row * (size_t)g->k / 2,
                                     g->sf + row * (size_t)g->k / 16, g->k, w + (size_t)q * g->k);
                else
                    decode_bf16_row(g->bf16 + row * (size_t)g->k, g->k, w + (size_t)q * g->k);
            }
            for (int i = 0; i < g->n; i++) {
                float o[4];
                dot4(w, w + g->k, w + 2 * (size_t)g->k, w + 3 * (size_t)g->k, g->x + (size_t)i * g->k, g->k,
                     o);
                memcpy(g->out + (size_t)i * g->rows + r0, o, sizeof o);
            }
        }
        free(w);
    }
    return ok;
}

/* Runs local expert `le` of local rank `r` over every token routed to it from any rank. */
static megamoe_status run_expert(const megamoe_layer *l, int r, int le, uint8_t *const *base,
                                 const decode_tables *tab, expert_scratch *s) {
    const mm_buffer_layout *L = &l->buffer->layout;
    const megamoe_group *g = l->group;
    const int K = l->config.top_k, H = l->config.hidden_size, I = l->config.intermediate_size;
    const int nvfp4 = l->config.format == MEGAMOE_FORMAT_NVFP4; /* weights */
    const int qact = mm_layer_quantizes_activations(l);         /* activations, SPEC §3 vs §3b */
    const int expert = megamoe_group_rank(g, r) * l->experts_per_rank + le;
    const mm_rank_weights *w = &l->ranks[r];

    /* Gather the slots routed here, in (home rank, token, slot) order. */
    size_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !scratch_reserve(s, n, H, I)) return MEGAMOE_ERR_OUT_OF_MEMORY;
        n = 0;
        for (int src = 0; src < g->local_ranks; src++) {
            const int T = *(const int32_t *)(base[src] + L->num_tokens);
            const int32_t *ids = (const int32_t *)(base[src] + L->topk_ids);
            const uint8_t *state = base[src] + L->token_state;
            for (int t = 0; t < T; t++) {
                if (state[t] != MM_TOKEN_LIVE) continue;
                for (int k = 0; k < K; k++) {
                    if (ids[(size_t)t * K + k] != expert) continue;
                    if (pass == 1) s->slots[n] = (slot_ref){src, t, k};
                    n++;
                }
            }
        }
        if (n == 0) return MEGAMOE_OK;
    }

    /* Activations of the gathered tokens, read from their home ranks' buffers. */
    for (size_t i = 0; i < n; i++) {
        const slot_ref *sr = &s->slots[i];
        const uint8_t *b = base[sr->src];
        float *xi = s->x + i * (size_t)H;
        if (qact) {
            decode_nvfp4_row(tab, b + L->x + (size_t)sr->token * H / 2,
                             b + L->x_sf + (size_t)sr->token * H / 16, H, xi);
            s->x_scale[i] = ((const float *)(b + L->x_scale))[sr->token];
        } else {
            decode_bf16_row((const uint16_t *)(b + L->x) + (size_t)sr->token * H, H, xi);
            s->x_scale[i] = 1.0f;
        }
    }

    /* Gate/up: gu[i, j] = sum_k x[i, k] * W13[j, k]   (j < I gate, j >= I up) */
    gemm_args ga = {tab, NULL, NULL, NULL, 2 * I, H, s->x, (int)n, s->gu, g->num_threads};
    if (nvfp4) {
        ga.codes = w->w13 + (size_t)le * 2 * I * H / 2;
        ga.sf = w->w13_sf + (size_t)le * 2 * I * H / 16;
    } else {
        ga.bf16 = w->w13_bf16 + (size_t)le * 2 * I * H;
    }
    if (!gemm_rows(&ga)) return MEGAMOE_ERR_OUT_OF_MEMORY;

    /* SwiGLU, then the down projection's input: quantized with the static a2 (NVFP4 activations),
     * else rounded to bf16. */
    const float alpha_g = nvfp4 ? w->w13_alpha[le * 2] : 1.0f;
    const float alpha_u = nvfp4 ? w->w13_alpha[le * 2 + 1] : 1.0f;
    const float a2 = qact ? w->w2_input_scale[le] : 1.0f;
    const float C = l->config.activation_clamp;
#pragma omp parallel for num_threads(g->num_threads) schedule(static)
    for (size_t i = 0; i < n; i++) {
        const float *gu = s->gu + i * 2 * (size_t)I;
        float *act = s->act + i * (size_t)I;
        float a[16];
        uint8_t codes[8];
        for (int b = 0; b < I / 16; b++) {
            for (int j = 0; j < 16; j++) {
                const int col = b * 16 + j;
                float gv = gu[col], uv = gu[I + col];
                if (qact) {
                    gv = mm_mul(mm_mul(gv, s->x_scale[i]), alpha_g);
                    uv = mm_mul(mm_mul(uv, s->x_scale[i]), alpha_u);
                } else if (nvfp4) {
                    gv = mm_mul(gv, alpha_g);
                    uv = mm_mul(uv, alpha_u);
                }
                if (C > 0.0f) {
                    gv = fminf(gv, C);
                    uv = fminf(fmaxf(uv, -C), C);
                }
                a[j] = gv / (1.0f + expf(-gv)) * uv;
            }
            if (qact) {
                const uint8_t sf = mm_quantize_block16(a, a2, codes);
                for (int j = 0; j < 8; j++) {
                    act[b * 16 + 2 * j] = tab->e2m1_pair[codes[j]][0] * tab->e4m3[sf];
                    act[b * 16 + 2 * j + 1] = tab->e2m1_pair[codes[j]][1] * tab->e4m3[sf];
                }
            } else {
                for (int j = 0; j < 16; j++)
                    act[b * 16 + j] = mm_bf16_to_f32(mm_f32_to_bf16(a[j]));
            }
        }
    }

    /* Down: p[i, h] = sum_n act[i, n] * W2[h, n] */
    gemm_args gd = {tab, NULL, NULL, NULL, H, I, s->act, (int)n, s->p, g->num_threads};
    if (nvfp4) {
        gd.codes = w->w2 + (size_t)le * H * I / 2;
        gd.sf = w->w2_sf + (size_t)le * H * I / 16;
    } else {
        gd.bf16 = w->w2_bf16 + (size_t)le * H * I;
    }
    if (!gemm_rows(&gd)) return MEGAMOE_ERR_OUT_OF_MEMORY;

    /* Scales, the post-expert RMSNorm, and the write into the home rank's buffer at (token, slot). */
    const float alpha_2 = nvfp4 ? w->w2_alpha[le] : 1.0f;
    const float *gamma = l->norm_gamma;
    const float eps = l->config.norm_eps;
#pragma omp parallel for num_threads(g->num_threads) schedule(static)
    for (size_t i = 0; i < n; i++) {
        float *p = s->p + i * (size_t)H;
        if (qact)
            for (int h = 0; h < H; h++)
                p[h] = mm_mul(mm_mul(p[h], a2), alpha_2);
        else if (nvfp4)
            for (int h = 0; h < H; h++)
                p[h] = mm_mul(p[h], alpha_2);
        if (gamma) {
            const float rms = 1.0f / sqrtf(sum_squares(p, H) / (float)H + eps);
            for (int h = 0; h < H; h++)
                p[h] = p[h] * rms * gamma[h];
        }
        const slot_ref *sr = &s->slots[i];
        float *dst = (float *)(base[sr->src] + L->p) + ((size_t)sr->token * K + sr->slot) * H;
        memcpy(dst, p, (size_t)H * sizeof *p);
    }
    return MEGAMOE_OK;
}

/* ---- Phase 3: combine on the home rank -------------------------------------------------------- */

static void combine_rank(const megamoe_layer *l, const megamoe_forward_args *a, const uint8_t *base,
                         float *acc_all) {
    const mm_buffer_layout *L = &l->buffer->layout;
    const int T = a->num_tokens, K = l->config.top_k, H = l->config.hidden_size, E = l->config.num_experts;
    const int32_t *ids = (const int32_t *)(base + L->topk_ids);
    const float *weights = (const float *)(base + L->topk_weights);
    const uint8_t *state = base + L->token_state;
    const float *p = (const float *)(base + L->p); /* [T_max, K, H] */
#pragma omp parallel for num_threads(l->group->num_threads) schedule(static)
    for (int t = 0; t < T; t++) {
        uint16_t *y = a->y + (size_t)t * H;
        if (state[t] != MM_TOKEN_LIVE) {
            const uint16_t fill = state[t] == MM_TOKEN_POISONED ? 0x7FC0 : 0x0000; /* SPEC §5 */
            for (int h = 0; h < H; h++)
                y[h] = fill;
            continue;
        }
        float *acc = acc_all + (size_t)mm_thread_index() * H;
        for (int h = 0; h < H; h++)
            acc[h] = 0.0f;
        for (int k = 0; k < K; k++) {
            const int id = ids[(size_t)t * K + k];
            if (id < 0 || id >= E) continue;
            const float wk = weights[(size_t)t * K + k];
            const float *pk = p + ((size_t)t * K + k) * H;
            for (int h = 0; h < H; h++)
                acc[h] = acc[h] + wk * pk[h];
        }
        for (int h = 0; h < H; h++)
            y[h] = mm_f32_to_bf16(acc[h]);
    }
}

megamoe_status mm_cpu_forward(megamoe_layer *l, const megamoe_forward_args *args) {
    const megamoe_group *g = l->group;
    uint8_t **base = (uint8_t **)l->buffer->rank_base; /* peer addresses of the ranks' buffers */
    decode_tables *tab = malloc(sizeof *tab);
    if (!tab) return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory");
    tables_init(tab);

    bad_id bad = {0, 0, 0, 0, 0};
    for (int r = 0; r < g->local_ranks; r++)
        stage_rank(l, megamoe_group_rank(g, r), &args[r], base[r], &bad);

    expert_scratch s = {0};
    megamoe_status st = MEGAMOE_OK;
    for (int r = 0; r < g->local_ranks && st == MEGAMOE_OK; r++)
        for (int le = 0; le < l->experts_per_rank && st == MEGAMOE_OK; le++)
            st = run_expert(l, r, le, base, tab, &s);
    scratch_free(&s);
    free(tab);
    if (st != MEGAMOE_OK) return mm_layer_fail(l, st, "out of host memory in the expert phase");

    float *acc = malloc((size_t)g->num_threads * (size_t)l->config.hidden_size * sizeof *acc);
    if (!acc) return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory in combine");
    for (int r = 0; r < g->local_ranks; r++)
        combine_rank(l, &args[r], base[r], acc);
    free(acc);

    if (bad.count)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_INPUT,
                             "rank %d token %d slot %d: expert id %d is outside [-1, %d) (%ld bad slot%s "
                             "skipped; y was written)",
                             bad.rank, bad.token, bad.slot, bad.id, l->config.num_experts, bad.count,
                             bad.count == 1 ? "" : "s");
    return MEGAMOE_OK;
}
