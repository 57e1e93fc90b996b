#include "test_util.h"

#include <math.h>
#include <stdarg.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

/* splitmix64: each draw advances the state by this, so the state k draws on is a jump of k of it. */
#define TU_RNG_INCREMENT 0x9E3779B97F4A7C15ull
#define TU_NORMAL_DRAWS 2 /* tu_normal's uniforms */

uint64_t tu_next(tu_rng *r) {
    uint64_t z = (r->state += TU_RNG_INCREMENT);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
double tu_uniform(tu_rng *r) { return (double)(tu_next(r) >> 11) / 9007199254740992.0; }
double tu_normal(tu_rng *r) {
    return sqrt(-2.0 * log(1.0 - tu_uniform(r))) * cos(6.283185307179586 * tu_uniform(r));
}
uint16_t tu_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
float tu_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* n bf16 values N(0, 1 / fan_in), the values n calls of tu_normal on r give in turn: value i starts
 * TU_NORMAL_DRAWS * i draws after r's state, so the values are drawn in parallel (test_gpu builds
 * DeepSeek-sized BF16 layers in every kernel mode). r ends where the n sequential calls leave it. */
static void bf16_normal_fill(uint16_t *w, size_t n, tu_rng *r, size_t fan_in) {
    const uint64_t s0 = r->state;
    const double scale = sqrt((double)fan_in);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (size_t i = 0; i < n; i++) {
        tu_rng ri = {s0 + TU_NORMAL_DRAWS * (uint64_t)i * TU_RNG_INCREMENT};
        w[i] = tu_bf16((float)(tu_normal(&ri) / scale));
    }
    r->state = s0 + TU_NORMAL_DRAWS * (uint64_t)n * TU_RNG_INCREMENT;
}

void tu_model_random(tu_model *m, const megamoe_layer_config *cfg, int with_norm, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    tu_rng r = {seed};
    const size_t E = (size_t)cfg->num_experts, H = (size_t)cfg->hidden_size,
                 I = (size_t)cfg->intermediate_size;
    if (cfg->format == MEGAMOE_FORMAT_NVFP4) {
        m->w13 = xmalloc(E * 2 * I * H / 2);
        m->w13_sf = xmalloc(E * 2 * I * H / 16);
        m->w2 = xmalloc(E * H * I / 2);
        m->w2_sf = xmalloc(E * H * I / 16);
        m->w13_s2 = xmalloc(E * 2 * 4);
        m->w13_in = xmalloc(E * 2 * 4);
        m->w2_s2 = xmalloc(E * 4);
        m->w2_in = xmalloc(E * 4);
        for (size_t i = 0; i < E * 2 * I * H / 2; i++)
            m->w13[i] = (uint8_t)tu_next(&r);
        for (size_t i = 0; i < E * H * I / 2; i++)
            m->w2[i] = (uint8_t)tu_next(&r);
        /* Block scales spread over subnormal and normal E4M3 values (0x01..0x5F). */
        for (size_t i = 0; i < E * 2 * I * H / 16; i++)
            m->w13_sf[i] = (uint8_t)(1 + tu_next(&r) % 0x5F);
        for (size_t i = 0; i < E * H * I / 16; i++)
            m->w2_sf[i] = (uint8_t)(1 + tu_next(&r) % 0x5F);
        for (size_t e = 0; e < E; e++) {
            m->w13_s2[2 * e] = (float)(0.5 + tu_uniform(&r)) / (float)H;
            m->w13_s2[2 * e + 1] = (float)(0.5 + tu_uniform(&r)) / (float)H;
            m->w13_in[2 * e] = m->w13_in[2 * e + 1] = 1.0f / 2688.0f;
            m->w2_s2[e] = (float)(0.5 + tu_uniform(&r)) / (float)I;
            m->w2_in[e] = (float)(0.05 + 0.1 * tu_uniform(&r));
        }
    } else {
        m->w13_bf16 = xmalloc(E * 2 * I * H * 2);
        m->w2_bf16 = xmalloc(E * H * I * 2);
        bf16_normal_fill(m->w13_bf16, E * 2 * I * H, &r, H);
        bf16_normal_fill(m->w2_bf16, E * H * I, &r, I);
    }
    if (with_norm) {
        m->norm = xmalloc(H * 4);
        for (size_t h = 0; h < H; h++)
            m->norm[h] = (float)(1.0 + 0.2 * tu_normal(&r));
    }
}

