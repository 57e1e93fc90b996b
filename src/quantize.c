/*
 * quantize.c -- BF16 expert weights to NVFP4, the ModelOpt way (SPEC §2-3), and the checkpoint
 * converter behind `megamoe quantize IN OUT`.
 *
 * Weights: alpha = amax / (6 * 448) per tensor (gate and up are separate tensors, so each keeps its
 * own), E4M3 block scales per 16, E2M1 codes, all through the one block quantizer of formats.h.
 * Static input scales need activation statistics that a weight file does not hold; they are
 * estimated from seeded N(0, 1) tokens run through the BF16 expert (documented in docs/).
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint/checkpoint.h"
#include "formats.h"

megamoe_status megamoe_quantize_nvfp4(const uint16_t *w, int64_t rows, int64_t cols, uint8_t *codes,
                                      uint8_t *scales, float *global_scale) {
    if (!w || !codes || !scales || !global_scale || rows < 0 || cols <= 0 || cols % 16)
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    float amax = 0.0f;
    for (int64_t i = 0; i < rows * cols; i++) {
        const float v = mm_bf16_to_f32(w[i]);
        if (!mm_isfinite(v)) return MEGAMOE_ERR_BAD_WEIGHT;
        amax = mm_max_nan(amax, mm_fabs(v));
    }
    const float alpha = mm_activation_scale(amax); /* amax / 2688, 1 for an all-zero tensor */
    *global_scale = alpha;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float block[16];
        for (int64_t b = 0; b < cols / 16; b++) {
            for (int i = 0; i < 16; i++)
                block[i] = mm_bf16_to_f32(w[r * cols + b * 16 + i]);
            scales[r * (cols / 16) + b] = mm_quantize_block16(block, alpha, codes + r * (cols / 2) + b * 8);
        }
    }
    return MEGAMOE_OK;
}

void megamoe_quantize_options_init(megamoe_quantize_options *o) {
    memset(o, 0, sizeof *o);
    o->calib_tokens = 64;
    o->calib_seed = 0x5EED;
}

