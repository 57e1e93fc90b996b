/*
 * layer.c -- the layer handle: creation rules (SPEC §1), weight loading and validation (SPEC §3-6),
 * finalize, and the forward entry point that checks its arguments and hands over to a backend.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "internal.h"


void megamoe_layer_config_init(megamoe_layer_config *config) {
    memset(config, 0, sizeof *config);
    config->name = "moe";
    config->format = MEGAMOE_FORMAT_NVFP4;
    config->activations = MEGAMOE_ACTIVATIONS_BF16;
    config->norm_eps = 1e-6f;
    config->norm_gain_center = 1.0f;
    config->timeout_ms = 10000;
}

const char mm_weight_only_hint[] =
    ": activations=nvfp4 quantizes the down projection's input with this static input scale; a weight-only "
    "NVFP4 export (no input scales: compressed-tensors NVFP4A16, ModelOpt W4A16) loads into a layer with "
    "activations=bf16 (SPEC §3b, §6)";

/* SPEC §1's size rules, the one place that states them: the layer config (create), the checkpoint
 * reader (describe, so inspect and quantize refuse what run refuses) and quantize all call this. 64-bit
 * arguments, so a dimension read from a file is checked before it is narrowed to int. */
megamoe_status mm_check_layer_shape(int64_t E, int64_t H, int64_t I, char *msg) {
    if (E < 1 || E > MM_MAX_EXPERTS) {
        mm_set_error(msg, "num_experts E=%lld must be in 1..%d", (long long)E, MM_MAX_EXPERTS);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (H < 256 || H % 256 != 0 || H > MM_MAX_DIM) {
        mm_set_error(msg, "hidden_size H=%lld must be a positive multiple of 256 (at most %d)", (long long)H,
                     MM_MAX_DIM);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (I < MM_I_MULTIPLE || I % MM_I_MULTIPLE != 0 || I > MM_MAX_DIM) {
        mm_set_error(msg, "intermediate_size I=%lld must be a positive multiple of %d (at most %d)",
                     (long long)I, MM_I_MULTIPLE, MM_MAX_DIM);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    return MEGAMOE_OK;
}

megamoe_status mm_check_activation_clamp(float clamp, char *msg) {
    if (!(clamp >= 0.0f) || !isfinite(clamp)) {
        mm_set_error(msg, "activation_clamp=%g must be finite and >= 0 (0 = off)", (double)clamp);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    return MEGAMOE_OK;
}

/* Checks SPEC §1's size rules; writes a message naming the rule and the values. */
static megamoe_status check_config(const megamoe_group *g, const megamoe_layer_config *c, char *msg) {
    const int R = g->world_size;
    if (c->format != MEGAMOE_FORMAT_NVFP4 && c->format != MEGAMOE_FORMAT_BF16) {
        mm_set_error(msg, "format %d is neither NVFP4 (0) nor BF16 (1)", (int)c->format);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (c->activations != MEGAMOE_ACTIVATIONS_BF16 && c->activations != MEGAMOE_ACTIVATIONS_NVFP4) {
        mm_set_error(msg, "activations %d is neither BF16 (0) nor NVFP4 (1)", (int)c->activations);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (c->format == MEGAMOE_FORMAT_BF16 && c->activations != MEGAMOE_ACTIVATIONS_BF16) {
        mm_set_error(msg, "activations=NVFP4 needs NVFP4 weights: a BF16-weight layer accepts only BF16 "
                          "activations (SPEC §3b)");
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    megamoe_status st = mm_check_layer_shape(c->num_experts, c->hidden_size, c->intermediate_size, msg);
    if (st) return st;
    if (c->num_experts % R != 0) {
        mm_set_error(msg, "num_experts E=%d must be a positive multiple of the ranks R=%d (E %% R == 0)",
                     c->num_experts, R);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (c->top_k < 1 || c->top_k > 32) {
        mm_set_error(msg, "top_k K=%d must be in 1..32", c->top_k);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (c->max_tokens < 1) {
        mm_set_error(msg, "max_tokens T_max=%d must be >= 1", c->max_tokens);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    uint64_t bytes;
    if (mm_mul_overflows_u64((uint64_t)c->max_tokens * (uint64_t)c->top_k, (uint64_t)c->hidden_size * 8,
                             &bytes) ||
        bytes > (1ull << 48)) {
        mm_set_error(msg, "max_tokens T_max=%d x top_k K=%d x hidden_size H=%d is too large for a buffer",
                     c->max_tokens, c->top_k, c->hidden_size);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (!(c->norm_eps > 0.0f) || !isfinite(c->norm_eps)) {
        mm_set_error(msg, "norm_eps=%g must be finite and > 0", (double)c->norm_eps);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (!isfinite(c->norm_gain_center)) {
        mm_set_error(msg, "norm_gain_center=%g must be finite", (double)c->norm_gain_center);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    st = mm_check_activation_clamp(c->activation_clamp, msg);
    if (st) return st;
    if ((int)c->gemm_kernel < MEGAMOE_GEMM_AUTO || (int)c->gemm_kernel > MEGAMOE_GEMM_WS64) {
        mm_set_error(msg, "gemm_kernel=%d must be 0 (chosen per forward), 1 (mma.sync), 2 (wgmma), 3 (streaming), 4 (warp-specialized) or 5 (warp-specialized, 64-token blocks)",
                     (int)c->gemm_kernel);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (c->timeout_ms < 1) {
        mm_set_error(msg, "timeout_ms=%d must be >= 1", c->timeout_ms);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    return MEGAMOE_OK;
}

/* Sizes of one expert's arrays, in elements. */
typedef struct expert_sizes {
    size_t w13, w13_sf, w2, w2_sf; /* codes and scales (NVFP4) or bf16 elements (BF16) */
} expert_sizes;

static expert_sizes sizes_of(const megamoe_layer_config *c) {
    const size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
    expert_sizes s;
    if (c->format == MEGAMOE_FORMAT_NVFP4) {
        s.w13 = 2 * I * H / 2;
        s.w13_sf = 2 * I * H / 16;
        s.w2 = H * I / 2;
        s.w2_sf = H * I / 16;
    } else {
        s.w13 = 2 * I * H;
        s.w13_sf = 0;
        s.w2 = H * I;
        s.w2_sf = 0;
    }
    return s;
}

static uint64_t expert_bytes(const megamoe_layer *layer) {
    expert_sizes s = sizes_of(&layer->config);
    if (layer->config.format == MEGAMOE_FORMAT_NVFP4)
        return s.w13 + s.w13_sf + s.w2 + s.w2_sf + 6 * sizeof(float);
    return 2 * (s.w13 + s.w2);
}

/* Checkpoint-layout bytes of all experts of all local ranks. */
static uint64_t local_weight_bytes(const megamoe_layer *l) {
    return expert_bytes(l) * (uint64_t)l->experts_per_rank * (uint64_t)l->group->local_ranks;
}

static void free_rank_weights(mm_rank_weights *w) {
    free(w->w13);
    free(w->w13_sf);
    free(w->w13_alpha);
    free(w->w13_input_scale);
    free(w->w2);
    free(w->w2_sf);
    free(w->w2_alpha);
    free(w->w2_input_scale);
    free(w->w13_bf16);
    free(w->w2_bf16);
    free(w->loaded);
}

static int alloc_rank_weights(mm_rank_weights *w, const megamoe_layer_config *c, int E_r) {
    expert_sizes s = sizes_of(c);
    const size_t n = (size_t)E_r;
    w->loaded = calloc(n, sizeof *w->loaded);
    if (c->format == MEGAMOE_FORMAT_NVFP4) {
        w->w13 = calloc(n, s.w13);
        w->w13_sf = calloc(n, s.w13_sf);
        w->w13_alpha = calloc(n * 2, sizeof(float));
        w->w13_input_scale = calloc(n * 2, sizeof(float));
        w->w2 = calloc(n, s.w2);
        w->w2_sf = calloc(n, s.w2_sf);
        w->w2_alpha = calloc(n, sizeof(float));
        w->w2_input_scale = calloc(n, sizeof(float));
        return w->loaded && w->w13 && w->w13_sf && w->w13_alpha && w->w13_input_scale && w->w2 && w->w2_sf &&
               w->w2_alpha && w->w2_input_scale;
    }
    w->w13_bf16 = calloc(n, s.w13 * 2);
    w->w2_bf16 = calloc(n, s.w2 * 2);
    return w->loaded && w->w13_bf16 && w->w2_bf16;
}

megamoe_status megamoe_layer_create(megamoe_group *group, const megamoe_layer_config *config,
                                    megamoe_layer **out) {
    if (!out) return MEGAMOE_ERR_INVALID_ARGUMENT;
    megamoe_layer *l = calloc(1, sizeof *l);
    *out = l;
    if (!l) return MEGAMOE_ERR_OUT_OF_MEMORY;
    snprintf(l->name, sizeof l->name, "%s", config && config->name ? config->name : "moe");
    if (!group || !config)
        return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "group and config must not be NULL");
    l->group = group;
    l->config = *config;
    l->config.name = l->name;
    char msg[MM_ERR_LEN];
    megamoe_status st = check_config(group, config, msg);
    if (st != MEGAMOE_OK) return mm_layer_fail(l, st, "%s", msg);
    l->experts_per_rank = config->num_experts / group->world_size;
    l->ranks = calloc((size_t)group->local_ranks, sizeof *l->ranks);
    if (!l->ranks) return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory");
    for (int r = 0; r < group->local_ranks; r++) {
        if (!alloc_rank_weights(&l->ranks[r], config, l->experts_per_rank))
            return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY,
                                 "out of host memory for the weights of %d experts", l->experts_per_rank);
    }
    st = mm_group_acquire_buffer(group, config, &l->buffer);
    if (st != MEGAMOE_OK) return mm_layer_fail(l, st, "cannot allocate the communication buffer");
    return MEGAMOE_OK;
}

void megamoe_layer_destroy(megamoe_layer *layer) {
    if (!layer) return;
    if (layer->device) layer->group->ops->layer_free(layer);
    if (layer->buffer) mm_group_release_buffer(layer->group, layer->buffer);
    if (layer->ranks) {
        for (int r = 0; r < layer->group->local_ranks; r++)
            free_rank_weights(&layer->ranks[r]);
        free(layer->ranks);
    }
    free(layer->norm_weight);
    free(layer->norm_gamma);
    free(layer);
}

const char *megamoe_layer_last_error(const megamoe_layer *layer) {
    return layer ? layer->error : "layer is NULL";
}

/* ---- Shape and dtype checks -------------------------------------------------------------------- */

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t pos = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && pos < n; i++)
        pos += (size_t)snprintf(buf + pos, n - pos, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (pos < n) snprintf(buf + pos, n - pos, "]");
}

/* Checks t against the expected dtype and shape; a trailing [1] may be absent or present where
 * allow_unit says so (scalars stored as [] or [1], per-expert scalars as [E] or [E, 1]). */
static megamoe_status check_tensor(megamoe_layer *l, const char *what, const megamoe_tensor *t,
                                   megamoe_dtype dtype, int ndim, const int64_t *shape, int allow_unit) {
    char want[128], got[128];
    if (!t || (!t->data && megamoe_tensor_numel(t) > 0) || t->ndim < 0 || t->ndim > MEGAMOE_MAX_DIMS)
        return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "%s: tensor is NULL or malformed", what);
    int shape_ok = t->ndim == ndim;
    for (int i = 0; shape_ok && i < ndim; i++)
        shape_ok = t->shape[i] == shape[i];
    if (!shape_ok && allow_unit && t->ndim == ndim + 1 && t->shape[ndim] == 1) {
        shape_ok = 1;
        for (int i = 0; shape_ok && i < ndim; i++)
            shape_ok = t->shape[i] == shape[i];
    }
    shape_str(want, sizeof want, ndim, shape);
    shape_str(got, sizeof got, t->ndim, t->shape);
    if (!shape_ok)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "%s: shape %s, expected %s%s", what, got, want,
                             allow_unit ? " (a trailing [1] is allowed)" : "");
    if (t->dtype != dtype)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "%s: dtype %s, expected %s", what,
                             megamoe_dtype_name(t->dtype), megamoe_dtype_name(dtype));
    return MEGAMOE_OK;
}

static megamoe_status check_not_finalized(megamoe_layer *l) {
    if (l->finalized)
        return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT,
                             "weights are finalized; load into a new layer instead");
    return MEGAMOE_OK;
}

/* Block scales: no E4M3 NaN (0x7F, 0xFF), nothing negative (sign bit set). */
static megamoe_status check_block_scales(megamoe_layer *l, const char *what, const uint8_t *sf, size_t n,
                                         int expert) {
    for (size_t i = 0; i < n; i++) {
        if (!mm_e4m3_scale_valid(sf[i]))
            return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT,
                                 "%s of expert %d: block-scale byte 0x%02X at element %zu is %s", what,
                                 expert, sf[i], i, (sf[i] & 0x7F) == 0x7F ? "an E4M3 NaN" : "negative");
    }
    return MEGAMOE_OK;
}

/* Global scales (weight_scale_2, w2_input_scale): finite, > 0, and small enough that the largest value
 * they decode to, 6 (E2M1) x 448 (E4M3) x scale, is a finite float: scale <= FLT_MAX / 2688 =
 * 1.2659e35. Every scale a quantizer derives from bf16 data, amax / 2688 <= 1.2610e35, passes. */
static megamoe_status check_global_scale(megamoe_layer *l, const char *what, float v, int expert) {
    if (!(v > 0.0f) || !isfinite(v) || v > FLT_MAX / 2688.0f)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT,
                             "%s of expert %d is %g; a global scale must be finite and > 0, and 6 x 448 x "
                             "scale (the largest value it decodes to) a finite float: at most %.5g",
                             what, expert, (double)v, (double)(FLT_MAX / 2688.0f));
    return MEGAMOE_OK;
}

/* BF16 weights: every element finite, as NVFP4 scales are checked (a NaN weight would turn whole rows
 * of y into NaN with no error). */
static megamoe_status check_bf16_finite(megamoe_layer *l, const char *what, const uint8_t *src, size_t n,
                                        int expert) {
    for (size_t i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, src + 2 * i, 2);
        if ((b & 0x7F80u) == 0x7F80u)
            return mm_layer_fail(
                l, MEGAMOE_ERR_BAD_WEIGHT,
                "%s of expert %d: element %zu is not finite (%s); BF16 weights must be finite", what, expert,
                i, (b & 0x7Fu) ? "NaN" : "an infinity");
    }
    return MEGAMOE_OK;
}

static float load_f32(const void *p, size_t i) {
    float v;
    memcpy(&v, (const uint8_t *)p + i * sizeof v, sizeof v);
    return v;
}

/* ---- The shape table both loaders derive from ------------------------------------------------- */

/* One expert's tensor of a projection and field as SPEC §3-4 store it: the weight [rows, cols/2] U8
 * (NVFP4) or [rows, cols] BF16, the block scales [rows, cols/16] E4M3, the global and input scales F32
 * scalars; rows x cols is [I, H] for gate and up, [H, I] for down. The stacked tensors are these with
 * the experts in front and gate and up rows concatenated ([E, 2I, ...]; scalars [E, 2] and [E]). */
static void expert_tensor_shape(const megamoe_layer_config *c, megamoe_proj proj, megamoe_field field,
                                megamoe_dtype *dt, int *ndim, int64_t shape[2]) {
    const int nvfp4 = c->format == MEGAMOE_FORMAT_NVFP4;
    const int64_t H = c->hidden_size, I = c->intermediate_size;
    const int64_t rows = proj == MEGAMOE_PROJ_DOWN ? H : I, cols = proj == MEGAMOE_PROJ_DOWN ? I : H;
    shape[0] = rows;
    *ndim = 2;
    switch (field) {
    case MEGAMOE_FIELD_WEIGHT:
        shape[1] = nvfp4 ? cols / 2 : cols;
        *dt = nvfp4 ? MEGAMOE_DTYPE_U8 : MEGAMOE_DTYPE_BF16;
        break;
    case MEGAMOE_FIELD_WEIGHT_SCALE:
        shape[1] = cols / 16;
        *dt = MEGAMOE_DTYPE_F8_E4M3;
        break;
    case MEGAMOE_FIELD_WEIGHT_SCALE_2:
    case MEGAMOE_FIELD_INPUT_SCALE:
        *ndim = 0;
        *dt = MEGAMOE_DTYPE_F32;
        break;
    }
}

/* ---- Stacked loading --------------------------------------------------------------------------- */

/* The stacked names: w13_* holds gate and up, w2_* down; each name is one field. */
static const struct {
    const char *name;
    int w13;
    megamoe_field field;
} k_stacked[] = {
    {"w13_weight", 1, MEGAMOE_FIELD_WEIGHT},
    {"w13_weight_scale", 1, MEGAMOE_FIELD_WEIGHT_SCALE},
    {"w13_weight_scale_2", 1, MEGAMOE_FIELD_WEIGHT_SCALE_2},
    {"w13_input_scale", 1, MEGAMOE_FIELD_INPUT_SCALE},
    {"w2_weight", 0, MEGAMOE_FIELD_WEIGHT},
    {"w2_weight_scale", 0, MEGAMOE_FIELD_WEIGHT_SCALE},
    {"w2_weight_scale_2", 0, MEGAMOE_FIELD_WEIGHT_SCALE_2},
    {"w2_input_scale", 0, MEGAMOE_FIELD_INPUT_SCALE},
};

/* Where a rank keeps a stacked tensor's experts (the checkpoint layout, experts back to back). */
static void *stacked_dst(mm_rank_weights *w, int w13, megamoe_field field, int nvfp4) {
    switch (field) {
    case MEGAMOE_FIELD_WEIGHT:
        return w13 ? (nvfp4 ? (void *)w->w13 : (void *)w->w13_bf16)
                   : (nvfp4 ? (void *)w->w2 : (void *)w->w2_bf16);
    case MEGAMOE_FIELD_WEIGHT_SCALE: return w13 ? w->w13_sf : w->w2_sf;
    case MEGAMOE_FIELD_WEIGHT_SCALE_2: return w13 ? w->w13_alpha : w->w2_alpha;
    case MEGAMOE_FIELD_INPUT_SCALE: return w13 ? w->w13_input_scale : w->w2_input_scale;
    }
    return NULL;
}

megamoe_status megamoe_layer_load_weight(megamoe_layer *l, const char *name, const megamoe_tensor *full) {
    if (!l) return MEGAMOE_ERR_INVALID_ARGUMENT;
    if (!name) return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "weight name is NULL");
    megamoe_status st = check_not_finalized(l);
    if (st) return st;
    int idx = -1;
    for (int i = 0; i < (int)(sizeof k_stacked / sizeof k_stacked[0]); i++)
        if (strcmp(k_stacked[i].name, name) == 0) idx = i;
    const int nvfp4 = l->config.format == MEGAMOE_FORMAT_NVFP4;
    if (idx < 0)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT,
                             "unexpected expert weight '%s' (expected w13_weight, w13_weight_scale, "
                             "w13_weight_scale_2, w13_input_scale, w2_weight, w2_weight_scale, "
                             "w2_weight_scale_2 or w2_input_scale)",
                             name);
    const int w13 = k_stacked[idx].w13;
    const megamoe_field field = k_stacked[idx].field;
    if (field != MEGAMOE_FIELD_WEIGHT && !nvfp4)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "unexpected expert weight '%s': the layer is BF16",
                             name);
    const int64_t E = l->config.num_experts;
    megamoe_dtype dt = MEGAMOE_DTYPE_F32;
    int pndim;
    int64_t pshape[2] = {0, 0};
    expert_tensor_shape(&l->config, w13 ? MEGAMOE_PROJ_GATE : MEGAMOE_PROJ_DOWN, field, &dt, &pndim, pshape);
    /* [E, rows (x 2 for w13), cols]; scalars [E, 2] (w13) or [E] (w2, a trailing [1] allowed) */
    int64_t shape[3] = {E, pndim ? (w13 ? 2 : 1) * pshape[0] : 2, pshape[1]};
    const int ndim = pndim ? 3 : (w13 ? 2 : 1), unit = !pndim && !w13;
    const int scale_check =
        field == MEGAMOE_FIELD_WEIGHT_SCALE_2 || (field == MEGAMOE_FIELD_INPUT_SCALE && !w13);
    st = check_tensor(l, name, full, dt, ndim, shape, unit);
    if (st) return st;

    const int E_r = l->experts_per_rank;
    const int64_t per_expert = megamoe_tensor_numel(full) / E;
    const size_t esize = megamoe_dtype_size(dt);
    /* Validate every local slice before anything is copied, so a bad tensor changes nothing. */
    for (int r = 0; r < l->group->local_ranks; r++) {
        const int e0 = megamoe_group_rank(l->group, r) * E_r;
        for (int e = e0; e < e0 + E_r; e++) {
            const uint8_t *src = (const uint8_t *)full->data + (size_t)e * (size_t)per_expert * esize;
            if (field == MEGAMOE_FIELD_WEIGHT_SCALE) {
                st = check_block_scales(l, name, src, (size_t)per_expert, e);
                if (st) return st;
            } else if (field == MEGAMOE_FIELD_WEIGHT && !nvfp4) {
                st = check_bf16_finite(l, name, src, (size_t)per_expert, e);
                if (st) return st;
            } else if (scale_check) {
                for (int64_t i = 0; i < per_expert; i++) {
                    st = check_global_scale(l, name, load_f32(src, (size_t)i), e);
                    if (st) return st;
                }
            }
        }
    }
    for (int r = 0; r < l->group->local_ranks; r++) {
        mm_rank_weights *w = &l->ranks[r];
        const int e0 = megamoe_group_rank(l->group, r) * E_r;
        const uint8_t *src = (const uint8_t *)full->data + (size_t)e0 * (size_t)per_expert * esize;
        void *dst = stacked_dst(w, w13, field, nvfp4);
        memcpy(dst, src, (size_t)E_r * (size_t)per_expert * esize);
        for (int e = 0; e < E_r; e++)
            w->loaded[e] |=
                w13 ? (uint16_t)(MM_PART(MEGAMOE_PROJ_GATE, field) | MM_PART(MEGAMOE_PROJ_UP, field))
                    : (uint16_t)MM_PART(MEGAMOE_PROJ_DOWN, field);
    }
    return MEGAMOE_OK;
}

/* ---- Per-expert loading ------------------------------------------------------------------------ */

megamoe_status megamoe_layer_load_expert_weight(megamoe_layer *l, int expert, megamoe_proj proj,
                                                megamoe_field field, const megamoe_tensor *t) {
    if (!l) return MEGAMOE_ERR_INVALID_ARGUMENT;
    megamoe_status st = check_not_finalized(l);
    if (st) return st;
    if ((int)proj < 0 || proj > MEGAMOE_PROJ_DOWN || (int)field < 0 || field > MEGAMOE_FIELD_INPUT_SCALE)
        return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "unknown projection %d or field %d", (int)proj,
                             (int)field);
    const int E = l->config.num_experts;
    char what[96];
    snprintf(what, sizeof what, "experts.%d.%s.%s", expert, mm_proj_names[0][proj], mm_field_names[0][field]);
    if (expert < 0 || expert >= E)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "%s: expert id %d is outside [0, %d)", what, expert,
                             E);
    const int nvfp4 = l->config.format == MEGAMOE_FORMAT_NVFP4;
    if (!nvfp4 && field != MEGAMOE_FIELD_WEIGHT)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "unexpected expert weight '%s': the layer is BF16",
                             what);
    megamoe_dtype dt = MEGAMOE_DTYPE_F32;
    int ndim;
    int64_t shape[2] = {0, 0};
    expert_tensor_shape(&l->config, proj, field, &dt, &ndim, shape);
    st = check_tensor(l, what, t, dt, ndim, shape, ndim == 0);
    if (st) return st;

    const int E_r = l->experts_per_rank, owner = expert / E_r;
    int local = -1;
    for (int r = 0; r < l->group->local_ranks; r++)
        if (megamoe_group_rank(l->group, r) == owner) local = r;
    if (field == MEGAMOE_FIELD_WEIGHT_SCALE) {
        st = check_block_scales(l, what, t->data, (size_t)megamoe_tensor_numel(t), expert);
        if (st) return st;
    } else if (field == MEGAMOE_FIELD_WEIGHT && !nvfp4) {
        st = check_bf16_finite(l, what, t->data, (size_t)megamoe_tensor_numel(t), expert);
        if (st) return st;
    } else if (field == MEGAMOE_FIELD_WEIGHT_SCALE_2 ||
               (field == MEGAMOE_FIELD_INPUT_SCALE && proj == MEGAMOE_PROJ_DOWN)) {
        st = check_global_scale(l, what, load_f32(t->data, 0), expert);
        if (st) return st;
    }
    if (local < 0) return MEGAMOE_OK; /* another rank's expert */

    mm_rank_weights *w = &l->ranks[local];
    const size_t e = (size_t)(expert - owner * E_r);
    const expert_sizes s = sizes_of(&l->config);
    const size_t nbytes = (size_t)megamoe_tensor_numel(t) * megamoe_dtype_size(dt);
    const size_t half = proj == MEGAMOE_PROJ_UP ? 1 : 0; /* up rows follow the I gate rows */
    switch (field) {
    case MEGAMOE_FIELD_WEIGHT:
        if (proj == MEGAMOE_PROJ_DOWN) {
            if (nvfp4)
                memcpy(w->w2 + e * s.w2, t->data, nbytes);
            else
                memcpy(w->w2_bf16 + e * s.w2, t->data, nbytes);
        } else {
            if (nvfp4)
                memcpy(w->w13 + e * s.w13 + half * s.w13 / 2, t->data, nbytes);
            else
                memcpy(w->w13_bf16 + e * s.w13 + half * s.w13 / 2, t->data, nbytes);
        }
        break;
    case MEGAMOE_FIELD_WEIGHT_SCALE:
        if (proj == MEGAMOE_PROJ_DOWN)
            memcpy(w->w2_sf + e * s.w2_sf, t->data, nbytes);
        else
            memcpy(w->w13_sf + e * s.w13_sf + half * s.w13_sf / 2, t->data, nbytes);
        break;
    case MEGAMOE_FIELD_WEIGHT_SCALE_2:
        if (proj == MEGAMOE_PROJ_DOWN)
            w->w2_alpha[e] = load_f32(t->data, 0);
        else
            w->w13_alpha[e * 2 + half] = load_f32(t->data, 0);
        break;
    case MEGAMOE_FIELD_INPUT_SCALE:
        if (proj == MEGAMOE_PROJ_DOWN)
            w->w2_input_scale[e] = load_f32(t->data, 0);
        else
            w->w13_input_scale[e * 2 + half] = load_f32(t->data, 0);
        break;
    }
    w->loaded[e] |= (uint16_t)MM_PART(proj, field);
    return MEGAMOE_OK;
}