void tu_model_free(tu_model *m) {
    free(m->w13), free(m->w13_sf), free(m->w2), free(m->w2_sf);
    free(m->w13_s2), free(m->w13_in), free(m->w2_s2), free(m->w2_in);
    free(m->w13_bf16), free(m->w2_bf16), free(m->norm);
}

megamoe_status tu_model_load(const tu_model *m, megamoe_layer *layer) {
    const int64_t E = m->cfg.num_experts, H = m->cfg.hidden_size, I = m->cfg.intermediate_size;
    megamoe_status st;
    if (m->cfg.format == MEGAMOE_FORMAT_NVFP4) {
        const struct {
            const char *name;
            megamoe_tensor t;
        } ts[] = {
            {"w13_weight", {MEGAMOE_DTYPE_U8, 3, {E, 2 * I, H / 2}, m->w13}},
            {"w13_weight_scale", {MEGAMOE_DTYPE_F8_E4M3, 3, {E, 2 * I, H / 16}, m->w13_sf}},
            {"w13_weight_scale_2", {MEGAMOE_DTYPE_F32, 2, {E, 2}, m->w13_s2}},
            {"w13_input_scale", {MEGAMOE_DTYPE_F32, 2, {E, 2}, m->w13_in}},
            {"w2_weight", {MEGAMOE_DTYPE_U8, 3, {E, H, I / 2}, m->w2}},
            {"w2_weight_scale", {MEGAMOE_DTYPE_F8_E4M3, 3, {E, H, I / 16}, m->w2_sf}},
            {"w2_weight_scale_2", {MEGAMOE_DTYPE_F32, 1, {E}, m->w2_s2}},
            {"w2_input_scale", {MEGAMOE_DTYPE_F32, 1, {E}, m->w2_in}},
        };
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            if ((st = megamoe_layer_load_weight(layer, ts[i].name, &ts[i].t)) != MEGAMOE_OK) return st;
    } else {
        megamoe_tensor w13 = {MEGAMOE_DTYPE_BF16, 3, {E, 2 * I, H}, m->w13_bf16};
        megamoe_tensor w2 = {MEGAMOE_DTYPE_BF16, 3, {E, H, I}, m->w2_bf16};
        if ((st = megamoe_layer_load_weight(layer, "w13_weight", &w13)) != MEGAMOE_OK) return st;
        if ((st = megamoe_layer_load_weight(layer, "w2_weight", &w2)) != MEGAMOE_OK) return st;
    }
    if (m->norm) {
        megamoe_tensor n = {MEGAMOE_DTYPE_F32, 1, {H}, m->norm};
        if ((st = megamoe_layer_load_norm_weight(layer, &n)) != MEGAMOE_OK) return st;
    }
    return MEGAMOE_OK;
}

megamoe_status tu_layer_create(const tu_model *m, megamoe_group *g, megamoe_layer **l) {
    megamoe_status st = megamoe_layer_create(g, &m->cfg, l);
    if (st == MEGAMOE_OK) st = tu_model_load(m, *l);
    if (st == MEGAMOE_OK) st = megamoe_layer_finalize(*l);
    return st;
}

void tu_layer_make(const tu_model *m, int R, megamoe_group **g, megamoe_layer **l) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = R;
    assert_int_equal(megamoe_group_create(&gc, g), MEGAMOE_OK);
    megamoe_status st = megamoe_layer_create(*g, &m->cfg, l);
    if (st) fprintf(stderr, "%s\n", megamoe_layer_last_error(*l));
    assert_int_equal(st, MEGAMOE_OK);
    st = tu_model_load(m, *l);
    if (st == MEGAMOE_OK) st = megamoe_layer_finalize(*l);
    if (st) fprintf(stderr, "%s\n", megamoe_layer_last_error(*l));
    assert_int_equal(st, MEGAMOE_OK);
}

void tu_inputs_random(tu_inputs *in, int T, int K, int H, int E, uint64_t seed) {
    tu_rng r = {seed};
    in->T = T, in->K = K, in->H = H;
    in->x = xmalloc((size_t)T * H * 2);
    in->ids = xmalloc((size_t)T * K * 4);
    in->weights = xmalloc((size_t)T * K * 4);
    in->padding = xmalloc((size_t)T);
    for (size_t i = 0; i < (size_t)T * H; i++)
        in->x[i] = tu_bf16((float)tu_normal(&r));
    for (size_t i = 0; i < (size_t)T * K; i++) {
        in->ids[i] = (int32_t)(tu_next(&r) % (uint64_t)E);
        in->weights[i] = (float)tu_normal(&r); /* negative weights too */
    }
    memset(in->padding, 0, (size_t)T);
}

