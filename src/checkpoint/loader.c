/*
 * loader.c -- the naming styles of SPEC §6: finding MoE layers in a checkpoint, describing them,
 * and loading one into a layer.
 *
 *   stacked:            {prefix}.w13_weight [E, 2I, H/2], w13_weight_scale, ..., w2_input_scale
 *   per expert:         {prefix}.experts.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}.{field}
 *                       field: weight, weight_scale, weight_scale_2, input_scale
 *   compressed-tensors: either style with weight_packed, weight_scale, weight_global_scale,
 *                       input_global_scale; the global scales are reciprocals and are inverted here;
 *                       weight_zero_point and weight_shape are ignored.
 *   weight-only:        any of these without input scales (compressed-tensors NVFP4A16, ModelOpt
 *                       W4A16): loads where the layer's activations are bf16 (SPEC §6).
 *   norm:               {prefix}.post_expert_norm.weight [H]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../formats.h"
#include "checkpoint.h"

static int starts_with(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }

/* Parses "experts.{e}.{proj}.{field}" (after the prefix); returns 1 and fills e, proj (0..2),
 * proj style, field (0..3), field style; field -1 for an ignored field. */
static int parse_expert_name(const char *rest, int *e, int *proj, int *pstyle, int *field, int *fstyle) {
    if (!starts_with(rest, "experts.")) return 0;
    const char *p = rest + 8;
    char *end;
    long id = strtol(p, &end, 10);
    if (end == p || *end != '.' || id < 0 || id > 1000000) return 0;
    *e = (int)id;
    p = end + 1;
    const char *dot = strchr(p, '.');
    if (!dot) return 0;
    *proj = -1;
    for (int s = 0; s < 2; s++)
        for (int j = 0; j < 3; j++)
            if ((size_t)(dot - p) == strlen(mm_proj_names[s][j]) &&
                strncmp(p, mm_proj_names[s][j], (size_t)(dot - p)) == 0) {
                *proj = j;
                *pstyle = s;
            }
    if (*proj < 0) return 0;
    const char *f = dot + 1;
    *field = -2;
    for (int s = 0; s < 2; s++)
        for (int j = 0; j < 4; j++)
            if (strcmp(f, mm_field_names[s][j]) == 0 && *field == -2) {
                *field = j;
                *fstyle = s;
            }
    if (strcmp(f, "weight_zero_point") == 0 || strcmp(f, "weight_shape") == 0) {
        *field = -1;
        *fstyle = 1;
    }
    return *field != -2;
}

/* The prefix of an MoE tensor name, or 0 when the name is not one. */
static int layer_prefix_of(const char *name, char *prefix, size_t n) {
    static const char *const stacked[] = {"w13_weight", "w13_weight_packed"};
    const char *last = strrchr(name, '.');
    const char *leaf = last ? last + 1 : name;
    for (int i = 0; i < 2; i++) {
        if (strcmp(leaf, stacked[i]) == 0) {
            size_t len = last ? (size_t)(last - name) : 0;
            if (len >= n) return 0;
            memcpy(prefix, name, len);
            prefix[len] = '\0';
            return 1;
        }
    }
    const char *ex = strstr(name, "experts.");
    while (ex) {
        if (ex == name || ex[-1] == '.') {
            int e, proj, ps, field, fs;
            if (parse_expert_name(ex, &e, &proj, &ps, &field, &fs) && proj == 0 && field == 0) {
                size_t len = ex == name ? 0 : (size_t)(ex - name - 1);
                if (len >= n) return 0;
                memcpy(prefix, name, len);
                prefix[len] = '\0';
                return 1;
            }
        }
        ex = strstr(ex + 1, "experts.");
    }
    return 0;
}

static uint64_t tensor_bytes(const megamoe_tensor *t) {
    return (uint64_t)megamoe_tensor_numel(t) * megamoe_dtype_size(t->dtype);
}