megamoe_status megamoe_layer_load_norm_weight(megamoe_layer *l, const megamoe_tensor *t) {
    if (!l) return MEGAMOE_ERR_INVALID_ARGUMENT;
    megamoe_status st = check_not_finalized(l);
    if (st) return st;
    const int64_t H = l->config.hidden_size;
    const megamoe_dtype dt = t && t->dtype == MEGAMOE_DTYPE_BF16 ? MEGAMOE_DTYPE_BF16 : MEGAMOE_DTYPE_F32;
    st = check_tensor(l, "post_expert_norm.weight", t, dt, 1, &H, 0);
    if (st) return st;
    float *w = malloc((size_t)H * sizeof *w);
    if (!w) return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory");
    for (int64_t h = 0; h < H; h++) {
        if (dt == MEGAMOE_DTYPE_BF16) {
            uint16_t b;
            memcpy(&b, (const uint8_t *)t->data + h * 2, 2);
            w[h] = mm_bf16_to_f32(b);
        } else {
            w[h] = load_f32(t->data, (size_t)h);
        }
        if (!isfinite(w[h])) {
            free(w);
            return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "post_expert_norm.weight[%lld] is not finite",
                                 (long long)h);
        }
    }
    free(l->norm_weight);
    l->norm_weight = w;
    return MEGAMOE_OK;
}

