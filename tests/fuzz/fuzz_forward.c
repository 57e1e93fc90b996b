/*
 * fuzz_forward.c -- libFuzzer target for what `megamoe run` hands the CPU backend: an inputs file
 * (hidden_states, topk_ids, topk_weights, is_padding) and the forward's arguments (T per rank, ids,
 * weights, padding). Any input must give y or an error; never a crash or an out-of-bounds access.
 * Built and run by tests/fuzz/run.sh; tests/fuzz/make_seeds.py writes the seed corpus.
 *
 * An input is:
 *   byte 0   flags: bit 0 BF16 layer (else NVFP4), bit 1 two ranks (else one), bit 2 T taken from
 *            byte 1 (else from hidden_states), bit 3 no padding array even when the file has one
 *   byte 1   T as a signed byte (-128..127) when bit 2 is set; byte 2 how many of the T go to rank 0
 *   then a safetensors image. Tensors of another dtype or rank are skipped, as run refuses them; the
 *   arrays handed to the forward are the tensors' bytes, cut or zero-extended to T rows.
 * The layer: E = 4, K = 2, H = I = 256 (the smallest legal H and I), T_max = 4 per rank (8 tokens over
 * two ranks, 16 slots for 4 experts: every expert can get tokens from both ranks, and T above T_max is
 * one step away), random weights of a fixed seed. Each bound is small because an input's time is the
 * experts' multiply-adds; run.sh builds this target at -O2 and leaves the arithmetic leaves out of the
 * coverage and UBSan instrumentation (tests/fuzz/coverage_ignore.txt, ubsan_ignore.txt).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { E = 4, K = 2, H = 256, I = 256, T_MAX = 4 };

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return g_rng;
}

static megamoe_layer *make_layer(int bf16, int ranks, megamoe_group **gout) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = ranks;
    gc.num_threads = 1;
    megamoe_group *g = NULL;
    megamoe_layer *l = NULL;
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.num_experts = E, c.top_k = K, c.hidden_size = H, c.intermediate_size = I, c.max_tokens = T_MAX;
    c.format = bf16 ? MEGAMOE_FORMAT_BF16 : MEGAMOE_FORMAT_NVFP4;
    if (megamoe_group_create(&gc, &g) || megamoe_layer_create(g, &c, &l)) abort();
    const int64_t cols13 = bf16 ? H : H / 2, cols2 = bf16 ? I : I / 2;
    const size_t n13 = (size_t)E * 2 * I * (size_t)cols13, n2 = (size_t)E * H * (size_t)cols2;
    uint8_t *w13 = malloc(n13 * (bf16 ? 2 : 1)), *w2 = malloc(n2 * (bf16 ? 2 : 1));
    if (bf16) {
        for (size_t i = 0; i < n13; i++) ((uint16_t *)w13)[i] = (uint16_t)(0x3C00 | (next() & 0x807F));
        for (size_t i = 0; i < n2; i++) ((uint16_t *)w2)[i] = (uint16_t)(0x3C00 | (next() & 0x807F));
    } else {
        for (size_t i = 0; i < n13; i++) w13[i] = (uint8_t)next();
        for (size_t i = 0; i < n2; i++) w2[i] = (uint8_t)next();
    }
    megamoe_tensor t13 = {bf16 ? MEGAMOE_DTYPE_BF16 : MEGAMOE_DTYPE_U8, 3, {E, 2 * I, cols13}, w13};
    megamoe_tensor t2 = {bf16 ? MEGAMOE_DTYPE_BF16 : MEGAMOE_DTYPE_U8, 3, {E, H, cols2}, w2};
    int bad = megamoe_layer_load_weight(l, "w13_weight", &t13) || megamoe_layer_load_weight(l, "w2_weight", &t2);
    if (!bf16) {
        uint8_t *sf13 = malloc((size_t)E * 2 * I * H / 16), *sf2 = malloc((size_t)E * H * I / 16);
        for (size_t i = 0; i < (size_t)E * 2 * I * H / 16; i++) sf13[i] = (uint8_t)(0x30 + (next() & 15));
        for (size_t i = 0; i < (size_t)E * H * I / 16; i++) sf2[i] = (uint8_t)(0x30 + (next() & 15));
        float s[2 * E];
        for (int i = 0; i < 2 * E; i++) s[i] = 1.0f / 64.0f;
        megamoe_tensor a = {MEGAMOE_DTYPE_F8_E4M3, 3, {E, 2 * I, H / 16}, sf13};
        megamoe_tensor b = {MEGAMOE_DTYPE_F8_E4M3, 3, {E, H, I / 16}, sf2};
        megamoe_tensor s13 = {MEGAMOE_DTYPE_F32, 2, {E, 2}, s}, s2 = {MEGAMOE_DTYPE_F32, 1, {E}, s};
        bad = bad || megamoe_layer_load_weight(l, "w13_weight_scale", &a) ||
              megamoe_layer_load_weight(l, "w2_weight_scale", &b) ||
              megamoe_layer_load_weight(l, "w13_weight_scale_2", &s13) ||
              megamoe_layer_load_weight(l, "w2_weight_scale_2", &s2) ||
              megamoe_layer_load_weight(l, "w2_input_scale", &s2);
        free(sf13), free(sf2);
    }
    free(w13), free(w2);
    if (bad || megamoe_layer_finalize(l)) abort();
    *gout = g;
    return l;
}

/* The tensor's bytes as rows of row_bytes, cut or zero-extended to T rows (NULL when T == 0). */
static void *rows_of(const uint8_t *image, uint64_t data_offset, const mm_st_entry *e, size_t row_bytes, int T) {
    const size_t want = (size_t)T * row_bytes;
    uint8_t *p = calloc(want ? want : 1, 1);
    if (!p || !e) return p;
    const size_t have = (size_t)(e->end - e->begin);
    memcpy(p, image + data_offset + e->begin, have < want ? have : want);
    return p;
}