/* Describes the layer whose tensors start with `prefix` ("" = names without a prefix). */
static megamoe_status describe_prefix(megamoe_checkpoint *ck, const char *prefix, megamoe_layer_info *info) {
    memset(info, 0, sizeof *info);
    snprintf(info->prefix, sizeof info->prefix, "%s", prefix);
    char name[512];
    megamoe_tensor t;
    int64_t E = 0, H = 0, I = 0;
    for (int packed = 0; packed < 2; packed++) {
        mm_join_name(name, sizeof name, prefix, packed ? "w13_weight_packed" : "w13_weight");
        if (megamoe_checkpoint_find(ck, name, &t) != MEGAMOE_OK) continue;
        if (t.ndim != 3 || (t.dtype != MEGAMOE_DTYPE_U8 && t.dtype != MEGAMOE_DTYPE_BF16) ||
            (packed && t.dtype != MEGAMOE_DTYPE_U8) || t.shape[1] % 2) {
            mm_set_error(ck->error,
                         "tensor '%s': shape/dtype %s with %d dims is not [E, 2I, H/2] U8 or "
                         "[E, 2I, H] BF16",
                         name, megamoe_dtype_name(t.dtype), t.ndim);
            return MEGAMOE_ERR_BAD_WEIGHT;
        }
        info->naming = packed ? MEGAMOE_NAMING_COMPRESSED_TENSORS : MEGAMOE_NAMING_STACKED;
        info->format = t.dtype == MEGAMOE_DTYPE_U8 ? MEGAMOE_FORMAT_NVFP4 : MEGAMOE_FORMAT_BF16;
        E = t.shape[0];
        I = t.shape[1] / 2;
        H = info->format == MEGAMOE_FORMAT_NVFP4 ? t.shape[2] * 2 : t.shape[2];
        break;
    }
    if (!E) {
        /* Per-expert naming: expert 0's gate projection gives the format and the sizes. */
        int found = 0;
        for (int ps = 0; ps < 2 && !found; ps++) {
            for (int fs = 0; fs < 2 && !found; fs++) {
                char rest[64];
                snprintf(rest, sizeof rest, "experts.0.%s.%s", mm_proj_names[ps][0], mm_field_names[fs][0]);
                mm_join_name(name, sizeof name, prefix, rest);
                if (megamoe_checkpoint_find(ck, name, &t) != MEGAMOE_OK) continue;
                found = 1;
                if (t.ndim != 2 || (t.dtype != MEGAMOE_DTYPE_U8 && t.dtype != MEGAMOE_DTYPE_BF16) ||
                    (fs && t.dtype != MEGAMOE_DTYPE_U8)) {
                    mm_set_error(ck->error, "tensor '%s': %s with %d dims is not [I, H/2] U8 or [I, H] BF16",
                                 name, megamoe_dtype_name(t.dtype), t.ndim);
                    return MEGAMOE_ERR_BAD_WEIGHT;
                }
                info->naming = fs ? MEGAMOE_NAMING_COMPRESSED_TENSORS : MEGAMOE_NAMING_PER_EXPERT;
                info->format = t.dtype == MEGAMOE_DTYPE_U8 ? MEGAMOE_FORMAT_NVFP4 : MEGAMOE_FORMAT_BF16;
                I = t.shape[0];
                H = info->format == MEGAMOE_FORMAT_NVFP4 ? t.shape[1] * 2 : t.shape[1];
            }
        }
        if (!found) {
            mm_set_error(ck->error,
                         "no MoE layer with prefix '%s' (no %s.w13_weight or %s.experts.0.gate_proj.weight)",
                         prefix, prefix, prefix);
            return MEGAMOE_ERR_BAD_WEIGHT;
        }
        /* E = 1 + the largest expert id under the prefix. */
        char ex[300];
        mm_join_name(ex, sizeof ex, prefix, "experts.");
        for (int i = 0; i < ck->num_tensors; i++) {
            const char *nm = ck->tensors[i].name;
            if (!starts_with(nm, ex)) continue;
            int e, proj, ps, field, fs;
            if (parse_expert_name(nm + strlen(ex) - 8, &e, &proj, &ps, &field, &fs) && e + 1 > E) E = e + 1;
        }
    }
    /* The layer rules run applies (SPEC §1), on the 64-bit sizes, before they are narrowed to int. */
    char why[MM_ERR_LEN];
    if (mm_check_layer_shape(E, H, I, why) != MEGAMOE_OK) {
        mm_set_error(ck->error, "MoE layer '%s' (%s): %s", prefix, name, why);
        return MEGAMOE_ERR_BAD_WEIGHT;
    }
    info->num_experts = (int)E;
    info->hidden_size = (int)H;
    info->intermediate_size = (int)I;
    /* Bytes of the layer's expert tensors and its norm. */
    char ex[300], st1[300], st2[300];
    mm_join_name(ex, sizeof ex, prefix, "experts.");
    mm_join_name(st1, sizeof st1, prefix, "w13_");
    mm_join_name(st2, sizeof st2, prefix, "w2_");
    for (int i = 0; i < ck->num_tensors; i++) {
        const char *nm = ck->tensors[i].name;
        if (starts_with(nm, ex) || starts_with(nm, st1) || starts_with(nm, st2)) {
            mm_ck_view(ck, i, &t);
            info->bytes += tensor_bytes(&t);
        }
    }
    mm_join_name(name, sizeof name, prefix, "post_expert_norm.weight");
    info->has_norm = megamoe_checkpoint_find(ck, name, NULL) == MEGAMOE_OK;
    return MEGAMOE_OK;
}