/* ---- Finalize ----------------------------------------------------------------------------------- */

/* The parts finalize needs: every weight, and for NVFP4 its block and global scales; the down
 * projection's input scale a2 only where the layer quantizes its activations (SPEC §3). With bf16
 * activations (§3b) no input scale is read, so a weight-only export, which has none, finalizes (§6);
 * one that was never loaded stays 0 in the host arrays. Gate/up input scales are never required. */
static uint16_t required_parts(const megamoe_layer *l) {
    uint16_t p = MM_PART(0, 0) | MM_PART(1, 0) | MM_PART(2, 0);
    if (l->config.format == MEGAMOE_FORMAT_NVFP4)
        p |= MM_PART(0, 1) | MM_PART(1, 1) | MM_PART(2, 1) | MM_PART(0, 2) | MM_PART(1, 2) | MM_PART(2, 2);
    if (mm_layer_quantizes_activations(l)) p |= MM_PART(MEGAMOE_PROJ_DOWN, MEGAMOE_FIELD_INPUT_SCALE);
    return p;
}

megamoe_status megamoe_layer_finalize(megamoe_layer *l) {
    if (!l) return MEGAMOE_ERR_INVALID_ARGUMENT;
    if (l->finalized) return MEGAMOE_OK;
    const uint16_t need = required_parts(l);
    int missing_experts = 0, first_expert = -1;
    uint16_t first_missing = 0;
    for (int r = 0; r < l->group->local_ranks; r++) {
        for (int e = 0; e < l->experts_per_rank; e++) {
            uint16_t miss = need & (uint16_t)~l->ranks[r].loaded[e];
            if (miss) {
                if (!missing_experts) {
                    first_expert = megamoe_group_rank(l->group, r) * l->experts_per_rank + e;
                    first_missing = miss;
                }
                missing_experts++;
            }
        }
    }
    if (missing_experts) {
        int bit = __builtin_ctz(first_missing);
        const int input_scale_only = first_missing == MM_PART(MEGAMOE_PROJ_DOWN, MEGAMOE_FIELD_INPUT_SCALE);
        return mm_layer_fail(l, MEGAMOE_ERR_NOT_FINALIZED,
                             "cannot finalize: expert %d has no %s.%s%s (%d local expert%s incomplete)%s",
                             first_expert, mm_proj_names[0][bit / 4], mm_field_names[0][bit % 4],
                             __builtin_popcount(first_missing) > 1 ? " and more" : "", missing_experts,
                             missing_experts == 1 ? "" : "s", input_scale_only ? mm_weight_only_hint : "");
    }
    if (l->norm_weight) {
        const int H = l->config.hidden_size;
        float *g = malloc((size_t)H * sizeof *g);
        if (!g) return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory");
        for (int h = 0; h < H; h++)
            g[h] = l->config.norm_zero_centered ? mm_add(l->norm_weight[h], l->config.norm_gain_center)
                                                : l->norm_weight[h];
        l->norm_gamma = g;
    }
    megamoe_status st = l->group->ops->layer_finalize(l);
    if (st != MEGAMOE_OK) {
        free(l->norm_gamma);
        l->norm_gamma = NULL;
        return st;
    }
    /* A backend that keeps no weights of its own (the CPU) reads the checkpoint layout as its kernel
     * layout: nothing to repack or free, so the peak is the resident size. */
    if (!l->device) l->finalize_peak_bytes = local_weight_bytes(l);
    l->finalized = 1;
    return MEGAMOE_OK;
}