int LLVMFuzzerTestOneInput(const uint8_t *in, size_t size) {
    static megamoe_group *groups[2][2];
    static megamoe_layer *layers[2][2];
    if (size < 3) return 0;
    const int bf16 = in[0] & 1, two = (in[0] >> 1) & 1;
    if (!layers[bf16][two]) layers[bf16][two] = make_layer(bf16, two + 1, &groups[bf16][two]);
    megamoe_layer *l = layers[bf16][two];
    const uint8_t *image_in = in + 3;
    const size_t n = size - 3;
    uint8_t *image = malloc(n ? n : 1); /* a private copy: reads past its end hit ASan's redzone */
    if (!image) return 0;
    memcpy(image, image_in, n);
    mm_st_entry *entries = NULL;
    int ne = 0;
    uint64_t data_offset = 0;
    char err[MM_ERR_LEN];
    if (mm_safetensors_parse(image, n, "fuzz", &entries, &ne, &data_offset, err) == MEGAMOE_OK) {
        const mm_st_entry *x = NULL, *ids = NULL, *w = NULL, *pad = NULL;
        for (int i = 0; i < ne; i++) {
            const mm_st_entry *e = &entries[i];
            if (!strcmp(e->name, "hidden_states") && e->dtype == MEGAMOE_DTYPE_BF16 && e->ndim == 2) x = e;
            if (!strcmp(e->name, "topk_ids") && e->dtype == MEGAMOE_DTYPE_I32 && e->ndim == 2) ids = e;
            if (!strcmp(e->name, "topk_weights") && e->dtype == MEGAMOE_DTYPE_F32 && e->ndim == 2) w = e;
            if (!strcmp(e->name, "is_padding") && e->ndim == 1 &&
                (e->dtype == MEGAMOE_DTYPE_BOOL || e->dtype == MEGAMOE_DTYPE_U8))
                pad = e;
        }
        int T = (in[0] & 4) ? (int8_t)in[1] : (x && x->shape[0] <= 1000 ? (int)x->shape[0] : 0);
        if (in[0] & 8) pad = NULL;
        const int Tb = T > 0 ? T : 0;
        uint16_t *xb = rows_of(image, data_offset, x, H * 2, Tb), *y = malloc((size_t)(Tb ? Tb : 1) * H * 2);
        int32_t *ib = rows_of(image, data_offset, ids, K * 4, Tb);
        float *wb = rows_of(image, data_offset, w, K * 4, Tb);
        uint8_t *pb = pad ? rows_of(image, data_offset, pad, 1, Tb) : NULL;
        if (xb && y && ib && wb && (!pad || pb)) {
            /* Rank 0 gets in[2] % (T + 1) of the tokens (or T when negative), rank 1 the rest. */
            const int T0 = two ? (T >= 0 ? in[2] % (T + 1) : T) : T, T1 = two ? (T >= 0 ? T - T0 : 0) : 0;
            megamoe_forward_args a[2] = {{T0, xb, ib, wb, pb, y}, {T1, xb, ib, wb, pb, y}};
            if (T0 > 0) {
                a[1].x = xb + (size_t)T0 * H, a[1].topk_ids = ib + (size_t)T0 * K;
                a[1].topk_weights = wb + (size_t)T0 * K, a[1].y = y + (size_t)T0 * H;
                a[1].is_padding = pb ? pb + T0 : NULL;
            }
            megamoe_layer_forward(l, a, NULL);
        }
        free(xb), free(y), free(ib), free(wb), free(pb);
    }
    mm_st_entries_free(entries, ne);
    free(image);
    return 0;
}