megamoe_status megamoe_checkpoint_describe_layer(megamoe_checkpoint *ck, const char *prefix,
                                                 megamoe_layer_info *info) {
    if (!ck || !info) return MEGAMOE_ERR_INVALID_ARGUMENT;
    if (prefix && prefix[0]) return describe_prefix(ck, prefix, info);
    /* No prefix: the only layer there is. */
    megamoe_layer_info one[2];
    int found = 0;
    megamoe_status st = megamoe_checkpoint_find_layers(ck, one, 2, &found);
    if (st) return st;
    if (found == 0) {
        mm_set_error(ck->error, "no MoE expert weights found (looked for *.w13_weight, "
                                "*.experts.N.gate_proj.weight and their variants)");
        return MEGAMOE_ERR_BAD_WEIGHT;
    }
    if (found > 1) {
        mm_set_error(ck->error,
                     "the checkpoint holds %d MoE layers ('%s', '%s', ...); name one with --prefix", found,
                     one[0].prefix, one[1].prefix);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    *info = one[0];
    return MEGAMOE_OK;
}

megamoe_status megamoe_checkpoint_find_layers(megamoe_checkpoint *ck, megamoe_layer_info *infos,
                                              int max_layers, int *num_found) {
    if (!ck || !num_found || (max_layers > 0 && !infos)) return MEGAMOE_ERR_INVALID_ARGUMENT;
    *num_found = 0;
    char(*seen)[256] = NULL;
    int nseen = 0, cap = 0;
    for (int i = 0; i < ck->num_tensors; i++) {
        char prefix[256];
        if (!layer_prefix_of(ck->tensors[i].name, prefix, sizeof prefix)) continue;
        int dup = 0;
        for (int j = 0; j < nseen && !dup; j++)
            dup = strcmp(seen[j], prefix) == 0;
        if (dup) continue;
        if (nseen == cap) {
            cap = cap ? cap * 2 : 16;
            void *ns = realloc(seen, (size_t)cap * sizeof *seen);
            if (!ns) {
                free(seen);
                return MEGAMOE_ERR_OUT_OF_MEMORY;
            }
            seen = ns;
        }
        memcpy(seen[nseen++], prefix, sizeof prefix);
    }
    megamoe_status st = MEGAMOE_OK;
    for (int j = 0; j < nseen && st == MEGAMOE_OK; j++) {
        if (j < max_layers) st = describe_prefix(ck, seen[j], &infos[j]);
    }
    free(seen);
    *num_found = nseen;
    return st;
}

/* ---- Loading into a layer ------------------------------------------------------------------- */

/* Appends " (tensor 'name' in file)" to the layer's message after a failed load call. */
static megamoe_status annotate(megamoe_layer *l, const megamoe_checkpoint *ck, const char *name,
                               megamoe_status st) {
    if (st == MEGAMOE_OK) return st;
    int i = mm_ck_lookup(ck, name);
    char msg[MM_ERR_LEN];
    snprintf(msg, sizeof msg, "%s (tensor '%s' in %s)", l->error, name,
             i >= 0 ? ck->files[ck->tensors[i].file].path : "?");
    memcpy(l->error, msg, sizeof msg);
    return st;
}

static megamoe_status missing(megamoe_layer *l, const megamoe_checkpoint *ck, const char *name) {
    return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT,
                         "tensor '%s' is missing from the checkpoint (%d file%s, "
                         "first %s)",
                         name, ck->num_files, ck->num_files == 1 ? "" : "s",
                         ck->num_files ? ck->files[0].path : "-");
}

/* An input scale that is absent: gate/up's are never read and a2 is read only with NVFP4
 * activations (SPEC §3b), so a weight-only export (no input scales, SPEC §6) loads where a2 is not
 * read; where it is, the message names a2's tensor and the mode that would take the export. */
static megamoe_status missing_input_scale(megamoe_layer *l, const megamoe_checkpoint *ck, const char *name,
                                          int down) {
    if (!down || !mm_layer_quantizes_activations(l)) return MEGAMOE_OK;
    missing(l, ck, name);
    char msg[MM_ERR_LEN];
    snprintf(msg, sizeof msg, "%s%s", l->error, mm_weight_only_hint);
    memcpy(l->error, msg, sizeof msg);
    return MEGAMOE_ERR_BAD_WEIGHT;
}

