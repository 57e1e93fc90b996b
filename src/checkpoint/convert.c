/*
 * convert.c -- the checkpoint converter behind `megamoe quantize IN OUT`: every BF16 MoE layer of IN
 * becomes NVFP4 in the per-expert naming (SPEC §6), every other tensor is copied unchanged. The
 * numerics (the block quantizer, the calibration) are quantize.c's.
 *
 * Order, so a bad input fails before anything is read or written: the options, then OUT against IN
 * (never the same file), then every expert tensor's shape and dtype against the layer rules (SPEC §1),
 * then every weight finite, then calibration, then conversion into a temporary file or folder beside
 * OUT that is renamed to OUT only when complete.
 */

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../formats.h"
#include "checkpoint.h"

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
 * "model.layers.0.mlp.experts.3.gate_proj"). The weights were checked finite before. */
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
        mm_set_error(msg, "%s: the quantizer refused [%lld, %lld]: %s", base, (long long)rows,
                     (long long)cols, megamoe_status_string(st));
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

/* Where projection proj (0 gate, 1 up, 2 down) of expert e is: the tensor, and the projection's first
 * row in that expert's slice (the stacked w13 holds gate rows then up rows). */
typedef struct proj_src {
    char name[600];
    megamoe_tensor t;
    int64_t row0;
    const uint16_t *w; /* [rows, cols] */
} proj_src;

static void proj_name(const qlayer *q, int e, int proj, char *out, size_t n) {
    char rest[96];
    if (q->info.naming == MEGAMOE_NAMING_STACKED)
        snprintf(rest, sizeof rest, "%s", proj == 2 ? "w2_weight" : "w13_weight");
    else
        snprintf(rest, sizeof rest, "experts.%d.%s.weight", e, mm_proj_names[q->pstyle][proj]);
    mm_join_name(out, n, q->info.prefix, rest);
}

/* Fills s for a layer whose shapes were checked (check_layer_shapes). */
static void proj_source(megamoe_checkpoint *ck, const qlayer *q, int e, int proj, proj_src *s) {
    const int64_t H = q->info.hidden_size, I = q->info.intermediate_size;
    proj_name(q, e, proj, s->name, sizeof s->name);
    megamoe_checkpoint_find(ck, s->name, &s->t);
    s->row0 = 0;
    s->w = s->t.data;
    if (q->info.naming == MEGAMOE_NAMING_STACKED) {
        s->row0 = proj == 1 ? I : 0;
        s->w += proj == 2 ? (size_t)e * (size_t)(H * I)                              /* w2 [E, H, I]   */
                          : (size_t)e * (size_t)(2 * I * H) + (size_t)(s->row0 * H); /* w13 [E, 2I, H] */
    }
}

static megamoe_status shape_mismatch(char *msg, const char *name, const megamoe_tensor *t, int ndim,
                                     const int64_t *want) {
    int ok = t->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++)
        ok = t->shape[d] == want[d];
    if (ok && t->dtype == MEGAMOE_DTYPE_BF16) return MEGAMOE_OK;
    char got[160] = "[", exp[160] = "[";
    for (int d = 0; d < t->ndim; d++)
        snprintf(got + strlen(got), sizeof got - strlen(got), d ? ", %lld" : "%lld", (long long)t->shape[d]);
    for (int d = 0; d < ndim; d++)
        snprintf(exp + strlen(exp), sizeof exp - strlen(exp), d ? ", %lld" : "%lld", (long long)want[d]);
    if (!ok)
        mm_set_error(msg,
                     "tensor '%s': shape %s], expected %s] BF16 (E, H and I of the layer's gate weights)",
                     name, got, exp);
    else
        mm_set_error(msg, "tensor '%s': dtype %s, expected BF16", name, megamoe_dtype_name(t->dtype));
    return MEGAMOE_ERR_BAD_WEIGHT;
}

/* Every expert tensor of a BF16 layer against the shapes its E, H and I give (which describe already
 * checked against the layer rules); nothing is read but the headers. */