/* ---- Calibration ----------------------------------------------------------------------------- */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_normal(rng *r) { /* Box-Muller */
    const double u1 = ((double)(rng_next(r) >> 11) + 1.0) / 9007199254740993.0;
    const double u2 = (double)(rng_next(r) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

megamoe_status megamoe_calibrate_expert_bf16(const uint16_t *w13, int H, int I, int tokens, uint64_t seed,
                                             float clamp, float *x_amax, float *a_amax) {
    if (!w13 || H <= 0 || I <= 0 || tokens <= 0 || !x_amax || !a_amax) return MEGAMOE_ERR_INVALID_ARGUMENT;
    float *x = malloc((size_t)tokens * (size_t)H * sizeof *x);       /* [tokens, H] bf16 values */
    float *gu = malloc((size_t)tokens * 2 * (size_t)I * sizeof *gu); /* [tokens, 2I] */
    if (!x || !gu) {
        free(x);
        free(gu);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    rng r = {seed};
    float xa = 0.0f;
    for (size_t i = 0; i < (size_t)tokens * (size_t)H; i++) {
        x[i] = mm_bf16_to_f32(mm_f32_to_bf16((float)rng_normal(&r)));
        xa = fmaxf(xa, fabsf(x[i]));
    }
#pragma omp parallel for schedule(static)
    for (int j = 0; j < 2 * I; j++) {
        for (int t = 0; t < tokens; t++) {
            float acc = 0.0f;
            for (int h = 0; h < H; h++)
                acc += x[(size_t)t * H + h] * mm_bf16_to_f32(w13[(size_t)j * H + h]);
            gu[(size_t)t * 2 * I + j] = acc;
        }
    }
    float aa = 0.0f;
    for (int t = 0; t < tokens; t++) {
        for (int n = 0; n < I; n++) {
            float g = gu[(size_t)t * 2 * I + n], u = gu[(size_t)t * 2 * I + I + n];
            if (clamp > 0.0f) {
                g = fminf(g, clamp);
                u = fminf(fmaxf(u, -clamp), clamp);
            }
            aa = fmaxf(aa, fabsf(g / (1.0f + expf(-g)) * u));
        }
    }
    free(x);
    free(gu);
    *x_amax = xa;
    *a_amax = aa;
    return MEGAMOE_OK;
}

/* ---- Checkpoint conversion ------------------------------------------------------------------ */

typedef struct out_list {
    megamoe_named_tensor *t;
    void **owned; /* buffers to free after the shard is written */
    int n, cap, nowned, owned_cap;
} out_list;

static int out_push(out_list *o, const char *name, megamoe_tensor t, void *owned_data) {
    if (o->n == o->cap) {
        o->cap = o->cap ? o->cap * 2 : 256;
        void *nt = realloc(o->t, (size_t)o->cap * sizeof *o->t);
        if (!nt) return 0;
        o->t = nt;
    }
    if (o->nowned + 2 > o->owned_cap) {
        o->owned_cap = o->owned_cap ? o->owned_cap * 2 : 512;
        void *no = realloc(o->owned, (size_t)o->owned_cap * sizeof *o->owned);
        if (!no) return 0;
        o->owned = no;
    }
    char *nm = strdup(name);
    if (!nm) return 0;
    o->owned[o->nowned++] = nm;
    if (owned_data) o->owned[o->nowned++] = owned_data;
    o->t[o->n].name = nm;
    o->t[o->n].tensor = t;
    o->n++;
    return 1;
}

static void out_clear(out_list *o) {
    for (int i = 0; i < o->nowned; i++)
        free(o->owned[i]);
    o->n = 0;
    o->nowned = 0;
}

static void out_free(out_list *o) {
    out_clear(o);
    free(o->t);
    free(o->owned);
}

static megamoe_tensor tensor2d(megamoe_dtype dt, int64_t a, int64_t b, const void *data) {
    megamoe_tensor t = {dt, 2, {a, b}, data};
    return t;
}

static megamoe_tensor scalar_f32(const float *v) {
    megamoe_tensor t = {MEGAMOE_DTYPE_F32, 0, {0}, v};
    return t;
}

/* Quantizes one projection [rows, cols] and pushes its four tensors under `base` (e.g.
 * "model.layers.0.mlp.experts.3.gate_proj"). */
static megamoe_status push_projection(out_list *o, const char *base, const uint16_t *w, int64_t rows,
                                      int64_t cols, float input_scale, char *msg) {
    uint8_t *codes = malloc((size_t)(rows * cols / 2));
    uint8_t *sf = malloc((size_t)(rows * cols / 16));
    float *alpha = malloc(sizeof *alpha), *in = malloc(sizeof *in);
    if (!codes || !sf || !alpha || !in) {
        free(codes), free(sf), free(alpha), free(in);
        mm_set_error(msg, "%s: out of memory", base);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    megamoe_status st = megamoe_quantize_nvfp4(w, rows, cols, codes, sf, alpha);
    if (st) {
        free(codes), free(sf), free(alpha), free(in);
        mm_set_error(msg, "%s.weight holds a NaN or an infinity", base);
        return st;
    }
    *in = input_scale;
    char name[600];
    int ok = 1;
    snprintf(name, sizeof name, "%s.weight", base);
    ok = ok && out_push(o, name, tensor2d(MEGAMOE_DTYPE_U8, rows, cols / 2, codes), codes);
    snprintf(name, sizeof name, "%s.weight_scale", base);
    ok = ok && out_push(o, name, tensor2d(MEGAMOE_DTYPE_F8_E4M3, rows, cols / 16, sf), sf);
    snprintf(name, sizeof name, "%s.weight_scale_2", base);
    ok = ok && out_push(o, name, scalar_f32(alpha), alpha);
    snprintf(name, sizeof name, "%s.input_scale", base);
    ok = ok && out_push(o, name, scalar_f32(in), in);
    if (!ok) {
        mm_set_error(msg, "%s: out of memory", base);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    return MEGAMOE_OK;
}

/* A BF16 layer found in the input and its calibrated input scales. */
typedef struct qlayer {
    megamoe_layer_info info;
    int pstyle;               /* per expert: 0 gate_proj/up_proj/down_proj, 1 w1/w3/w2 */
    float *x_scale, *a_scale; /* [E] */
} qlayer;

static const char *const k_pnames[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};

static void name_join(char *out, size_t n, const char *prefix, const char *rest) {
    snprintf(out, n, "%s%s%s", prefix, prefix[0] ? "." : "", rest);
}

/* Gate and up rows of expert e as one [2I, H] bf16 matrix, copied into scratch (aligned, whichever naming). */
static const uint16_t *expert_w13(megamoe_checkpoint *ck, const qlayer *q, int e, uint16_t *scratch) {
    const int64_t H = q->info.hidden_size, I = q->info.intermediate_size;
    char name[600], rest[96];
    megamoe_tensor t;
    if (q->info.naming == MEGAMOE_NAMING_STACKED) {
        name_join(name, sizeof name, q->info.prefix, "w13_weight");
        if (megamoe_checkpoint_find(ck, name, &t)) return NULL;
        memcpy(scratch, (const uint16_t *)t.data + (size_t)e * 2 * I * H, (size_t)(2 * I * H) * 2);
        return scratch;
    }
    for (int half = 0; half < 2; half++) {
        snprintf(rest, sizeof rest, "experts.%d.%s.weight", e, k_pnames[q->pstyle][half]);
        name_join(name, sizeof name, q->info.prefix, rest);
        if (megamoe_checkpoint_find(ck, name, &t) || t.dtype != MEGAMOE_DTYPE_BF16 || t.ndim != 2 ||
            t.shape[0] != I || t.shape[1] != H)
            return NULL;
        memcpy(scratch + (size_t)half * I * H, t.data, (size_t)(I * H) * 2);
    }
    return scratch;
}

static megamoe_status calibrate_layer(megamoe_checkpoint *ck, qlayer *q, const megamoe_quantize_options *o,
                                      char *msg) {
    const int E = q->info.num_experts, H = q->info.hidden_size, I = q->info.intermediate_size;
    char name[600];
    name_join(name, sizeof name, q->info.prefix, "experts.0.w1.weight");
    q->pstyle = megamoe_checkpoint_find(ck, name, NULL) == MEGAMOE_OK;
    q->x_scale = calloc((size_t)E, sizeof(float));
    q->a_scale = calloc((size_t)E, sizeof(float));
    uint16_t *scratch = malloc((size_t)2 * I * H * 2);
    if (!q->x_scale || !q->a_scale || !scratch) {
        free(scratch);
        mm_set_error(msg, "out of memory calibrating '%s'", q->info.prefix);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    for (int e = 0; e < E; e++) {
        if (o->progress) o->progress(o->progress_user, "calibrating experts", (uint64_t)e + 1, (uint64_t)E);
        const uint16_t *w13 = expert_w13(ck, q, e, scratch);
        if (!w13) {
            free(scratch);
            mm_set_error(msg, "layer '%s': expert %d's gate/up weights are missing or not [I=%d, H=%d] BF16",
                         q->info.prefix, e, I, H);
            return MEGAMOE_ERR_BAD_WEIGHT;
        }
        float xa, aa;
        megamoe_status st = megamoe_calibrate_expert_bf16(
            w13, H, I, o->calib_tokens, o->calib_seed + (uint64_t)e, o->activation_clamp, &xa, &aa);
        if (st) {
            free(scratch);
            mm_set_error(msg, "layer '%s': calibration of expert %d failed", q->info.prefix, e);
            return st;
        }
        q->x_scale[e] = mm_activation_scale(xa);
        q->a_scale[e] = mm_activation_scale(aa);
    }
    free(scratch);
    return MEGAMOE_OK;
}

/* Emits the outputs of input tensor i (quantized, or passed through) into o. */
static megamoe_status convert_tensor(megamoe_checkpoint *ck, int i, const qlayer *layers, int nlayers,
                                     out_list *o, const megamoe_quantize_options *opt, char *msg) {
    const char *nm = ck->tensors[i].name;
    megamoe_tensor t;
    mm_ck_view(ck, i, &t);
    for (int li = 0; li < nlayers; li++) {
        const qlayer *q = &layers[li];
        const char *prefix = q->info.prefix;
        const int64_t H = q->info.hidden_size, I = q->info.intermediate_size, E = q->info.num_experts;
        char name[600], base[600], rest[96];
        if (q->info.naming == MEGAMOE_NAMING_STACKED) {
            for (int which = 0; which < 2; which++) {
                name_join(name, sizeof name, prefix, which ? "w2_weight" : "w13_weight");
                if (strcmp(nm, name) != 0) continue;
                for (int64_t e = 0; e < E; e++) {
                    if (opt->progress)
                        opt->progress(opt->progress_user, "quantizing experts", (uint64_t)e + 1, (uint64_t)E);
                    for (int half = 0; half < (which ? 1 : 2); half++) {
                        const int proj = which ? 2 : half;
                        snprintf(rest, sizeof rest, "experts.%lld.%s", (long long)e, k_pnames[0][proj]);
                        name_join(base, sizeof base, prefix, rest);
                        const uint16_t *w =
                            (const uint16_t *)t.data +
                            (which ? (size_t)(e * H * I) : (size_t)(e * 2 * I * H + half * I * H));
                        megamoe_status st = push_projection(o, base, w, which ? H : I, which ? I : H,
                                                            which ? q->a_scale[e] : q->x_scale[e], msg);
                        if (st) return st;
                    }
                }
                return MEGAMOE_OK;
            }
            continue;
        }
        /* per expert */
        char ex[600];
        name_join(ex, sizeof ex, prefix, "experts.");
        if (strncmp(nm, ex, strlen(ex)) != 0) continue;
        for (int proj = 0; proj < 3; proj++) {
            int e;
            char tail[64];
            if (sscanf(nm + strlen(ex), "%d.%63s", &e, tail) != 2) continue;
            char want[96];
            snprintf(want, sizeof want, "%s.weight", k_pnames[q->pstyle][proj]);
            if (strcmp(tail, want) != 0 || e < 0 || e >= E) continue;
            const int64_t rows = proj == 2 ? H : I, cols = proj == 2 ? I : H;
            if (t.dtype != MEGAMOE_DTYPE_BF16 || t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols) {
                mm_set_error(msg, "tensor '%s' is not [%lld, %lld] BF16", nm, (long long)rows,
                             (long long)cols);
                return MEGAMOE_ERR_BAD_WEIGHT;
            }
            if (opt->progress && proj == 2)
                opt->progress(opt->progress_user, "quantizing experts", (uint64_t)e + 1, (uint64_t)E);
            snprintf(base, sizeof base, "%.*s", (int)(strlen(nm) - strlen(".weight")), nm);
            return push_projection(o, base, t.data, rows, cols, proj == 2 ? q->a_scale[e] : q->x_scale[e],
                                   msg);
        }
    }
    if (!out_push(o, nm, t, NULL)) {
        mm_set_error(msg, "out of memory");
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    return MEGAMOE_OK;
}

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

megamoe_status megamoe_quantize_checkpoint(const char *in_path, const char *out_path,
                                           const megamoe_quantize_options *options, char *err,
                                           size_t err_size) {
    char msg[MM_ERR_LEN] = "";
    megamoe_quantize_options defaults;
    megamoe_quantize_options_init(&defaults);
    const megamoe_quantize_options *opt = options ? options : &defaults;
    megamoe_checkpoint *ck = NULL;
    qlayer *layers = NULL;
    int nlayers = 0;
    out_list o = {0};
    json_t *wmap = NULL;
    megamoe_status st;
    if (!in_path || !out_path || opt->calib_tokens < 1) {
        mm_set_error(msg, "quantize: input and output paths are needed, and calib_tokens >= 1");
        st = MEGAMOE_ERR_INVALID_ARGUMENT;
        goto done;
    }
    st = megamoe_checkpoint_open(in_path, &ck);
    if (st) {
        mm_set_error(msg, "%s", megamoe_checkpoint_last_error(ck));
        goto done;
    }
    int found = 0;
    st = megamoe_checkpoint_find_layers(ck, NULL, 0, &found);
    if (st == MEGAMOE_OK && found > 0) {
        megamoe_layer_info *infos = calloc((size_t)found, sizeof *infos);
        layers = calloc((size_t)found, sizeof *layers);
        if (!infos || !layers) {
            free(infos);
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
            mm_set_error(msg, "out of memory");
            goto done;
        }
        st = megamoe_checkpoint_find_layers(ck, infos, found, &found);
        for (int i = 0; st == MEGAMOE_OK && i < found; i++) {
            if (infos[i].format != MEGAMOE_FORMAT_BF16) continue;
            if (infos[i].naming == MEGAMOE_NAMING_COMPRESSED_TENSORS) continue;
            layers[nlayers].info = infos[i];
            st = calibrate_layer(ck, &layers[nlayers++], opt, msg);
        }
        free(infos);
        if (st) {
            if (!msg[0]) mm_set_error(msg, "%s", megamoe_checkpoint_last_error(ck));
            goto done;
        }
    } else if (st) {
        mm_set_error(msg, "%s", megamoe_checkpoint_last_error(ck));
        goto done;
    }
    if (nlayers == 0) {
        mm_set_error(msg, "%s: no BF16 MoE expert weights to quantize", in_path);
        st = MEGAMOE_ERR_BAD_WEIGHT;
        goto done;
    }
    struct stat sb;
    const int folder = stat(in_path, &sb) == 0 && S_ISDIR(sb.st_mode);
    if (folder && mkdir(out_path, 0777) != 0 && errno != EEXIST) {
        mm_set_error(msg, "%s: cannot create folder: %s", out_path, strerror(errno));
        st = MEGAMOE_ERR_IO;
        goto done;
    }
    wmap = json_object();
    uint64_t total = 0;
    for (int f = 0; f < ck->num_files && st == MEGAMOE_OK; f++) {
        out_clear(&o);
        for (int i = 0; i < ck->num_tensors && st == MEGAMOE_OK; i++)
            if (ck->tensors[i].file == f) st = convert_tensor(ck, i, layers, nlayers, &o, opt, msg);
        if (st) break;
        char path[4096];
        if (folder)
            snprintf(path, sizeof path, "%s/%s", out_path, base_name(ck->files[f].path));
        else
            snprintf(path, sizeof path, "%s", out_path);
        st = megamoe_safetensors_write(path, o.t, o.n, msg, sizeof msg);
        for (int i = 0; i < o.n; i++) {
            json_object_set_new(wmap, o.t[i].name, json_string(base_name(path)));
            total += (uint64_t)megamoe_tensor_numel(&o.t[i].tensor) * megamoe_dtype_size(o.t[i].tensor.dtype);
        }
    }
    if (st == MEGAMOE_OK && folder) {
        char path[4096];
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", out_path);
        json_t *root =
            json_pack("{s:{s:I}, s:O}", "metadata", "total_size", (json_int_t)total, "weight_map", wmap);
        if (!root || json_dump_file(root, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0) {
            mm_set_error(msg, "%s: cannot write the index", path);
            st = MEGAMOE_ERR_IO;
        }
        json_decref(root);
    }
done:
    json_decref(wmap);
    out_free(&o);
    for (int i = 0; i < nlayers; i++) {
        free(layers[i].x_scale);
        free(layers[i].a_scale);
    }
    free(layers);
    megamoe_checkpoint_close(ck);
    if (st != MEGAMOE_OK && err && err_size) snprintf(err, err_size, "%s", msg);
    return st;
}