/* compressed-tensors stores 1/alpha; the copy it loads holds alpha. */
static megamoe_status inverted_copy(megamoe_layer *l, const megamoe_tensor *t, const char *name, float **buf,
                                    megamoe_tensor *out) {
    const int64_t n = megamoe_tensor_numel(t);
    if (t->dtype != MEGAMOE_DTYPE_F32)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "%s: dtype %s, expected F32", name,
                             megamoe_dtype_name(t->dtype));
    *buf = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!*buf) return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory");
    for (int64_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, (const uint8_t *)t->data + i * 4, 4);
        /* 1/0 and 1/inf give inf and 0, which the scale checks then reject by name. */
        (*buf)[i] = mm_div(1.0f, v);
    }
    *out = *t;
    out->data = *buf;
    return MEGAMOE_OK;
}

static int expert_is_local(const megamoe_layer *l, int e) {
    const int owner = e / l->experts_per_rank;
    for (int r = 0; r < l->group->local_ranks; r++)
        if (megamoe_group_rank(l->group, r) == owner) return 1;
    return 0;
}

static megamoe_status load_stacked(megamoe_layer *l, megamoe_checkpoint *ck, const char *prefix, int packed) {
    static const char *const names[8] = {"w13_weight",        "w13_weight_scale", "w13_weight_scale_2",
                                         "w13_input_scale",   "w2_weight",        "w2_weight_scale",
                                         "w2_weight_scale_2", "w2_input_scale"};
    static const char *const packed_names[8] = {
        "w13_weight_packed", "w13_weight_scale", "w13_weight_global_scale", "w13_input_global_scale",
        "w2_weight_packed",  "w2_weight_scale",  "w2_weight_global_scale",  "w2_input_global_scale"};
    const int nvfp4 = l->config.format == MEGAMOE_FORMAT_NVFP4;
    char name[512];
    for (int i = 0; i < 8; i++) {
        if (!nvfp4 && i != 0 && i != 4) continue;
        mm_join_name(name, sizeof name, prefix, packed ? packed_names[i] : names[i]);
        megamoe_tensor t;
        if (megamoe_checkpoint_find(ck, name, &t) != MEGAMOE_OK) {
            if (i == 3 || i == 7) {
                megamoe_status st = missing_input_scale(l, ck, name, i == 7);
                if (st) return st;
                continue;
            }
            return missing(l, ck, name);
        }
        float *buf = NULL;
        megamoe_status st = MEGAMOE_OK;
        if (packed && (i == 2 || i == 3 || i == 6 || i == 7)) st = inverted_copy(l, &t, name, &buf, &t);
        if (st == MEGAMOE_OK) st = megamoe_layer_load_weight(l, names[i], &t);
        free(buf);
        if (st) return annotate(l, ck, name, st);
    }
    /* Anything else under the stacked names is an unknown weight. */
    char w13[300], w2[300];
    mm_join_name(w13, sizeof w13, prefix, "w13_");
    mm_join_name(w2, sizeof w2, prefix, "w2_");
    for (int i = 0; i < ck->num_tensors; i++) {
        const char *nm = ck->tensors[i].name;
        if (!starts_with(nm, w13) && !starts_with(nm, w2)) continue;
        int known = 0;
        for (int j = 0; j < 8 && !known; j++) {
            mm_join_name(name, sizeof name, prefix, packed ? packed_names[j] : names[j]);
            known = strcmp(nm, name) == 0 && (nvfp4 || j == 0 || j == 4);
        }
        if (!known)
            return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "unexpected expert weight '%s' in %s", nm,
                                 ck->files[ck->tensors[i].file].path);
    }
    return MEGAMOE_OK;
}