static megamoe_status check_layer_shapes(megamoe_checkpoint *ck, qlayer *q, char *msg) {
    const int64_t E = q->info.num_experts, H = q->info.hidden_size, I = q->info.intermediate_size;
    char name[600];
    megamoe_tensor t;
    if (q->info.naming == MEGAMOE_NAMING_STACKED) {
        for (int which = 0; which < 2; which++) {
            const int64_t want[3] = {E, which ? H : 2 * I, which ? I : H};
            mm_join_name(name, sizeof name, q->info.prefix, which ? "w2_weight" : "w13_weight");
            if (megamoe_checkpoint_find(ck, name, &t) != MEGAMOE_OK) {
                mm_set_error(msg, "tensor '%s' is missing", name);
                return MEGAMOE_ERR_BAD_WEIGHT;
            }
            megamoe_status st = shape_mismatch(msg, name, &t, 3, want);
            if (st) return st;
        }
        return MEGAMOE_OK;
    }
    mm_join_name(name, sizeof name, q->info.prefix, "experts.0.w1.weight");
    q->pstyle = megamoe_checkpoint_find(ck, name, NULL) == MEGAMOE_OK;
    for (int e = 0; e < E; e++) {
        for (int proj = 0; proj < 3; proj++) {
            const int64_t want[2] = {proj == 2 ? H : I, proj == 2 ? I : H};
            proj_name(q, e, proj, name, sizeof name);
            if (megamoe_checkpoint_find(ck, name, &t) != MEGAMOE_OK) {
                mm_set_error(msg, "tensor '%s' is missing (layer '%s' has E=%lld experts)", name,
                             q->info.prefix, (long long)E);
                return MEGAMOE_ERR_BAD_WEIGHT;
            }
            megamoe_status st = shape_mismatch(msg, name, &t, 2, want);
            if (st) return st;
        }
    }
    return MEGAMOE_OK;
}

/* Every weight finite, named by tensor, expert and element when not (before calibration reads them). */
static megamoe_status check_layer_finite(megamoe_checkpoint *ck, const qlayer *q, char *msg) {
    const int64_t H = q->info.hidden_size, I = q->info.intermediate_size;
    for (int e = 0; e < q->info.num_experts; e++) {
        for (int proj = 0; proj < 3; proj++) {
            proj_src s;
            proj_source(ck, q, e, proj, &s);
            const int64_t rows = proj == 2 ? H : I, cols = proj == 2 ? I : H;
            for (int64_t i = 0; i < rows * cols; i++) {
                uint16_t b;
                memcpy(&b, s.w + i, 2); /* mapped data need not be aligned */
                if ((b & 0x7F80u) != 0x7F80u) continue;
                const long long r = (long long)(s.row0 + i / cols), c = (long long)(i % cols);
                char at[64];
                if (q->info.naming == MEGAMOE_NAMING_STACKED)
                    snprintf(at, sizeof at, "[%d, %lld, %lld]", e, r, c);
                else
                    snprintf(at, sizeof at, "[%lld, %lld]", r, c);
                mm_set_error(msg,
                             "tensor '%s' of expert %d: element %s is %s; BF16 weights must be finite to "
                             "quantize",
                             s.name, e, at, (b & 0x7Fu) ? "NaN" : "an infinity");
                return MEGAMOE_ERR_BAD_WEIGHT;
            }
        }
    }
    return MEGAMOE_OK;
}