/* ---- Forward ----------------------------------------------------------------------------------- */

/* Routing weights of the slots that count (an expert id other than -1, on a token that is not padding)
 * must be finite: a NaN or infinite weight is bad input (SPEC §5), not a NaN row. The CPU backend
 * checks them here; device backends hold them in device memory and their callers check them (the
 * CLI does, on the host, before a device forward). */
static megamoe_status check_topk_weights(megamoe_layer *l, int rank, const megamoe_forward_args *a) {
    const int K = l->config.top_k;
    for (int t = 0; t < a->num_tokens; t++) {
        if (a->is_padding && a->is_padding[t]) continue;
        for (int k = 0; k < K; k++) {
            const size_t i = (size_t)t * (size_t)K + (size_t)k;
            if (a->topk_ids[i] != -1 && !isfinite(a->topk_weights[i]))
                return mm_layer_fail(l, MEGAMOE_ERR_BAD_INPUT,
                                     "rank %d token %d slot %d: topk_weights is %g; routing weights must be "
                                     "finite",
                                     rank, t, k, (double)a->topk_weights[i]);
        }
    }
    return MEGAMOE_OK;
}

megamoe_status megamoe_layer_forward(megamoe_layer *l, const megamoe_forward_args *args, void *stream) {
    if (!l) return MEGAMOE_ERR_INVALID_ARGUMENT;
    if (!l->finalized)
        return mm_layer_fail(l, MEGAMOE_ERR_NOT_FINALIZED, "forward before megamoe_layer_finalize()");
    if (!args) return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "args is NULL");
    for (int r = 0; r < l->group->local_ranks; r++) {
        const megamoe_forward_args *a = &args[r];
        const int rank = megamoe_group_rank(l->group, r);
        if (a->num_tokens < 0)
            return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "rank %d: num_tokens=%d is negative", rank,
                                 a->num_tokens);
        if (a->num_tokens > l->config.max_tokens)
            return mm_layer_fail(l, MEGAMOE_ERR_BAD_INPUT,
                                 "rank %d got %d tokens, but the buffer was sized for max_tokens=%d", rank,
                                 a->num_tokens, l->config.max_tokens);
        if (a->num_tokens > 0 && (!a->x || !a->topk_ids || !a->topk_weights || !a->y))
            return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT,
                                 "rank %d: x, topk_ids, topk_weights and y must not be NULL", rank);
        /* The device kernels read x and write y 16 bytes at a time (rows are 512-byte multiples). */
        if (l->group->ops->device_memory && a->num_tokens > 0 &&
            (((uintptr_t)a->x | (uintptr_t)a->y) & 15u) != 0)
            return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT,
                                 "rank %d: x and y must be 16-byte aligned device pointers", rank);
        if (!l->group->ops->device_memory && a->num_tokens > 0) {
            const megamoe_status st = check_topk_weights(l, rank, a);
            if (st) return st;
        }
    }
    return l->group->ops->forward(l, args, stream);
}

megamoe_status megamoe_layer_check(megamoe_layer *l) {
    if (!l) return MEGAMOE_ERR_INVALID_ARGUMENT;
    return l->finalized ? l->group->ops->layer_check(l) : MEGAMOE_OK;
}

megamoe_status megamoe_layer_memory(const megamoe_layer *l, megamoe_memory_info *info) {
    if (!l || !info) return MEGAMOE_ERR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    const uint64_t all = local_weight_bytes(l);
    if (!l->finalized)
        info->checkpoint_bytes = all;
    else if (l->device)
        info->weight_bytes = l->group->ops->layer_resident_bytes(l);
    else
        info->weight_bytes = all;
    info->finalize_peak_bytes = l->finalize_peak_bytes;
    info->buffer_bytes = l->buffer ? l->buffer->layout.total : 0;
    return MEGAMOE_OK;
}