static megamoe_status load_per_expert(megamoe_layer *l, megamoe_checkpoint *ck, const char *prefix,
                                      int fstyle, megamoe_progress_fn progress, void *user) {
    const int nvfp4 = l->config.format == MEGAMOE_FORMAT_NVFP4, E = l->config.num_experts;
    /* Which projection names the checkpoint uses: gate_proj/up_proj/down_proj or w1/w3/w2. */
    char name[512], rest[96];
    int pstyle = 0;
    snprintf(rest, sizeof rest, "experts.0.w1.%s", mm_field_names[fstyle][0]);
    mm_join_name(name, sizeof name, prefix, rest);
    if (megamoe_checkpoint_find(ck, name, NULL) == MEGAMOE_OK) pstyle = 1;
    /* Every tensor under {prefix}.experts. must be one we know. */
    char ex[300];
    mm_join_name(ex, sizeof ex, prefix, "experts.");
    for (int i = 0; i < ck->num_tensors; i++) {
        const char *nm = ck->tensors[i].name;
        if (!starts_with(nm, ex)) continue;
        int e, proj, ps, field, fs;
        if (!parse_expert_name(nm + strlen(ex) - 8, &e, &proj, &ps, &field, &fs) || ps != pstyle ||
            (field >= 0 && fs != fstyle && !(field == 1)) || e >= E || (!nvfp4 && field > 0))
            return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT, "unexpected expert weight '%s' in %s", nm,
                                 ck->files[ck->tensors[i].file].path);
    }
    for (int e = 0; e < E; e++) {
        if (progress) progress(user, "loading experts", (uint64_t)e + 1, (uint64_t)E);
        if (!expert_is_local(l, e)) continue;
        for (int proj = 0; proj < 3; proj++) {
            for (int field = 0; field < (nvfp4 ? 4 : 1); field++) {
                snprintf(rest, sizeof rest, "experts.%d.%s.%s", e, mm_proj_names[pstyle][proj],
                         mm_field_names[fstyle][field]);
                mm_join_name(name, sizeof name, prefix, rest);
                megamoe_tensor t;
                if (megamoe_checkpoint_find(ck, name, &t) != MEGAMOE_OK) {
                    if (field == MEGAMOE_FIELD_INPUT_SCALE) {
                        megamoe_status st = missing_input_scale(l, ck, name, proj == MEGAMOE_PROJ_DOWN);
                        if (st) return st;
                        continue;
                    }
                    return missing(l, ck, name);
                }
                float *buf = NULL;
                megamoe_status st = MEGAMOE_OK;
                if (fstyle == 1 && field >= 2) st = inverted_copy(l, &t, name, &buf, &t);
                if (st == MEGAMOE_OK)
                    st = megamoe_layer_load_expert_weight(l, e, (megamoe_proj)proj, (megamoe_field)field, &t);
                free(buf);
                if (st) return annotate(l, ck, name, st);
            }
        }
    }
    return MEGAMOE_OK;
}

megamoe_status megamoe_layer_load_checkpoint(megamoe_layer *l, megamoe_checkpoint *ck, const char *prefix,
                                             megamoe_progress_fn progress, void *user) {
    if (!l) return MEGAMOE_ERR_INVALID_ARGUMENT;
    if (!ck) return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "checkpoint is NULL");
    megamoe_layer_info info;
    megamoe_status st = megamoe_checkpoint_describe_layer(ck, prefix, &info);
    if (st) return mm_layer_fail(l, st, "%s", ck->error);
    const megamoe_layer_config *c = &l->config;
    if (info.num_experts != c->num_experts || info.hidden_size != c->hidden_size ||
        info.intermediate_size != c->intermediate_size || info.format != c->format)
        return mm_layer_fail(l, MEGAMOE_ERR_BAD_WEIGHT,
                             "checkpoint layer '%s' is %s E=%d H=%d I=%d, but the layer was created %s E=%d "
                             "H=%d I=%d",
                             info.prefix, info.format == MEGAMOE_FORMAT_NVFP4 ? "NVFP4" : "BF16",
                             info.num_experts, info.hidden_size, info.intermediate_size,
                             c->format == MEGAMOE_FORMAT_NVFP4 ? "NVFP4" : "BF16", c->num_experts,
                             c->hidden_size, c->intermediate_size);
    if (info.naming == MEGAMOE_NAMING_STACKED) {
        st = load_stacked(l, ck, info.prefix, 0);
    } else if (info.naming == MEGAMOE_NAMING_PER_EXPERT) {
        st = load_per_expert(l, ck, info.prefix, 0, progress, user);
    } else {
        char name[512];
        mm_join_name(name, sizeof name, info.prefix, "w13_weight_packed");
        st = megamoe_checkpoint_find(ck, name, NULL) == MEGAMOE_OK
                 ? load_stacked(l, ck, info.prefix, 1)
                 : load_per_expert(l, ck, info.prefix, 1, progress, user);
    }
    if (st) return st;
    char name[512];
    mm_join_name(name, sizeof name, info.prefix, "post_expert_norm.weight");
    megamoe_tensor t;
    if (megamoe_checkpoint_find(ck, name, &t) == MEGAMOE_OK)
        return annotate(l, ck, name, megamoe_layer_load_norm_weight(l, &t));
    return MEGAMOE_OK;
}