void tu_inputs_edge_cases(tu_inputs *in, int T, const megamoe_layer_config *c, uint64_t seed) {
    tu_inputs_random(in, T, c->top_k, c->hidden_size, c->num_experts, seed);
    const int K = c->top_k, H = c->hidden_size;
    if (T < 8) return;
    in->ids[1 * K + (K - 1)] = -1;
    if (K >= 2) in->ids[2 * K + 0] = in->ids[2 * K + 1];
    for (int k = 0; k < K; k++)
        in->ids[3 * K + k] = -1;
    in->padding[4] = 1;
    in->x[4 * H + 7] = 0x7FC0;
    in->x[5 * H + 100] = 0x7F80;
    in->x[6 * H + 0] = 0xFFC0;
    for (int h = 0; h < H; h++)
        in->x[7 * H + h] = 0;
}

void tu_inputs_free(tu_inputs *in) { free(in->x), free(in->ids), free(in->weights), free(in->padding); }

void tu_split_args(const tu_inputs *in, int R, const uint16_t *x, const int32_t *ids, const float *weights,
                   const uint8_t *padding, uint16_t *y, megamoe_forward_args *args) {
    const int T = in->T, chunk = (T + R - 1) / R;
    for (int r = 0; r < R; r++) {
        const int t0 = r * chunk < T ? r * chunk : T, t1 = t0 + chunk < T ? t0 + chunk : T;
        args[r] = (megamoe_forward_args){
            t1 - t0,      x + (size_t)t0 * in->H, ids + (size_t)t0 * in->K, weights + (size_t)t0 * in->K,
            padding + t0, y + (size_t)t0 * in->H};
    }
}

megamoe_status tu_forward(megamoe_group *g, megamoe_layer *l, const tu_inputs *in, uint16_t *y) {
    megamoe_forward_args args[72];
    memset(y, 0xFF, (size_t)in->T * in->H * 2);
    tu_split_args(in, megamoe_group_local_ranks(g), in->x, in->ids, in->weights, in->padding, y, args);
    return megamoe_layer_forward(l, args, NULL);
}

double tu_device_tol(const megamoe_layer_config *c) {
    return c->format == MEGAMOE_FORMAT_NVFP4 && c->activations == MEGAMOE_ACTIVATIONS_BF16
               ? TU_DEVICE_TOL_W4A16
               : TU_DEVICE_TOL;
}

double tu_compare_y(const tu_inputs *in, const uint16_t *y, const uint16_t *y_ref, char *why,
                    size_t why_len) {
    const int H = in->H;
    double num = 0, den = 0;
    for (int t = 0; t < in->T; t++) {
        int ref_nan = 0, nan = 0, ref_zero = 1;
        for (int h = 0; h < H; h++) {
            const uint16_t a = y[(size_t)t * H + h], b = y_ref[(size_t)t * H + h];
            if (a == 0xFFFF) {
                snprintf(why, why_len, "token %d element %d was not written", t, h);
                return -1;
            }
            ref_nan |= (b & 0x7FFF) > 0x7F80;
            nan |= (a & 0x7FFF) > 0x7F80;
            ref_zero &= (b & 0x7FFF) == 0;
        }
        if (ref_nan != nan) {
            snprintf(why, why_len, "token %d is a NaN row on %s only", t, ref_nan ? "the CPU" : "the device");
            return -1;
        }
        if (ref_nan) continue;
        for (int h = 0; h < H; h++) {
            const double a = tu_f32(y[(size_t)t * H + h]), b = tu_f32(y_ref[(size_t)t * H + h]);
            if (ref_zero && a != 0.0) {
                snprintf(why, why_len, "token %d should be a zero row", t);
                return -1;
            }
            num += (a - b) * (a - b);
            den += b * b;
        }
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

char *tu_tmpdir(void) {
    const char *base = getenv("MEGAMOE_TEST_TMP");
    if (!base) base = "/tmp";
    mkdir(base, 0777);
    char tmpl[4096];
    snprintf(tmpl, sizeof tmpl, "%s/mmXXXXXX", base);
    char *d = mkdtemp(tmpl);
    assert_non_null(d);
    return strdup(d);
}

char *tu_write_file(const char *dir, const char *name, const void *data, size_t n) {
    char *path = xmalloc(strlen(dir) + strlen(name) + 2);
    sprintf(path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
    return path;
}