static megamoe_status calibrate_layer(megamoe_checkpoint *ck, qlayer *q, const megamoe_quantize_options *o,
                                      char *msg) {
    const int E = q->info.num_experts, H = q->info.hidden_size, I = q->info.intermediate_size;
    q->x_scale = calloc((size_t)E, sizeof(float));
    q->a_scale = calloc((size_t)E, sizeof(float));
    uint16_t *scratch = malloc((size_t)2 * I * H * 2);
    if (!q->x_scale || !q->a_scale || !scratch) {
        free(scratch);
        mm_set_error(msg, "out of memory calibrating '%s'", q->info.prefix);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    megamoe_status st = MEGAMOE_OK;
    for (int e = 0; e < E && st == MEGAMOE_OK; e++) {
        if (o->progress) o->progress(o->progress_user, "calibrating experts", (uint64_t)e + 1, (uint64_t)E);
        for (int half = 0; half < 2; half++) { /* gate and up rows as one aligned [2I, H] matrix */
            proj_src s;
            proj_source(ck, q, e, half, &s);
            memcpy(scratch + (size_t)half * I * H, s.w, (size_t)I * H * 2);
        }
        float xa, aa;
        st = megamoe_calibrate_expert_bf16(scratch, H, I, o->calib_tokens, o->calib_seed + (uint64_t)e,
                                           o->activation_clamp, &xa, &aa);
        if (st) {
            mm_set_error(msg, "layer '%s': calibration of expert %d failed: %s", q->info.prefix, e,
                         megamoe_status_string(st));
            break;
        }
        /* amax / 2688 of a finite amax is a scale run accepts (<= FLT_MAX / 2688). */
        if (!isfinite(xa) || !isfinite(aa)) {
            mm_set_error(
                msg,
                "layer '%s' expert %d: the calibration's activations overflow float (largest |SwiGLU "
                "output| %g on N(0, 1) tokens): weights this large have no finite input scale",
                q->info.prefix, e, (double)aa);
            st = MEGAMOE_ERR_BAD_WEIGHT;
            break;
        }
        q->x_scale[e] = mm_activation_scale(xa);
        q->a_scale[e] = mm_activation_scale(aa);
    }
    free(scratch);
    return st;
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
                mm_join_name(name, sizeof name, prefix, which ? "w2_weight" : "w13_weight");
                if (strcmp(nm, name) != 0) continue;
                for (int64_t e = 0; e < E; e++) {
                    if (opt->progress)
                        opt->progress(opt->progress_user, "quantizing experts", (uint64_t)e + 1, (uint64_t)E);
                    for (int half = 0; half < (which ? 1 : 2); half++) {
                        const int proj = which ? 2 : half;
                        snprintf(rest, sizeof rest, "experts.%lld.%s", (long long)e, mm_proj_names[0][proj]);
                        mm_join_name(base, sizeof base, prefix, rest);
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
        mm_join_name(ex, sizeof ex, prefix, "experts.");
        if (strncmp(nm, ex, strlen(ex)) != 0) continue;
        for (int proj = 0; proj < 3; proj++) {
            int e;
            char tail[64];
            if (sscanf(nm + strlen(ex), "%d.%63s", &e, tail) != 2) continue;
            char want[96];
            snprintf(want, sizeof want, "%s.weight", mm_proj_names[q->pstyle][proj]);
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

static int same_file(const struct stat *a, const char *path) {
    struct stat b;
    return stat(path, &b) == 0 && a->st_dev == b.st_dev && a->st_ino == b.st_ino;
}

/* OUT must not be IN or one of its files (compared by device and inode, so links and other spellings of
 * a path count); a folder OUT must not exist yet (quantize writes a whole new folder). */
static megamoe_status check_output(const megamoe_checkpoint *ck, const char *in_path, const char *out_path,
                                   int folder, char *msg) {
    struct stat so;
    if (stat(out_path, &so) != 0) return MEGAMOE_OK;
    const char *same = same_file(&so, in_path) ? in_path : NULL;
    for (int f = 0; !same && f < ck->num_files; f++)
        if (same_file(&so, ck->files[f].path)) same = ck->files[f].path;
    if (same) {
        mm_set_error(msg, "output '%s' would replace the input '%s'", out_path, same);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (folder) {
        mm_set_error(msg,
                     "output folder '%s' exists; quantize writes a new folder (remove it or name another)",
                     out_path);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    return MEGAMOE_OK;
}

/* Removes what a failed folder conversion wrote into its temporary folder, and the folder. */
static void remove_partial(const char *dir, const megamoe_checkpoint *ck) {
    char path[4096];
    for (int f = 0; f < ck->num_files; f++) {
        snprintf(path, sizeof path, "%s/%s", dir, base_name(ck->files[f].path));
        unlink(path);
        snprintf(path, sizeof path, "%s/%s.tmp", dir, base_name(ck->files[f].path));
        unlink(path);
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    unlink(path);
    rmdir(dir);
}

megamoe_status megamoe_quantize_checkpoint(const char *in_path, const char *out_path,
                                           const megamoe_quantize_options *options, char *err,
                                           size_t err_size) {
    char msg[MM_ERR_LEN] = "", why[MM_ERR_LEN];
    megamoe_quantize_options defaults;
    megamoe_quantize_options_init(&defaults);
    const megamoe_quantize_options *opt = options ? options : &defaults;
    megamoe_checkpoint *ck = NULL;
    qlayer *layers = NULL;
    int nlayers = 0;
    out_list o = {0};
    json_t *wmap = NULL;
    char tmpdir[4096] = "";
    megamoe_status st;
    if (!in_path || !out_path || !out_path[0] || opt->calib_tokens < 1) {
        mm_set_error(msg, "quantize: input and output paths are needed, and calib_tokens >= 1");
        st = MEGAMOE_ERR_INVALID_ARGUMENT;
        goto done;
    }
    st = mm_check_activation_clamp(opt->activation_clamp, why); /* the rule run applies */
    if (st) {
        mm_set_error(msg, "quantize: %s", why);
        goto done;
    }
    st = megamoe_checkpoint_open(in_path, &ck);
    if (st) {
        mm_set_error(msg, "%s", megamoe_checkpoint_last_error(ck));
        goto done;
    }
    struct stat sb;
    const int folder = stat(in_path, &sb) == 0 && S_ISDIR(sb.st_mode);
    st = check_output(ck, in_path, out_path, folder, msg);
    if (st) goto done;
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
            st = check_layer_shapes(ck, &layers[nlayers++], msg);
        }
        free(infos);
        for (int i = 0; st == MEGAMOE_OK && i < nlayers; i++)
            st = check_layer_finite(ck, &layers[i], msg);
        for (int i = 0; st == MEGAMOE_OK && i < nlayers; i++)
            st = calibrate_layer(ck, &layers[i], opt, msg);
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
    if (folder) { /* a temporary folder beside OUT, renamed to OUT when complete */
        size_t n = strlen(out_path);
        while (n > 1 && out_path[n - 1] == '/')
            n--;
        snprintf(tmpdir, sizeof tmpdir, "%.*s.partial-XXXXXX", (int)n, out_path);
        if (!mkdtemp(tmpdir)) {
            mm_set_error(msg, "%s: cannot create a temporary folder: %s", tmpdir, strerror(errno));
            tmpdir[0] = '\0';
            st = MEGAMOE_ERR_IO;
            goto done;
        }
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
            snprintf(path, sizeof path, "%s/%s", tmpdir, base_name(ck->files[f].path));
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
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", tmpdir);
        json_t *root =
            json_pack("{s:{s:I}, s:O}", "metadata", "total_size", (json_int_t)total, "weight_map", wmap);
        if (!root || json_dump_file(root, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0) {
            mm_set_error(msg, "%s: cannot write the index", path);
            st = MEGAMOE_ERR_IO;
        }
        json_decref(root);
        if (st == MEGAMOE_OK && rename(tmpdir, out_path) != 0) {
            mm_set_error(msg, "%s: cannot rename the finished folder %s to it: %s", out_path, tmpdir,
                         strerror(errno));
            st = MEGAMOE_ERR_IO;
        }
    }
    if (st != MEGAMOE_OK && tmpdir[0]) remove_partial(tmpdir, ck);
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
