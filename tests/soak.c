/*
 * soak.c -- many random forwards of the CUDA backend, each against the CPU backend (issue 25 item 3).
 *
 * Every input is drawn afresh: a layer shape, format and activation mode, T from 0 to T_max (0 and 1 often),
 * routing uniform, Zipf-skewed or onto one hot expert, -1 slots, whole tokens without an expert, padding,
 * rows holding NaN or +-Inf, x scaled over many decades. The CPU backend (one rank) computes the
 * reference once per input, on one thread (tiny inputs lose more to OpenMP's fork and join than they
 * gain); the CUDA backend runs the same input on R = 1..8 ranks of one GPU (every R that divides the
 * layer's E), each R > 1 with the even token split and --splits - 1 random uneven ones. Each device y
 * must keep test_gpu's rules against the CPU (tu_compare_y, relative L2 within tu_device_tol) and be
 * bitwise equal to the first y of that input.
 *
 *   megamoe_soak [--forwards N] [--seed S] [--seconds LIMIT] [--only I] [--cpu]
 *     --forwards N    forwards under test to run (default 100000); each input runs once on the CPU and
 *                     then once per R that divides its E and split (about 14 on average), each compared
 *     --splits N      token splits per R > 1: the even one and N - 1 random ones (default 4)
 *     --threads N     the CPU backend's threads (the reference, and the ranks under --cpu); default 1
 *     --seed S        the data seed (default 1); input i is drawn from (S, i) alone
 *     --seconds L     stop after L seconds (default: no limit); the count reached is printed
 *     --only I        run input I only (to reproduce a failure the soak printed)
 *     --cpu           R = 1..8 ranks of the CPU backend instead of the GPU (bitwise equal to R = 1):
 *                     the harness itself, on a machine without a GPU
 * Exits 0 when every comparison held, 1 on any failure, 77 (skipped) without a usable GPU (unless --cpu).
 * Uses the public header only.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "megamoe.h"
#include "test_util.h"

#ifdef MEGAMOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define MAX_R 8

/* Small layers, so the CPU reference stays cheap; their E cover R = 1..8 between them. */
typedef struct soak_shape {
    int E, K, H, I, T_max;
    int weight; /* how often it is drawn, relative */
} soak_shape;
static const soak_shape k_shapes[] = {
    {8, 2, 256, 256, 64, 4},   /* R = 1, 2, 4, 8 */
    {24, 4, 256, 512, 32, 3},  /* R = 1, 2, 3, 4, 6, 8 */
    {70, 8, 256, 256, 24, 3},  /* R = 1, 2, 5, 7 */
    {16, 1, 512, 256, 128, 2}, /* K = 1, H = 512 */
    {64, 6, 256, 256, 48, 2},  /* many experts, most empty */
    {32, 8, 256, 256, 160, 1}, /* up to 1280 slots: the chunked routing */
};
#define NUM_SHAPES (int)(sizeof k_shapes / sizeof k_shapes[0])

/* The weight formats and activation modes (SPEC §3, §3b) every shape runs in. A mode the backend
 * under test refuses (UNSUPPORTED at layer creation) is skipped, and the soak says so. */
typedef struct soak_variant {
    megamoe_weight_format format;
    megamoe_activations activations;
    const char *name;
} soak_variant;
static const soak_variant k_variants[] = {
    {MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_NVFP4, "nvfp4"},
    {MEGAMOE_FORMAT_NVFP4, MEGAMOE_ACTIVATIONS_BF16, "nvfp4-w4a16"},
    {MEGAMOE_FORMAT_BF16, MEGAMOE_ACTIVATIONS_BF16, "bf16"},
};
#define NUM_VARIANTS (int)(sizeof k_variants / sizeof k_variants[0])

static megamoe_layer_config make_config(const soak_shape *s, const soak_variant *v) {
    megamoe_layer_config c;
    megamoe_layer_config_init(&c);
    c.name = "soak";
    c.format = v->format;
    c.activations = v->activations;
    c.num_experts = s->E, c.top_k = s->K, c.hidden_size = s->H, c.intermediate_size = s->I;
    c.max_tokens = s->T_max;
    return c;
}

/* One (shape, variant): its model, the CPU reference layer and the layer on each R-rank group. */
typedef struct soak_layer {
    int made; /* model drawn, layers created (on the first input of this shape and variant) */
    tu_model model;
    megamoe_layer *ref;
    megamoe_layer *ranks[MAX_R + 1]; /* [R], NULL where E % R != 0 */
} soak_layer;

typedef struct soak {
    int cpu_only;
    int threads;              /* the CPU reference's worker threads (0: one per core) */
    int splits;               /* token splits over the ranks run per R > 1: the even one, then random ones */
    megamoe_group *ref_group; /* CPU, one rank */
    megamoe_group *groups[MAX_R + 1];         /* [R]: the backend under test, R ranks */
    int variants[NUM_VARIANTS], num_variants; /* those the backend under test runs */
    soak_layer layers[NUM_SHAPES][NUM_VARIANTS];
    /* Device copies of one input (the largest shape's size); host pointers with --cpu. */
    uint16_t *x, *y;
    int32_t *ids;
    float *weights;
    uint8_t *padding;
    uint16_t *y_host, *y_first, *y_ref;
    /* Results. */
    long inputs, forwards, failures;
    long per_r[MAX_R + 1], per_variant[NUM_VARIANTS], tokens0, tokens1, skewed, nonfinite, minus1, padded;
    double worst[NUM_VARIANTS];       /* largest relative L2 against the CPU, per variant */
    double ref_seconds, test_seconds; /* wall time in the CPU reference and in the forwards under test */
    char worst_what[NUM_VARIANTS][200];
} soak;

/* The largest worst-error-to-bound ratio over the variants, and its variant. */
static double worst_ratio(const soak *S, int *variant) {
    double r = 0;
    for (int v = 0; v < NUM_VARIANTS; v++) {
        const double q = S->worst[v] / tu_device_tol(&S->layers[0][v].model.cfg);
        if (S->worst_what[v][0] && q >= r) {
            r = q;
            if (variant) *variant = v;
        }
    }
    return r;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int fail_setup(const char *what, const char *msg) {
    fprintf(stderr, "soak: %s: %s\n", what, msg);
    return 1;
}

/* The layers of a (shape, variant), made on its first input (a short run makes only what it uses). */
static int make_layers(soak *S, int s, int v, uint64_t seed) {
    soak_layer *L = &S->layers[s][v];
    if (L->made) return 0;
    L->made = 1;
    const soak_shape *sh = &k_shapes[s];
    const megamoe_layer_config c = make_config(sh, &k_variants[v]);
    tu_model_random(&L->model, &c, 1, seed * 1000 + (uint64_t)(s * NUM_VARIANTS + v));
    char what[96];
    snprintf(what, sizeof what, "%s layer E=%d K=%d H=%d I=%d", k_variants[v].name, sh->E, sh->K, sh->H,
             sh->I);
    if (tu_layer_create(&L->model, S->ref_group, &L->ref))
        return fail_setup(what, megamoe_layer_last_error(L->ref));
    for (int R = 1; R <= MAX_R; R++) {
        if (sh->E % R) continue;
        const megamoe_status st = tu_layer_create(&L->model, S->groups[R], &L->ranks[R]);
        if (st == MEGAMOE_ERR_UNSUPPORTED && R == 1) {
            printf("soak: SKIPPED %s: %s\n", k_variants[v].name, megamoe_layer_last_error(L->ranks[R]));
            return 2;
        }
        if (st) return fail_setup(what, megamoe_layer_last_error(L->ranks[R]));
    }
    return 0;
}

/* The groups, the input buffers, and the variants the backend under test runs (made on shape 0). */
static int setup(soak *S, uint64_t seed) {
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_threads = S->threads;
    if (megamoe_group_create(&gc, &S->ref_group))
        return fail_setup("CPU group", megamoe_group_last_error(S->ref_group));
    for (int R = 1; R <= MAX_R; R++) {
        gc.backend = S->cpu_only ? MEGAMOE_BACKEND_CPU : MEGAMOE_BACKEND_CUDA;
        gc.num_ranks = R;
        if (megamoe_group_create(&gc, &S->groups[R]))
            return fail_setup("group under test", megamoe_group_last_error(S->groups[R]));
    }
    for (int v = 0; v < NUM_VARIANTS; v++) {
        const int st = make_layers(S, 0, v, seed);
        if (st == 1) return 1;
        if (st == 0) S->variants[S->num_variants++] = v;
    }
    if (S->num_variants == 0) return fail_setup("setup", "the backend under test runs none of the formats");
    size_t max_x = 0, max_ids = 0, max_t = 0;
    for (int s = 0; s < NUM_SHAPES; s++) {
        const soak_shape *sh = &k_shapes[s];
        const size_t T = (size_t)sh->T_max;
        if (T * sh->H > max_x) max_x = T * sh->H;
        if (T * sh->K > max_ids) max_ids = T * sh->K;
        if (T > max_t) max_t = T;
    }
    S->y_host = malloc(max_x * 2);
    S->y_first = malloc(max_x * 2);
    S->y_ref = malloc(max_x * 2);
    if (!S->y_host || !S->y_first || !S->y_ref) return fail_setup("setup", "out of host memory");
    if (S->cpu_only) {
        S->x = malloc(max_x * 2), S->y = malloc(max_x * 2);
        S->ids = malloc(max_ids * 4), S->weights = malloc(max_ids * 4), S->padding = malloc(max_t);
        if (!S->x || !S->y || !S->ids || !S->weights || !S->padding)
            return fail_setup("setup", "out of host memory");
        return 0;
    }
#ifdef MEGAMOE_HAVE_CUDA
    if (cudaMalloc((void **)&S->x, max_x * 2) || cudaMalloc((void **)&S->y, max_x * 2) ||
        cudaMalloc((void **)&S->ids, max_ids * 4) || cudaMalloc((void **)&S->weights, max_ids * 4) ||
        cudaMalloc((void **)&S->padding, max_t))
        return fail_setup("cudaMalloc", cudaGetErrorString(cudaGetLastError()));
#endif
    return 0;
}

static void teardown(soak *S) {
    for (int s = 0; s < NUM_SHAPES; s++)
        for (int v = 0; v < NUM_VARIANTS; v++) {
            soak_layer *L = &S->layers[s][v];
            megamoe_layer_destroy(L->ref);
            for (int R = 1; R <= MAX_R; R++)
                megamoe_layer_destroy(L->ranks[R]);
            if (L->made) tu_model_free(&L->model);
        }
    for (int R = 1; R <= MAX_R; R++)
        megamoe_group_destroy(S->groups[R]);
    megamoe_group_destroy(S->ref_group);
    if (S->cpu_only) {
        free(S->x), free(S->y), free(S->ids), free(S->weights), free(S->padding);
    } else {
#ifdef MEGAMOE_HAVE_CUDA
        cudaFree(S->x), cudaFree(S->y), cudaFree(S->ids), cudaFree(S->weights), cudaFree(S->padding);
#endif
    }
    free(S->y_host), free(S->y_first), free(S->y_ref);
}

/* ---- Drawing an input ---------------------------------------------------------------------------- */

typedef struct draw {
    int shape, variant, T;
    const char *routing;
    double p_minus1, p_padding;
    int nonfinite_rows;
} draw;

static int pick_shape(tu_rng *r) {
    int total = 0;
    for (int s = 0; s < NUM_SHAPES; s++)
        total += k_shapes[s].weight;
    int u = (int)(tu_next(r) % (uint64_t)total);
    for (int s = 0; s < NUM_SHAPES; s++)
        if ((u -= k_shapes[s].weight) < 0) return s;
    return 0;
}

/* T: 0 and 1 a tenth of the time each, mostly a handful of tokens (decode), now and then up to T_max. */
static int pick_tokens(tu_rng *r, int T_max) {
    const double u = tu_uniform(r);
    if (u < 0.1) return 0;
    if (u < 0.2) return 1;
    if (u < 0.7) return 2 + (int)(tu_next(r) % 7); /* 2..8: every shape's T_max is above */
    if (u < 0.95) return 1 + (int)(tu_next(r) % (uint64_t)(T_max / 2 > 1 ? T_max / 2 : 1));
    return 1 + (int)(tu_next(r) % (uint64_t)T_max);
}

/* Expert ids by Zipf (s = 1.1) over a random permutation of the experts: a few take most slots. */
static int zipf_expert(tu_rng *r, const int *perm, const double *cdf, int E) {
    const double u = tu_uniform(r);
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (cdf[mid] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return perm[lo];
}

/* The input of index i of the soak of this seed: a function of (seed, i) alone. */
static void draw_input(const soak *S, uint64_t seed, long i, draw *d, tu_inputs *in) {
    tu_rng r = {seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)i * 0xD1B54A32D192ED03ull)};
    d->shape = pick_shape(&r);
    d->variant = S->variants[tu_next(&r) % (uint64_t)S->num_variants];
    const soak_shape *s = &k_shapes[d->shape];
    const int E = s->E, K = s->K, H = s->H;
    d->T = pick_tokens(&r, s->T_max);
    const int T = d->T;
    tu_inputs_random(in, T, K, H, E, tu_next(&r));
    /* Routing: uniform (as drawn), Zipf-skewed, or the first slot of every token on one hot expert. */
    const double u = tu_uniform(&r);
    d->routing = u < 0.4 ? "uniform" : u < 0.8 ? "zipf" : "hot";
    if (u >= 0.4) {
        int perm[128];
        double cdf[128], sum = 0, acc = 0;
        for (int e = 0; e < E; e++)
            perm[e] = e;
        for (int e = E - 1; e > 0; e--) {
            const int j = (int)(tu_next(&r) % (uint64_t)(e + 1)), t = perm[e];
            perm[e] = perm[j], perm[j] = t;
        }
        for (int e = 0; e < E; e++)
            sum += 1.0 / pow(e + 1, 1.1);
        for (int e = 0; e < E; e++)
            cdf[e] = acc += 1.0 / pow(e + 1, 1.1) / sum;
        const int hot = perm[0];
        for (int t = 0; t < T; t++)
            for (int k = 0; k < K; k++)
                in->ids[t * K + k] = d->routing[0] == 'h' && k == 0 ? hot : zipf_expert(&r, perm, cdf, E);
    }
    /* -1 slots (now and then whole tokens without an expert) and padding, at a rate per input. */
    static const double rates[] = {0.0, 0.0, 0.05, 0.3};
    d->p_minus1 = rates[tu_next(&r) % 4];
    d->p_padding = rates[tu_next(&r) % 4];
    for (int t = 0; t < T; t++) {
        const int none = d->p_minus1 > 0 && tu_uniform(&r) < d->p_minus1 / 4;
        for (int k = 0; k < K; k++)
            if (none || tu_uniform(&r) < d->p_minus1) in->ids[t * K + k] = -1;
        in->padding[t] = tu_uniform(&r) < d->p_padding;
    }
    /* x scaled by 2^-30..2^30 per input (NVFP4's per-token scale s over many decades), and on a fifth
     * of the inputs each token by a further 2^-3..2^3. The bound is on the relative L2 of the whole
     * y, so the tokens of one input stay within a few binades of each other: each one counts. */
    const int input_exp = (int)(tu_next(&r) % 61) - 30, per_token = tu_uniform(&r) < 0.2;
    for (int t = 0; t < T; t++) {
        const float scale = ldexpf(1.0f, input_exp + (per_token ? (int)(tu_next(&r) % 7) - 3 : 0));
        for (int h = 0; h < H; h++)
            in->x[(size_t)t * H + h] = tu_bf16(tu_f32(in->x[(size_t)t * H + h]) * scale);
    }
    /* A fifth of the inputs with one or two rows holding a NaN or an infinity. */
    d->nonfinite_rows = 0;
    if (T > 0 && tu_uniform(&r) < 0.2) {
        static const uint16_t bad[] = {0x7FC0, 0x7F80, 0xFF80}; /* NaN, +Inf, -Inf */
        d->nonfinite_rows = 1 + (int)(tu_next(&r) % 2);
        for (int n = 0; n < d->nonfinite_rows; n++) {
            const int t = (int)(tu_next(&r) % (uint64_t)T);
            in->x[(size_t)t * H + tu_next(&r) % (uint64_t)H] = bad[tu_next(&r) % 3];
        }
    }
}

/* ---- Running one input --------------------------------------------------------------------------- */

static int copy_in(soak *S, const tu_inputs *in) {
    const size_t T = (size_t)in->T, H = (size_t)in->H, K = (size_t)in->K;
    if (S->cpu_only) {
        memcpy(S->x, in->x, T * H * 2), memcpy(S->ids, in->ids, T * K * 4);
        memcpy(S->weights, in->weights, T * K * 4), memcpy(S->padding, in->padding, T);
        return 0;
    }
#ifdef MEGAMOE_HAVE_CUDA
    if (cudaMemcpy(S->x, in->x, T * H * 2, cudaMemcpyHostToDevice) ||
        cudaMemcpy(S->ids, in->ids, T * K * 4, cudaMemcpyHostToDevice) ||
        cudaMemcpy(S->weights, in->weights, T * K * 4, cudaMemcpyHostToDevice) ||
        cudaMemcpy(S->padding, in->padding, T, cudaMemcpyHostToDevice))
        return 1;
#endif
    return 0;
}

/* Forward on the layer under test; y into S->y_host. A status, or -1 for a CUDA copy failure. */
static int run_under_test(soak *S, megamoe_layer *l, int R, const int *cuts, const tu_inputs *in, char *why,
                          size_t n) {
    const size_t bytes = (size_t)in->T * in->H * 2;
    megamoe_forward_args args[MAX_R];
    tu_split_args(in, R, S->x, S->ids, S->weights, S->padding, S->y, args);
    if (cuts) { /* an uneven split: rank r takes tokens [cuts[r], cuts[r + 1]) */
        for (int r = 0; r < R; r++) {
            const int t0 = cuts[r];
            args[r] = (megamoe_forward_args){cuts[r + 1] - t0,
                                             S->x + (size_t)t0 * in->H,
                                             S->ids + (size_t)t0 * in->K,
                                             S->weights + (size_t)t0 * in->K,
                                             S->padding + t0,
                                             S->y + (size_t)t0 * in->H};
        }
    }
    if (S->cpu_only) {
        memset(S->y, 0xFF, bytes);
    } else {
#ifdef MEGAMOE_HAVE_CUDA
        if (cudaMemset(S->y, 0xFF, bytes)) return snprintf(why, n, "cudaMemset failed"), -1;
#endif
    }
    megamoe_status st = megamoe_layer_forward(l, args, NULL);
    if (st == MEGAMOE_OK) st = megamoe_layer_check(l);
    if (st) return snprintf(why, n, "%s", megamoe_layer_last_error(l)), (int)st;
    if (S->cpu_only) {
        memcpy(S->y_host, S->y, bytes);
    } else {
#ifdef MEGAMOE_HAVE_CUDA
        cudaError_t e = cudaMemcpy(S->y_host, S->y, bytes, cudaMemcpyDeviceToHost);
        if (e) return snprintf(why, n, "cudaMemcpy(y): %s", cudaGetErrorString(e)), -1;
#endif
    }
    return 0;
}

static void describe(const draw *d, int R, char *buf, size_t n) {
    const soak_shape *s = &k_shapes[d->shape];
    snprintf(buf, n,
             "%s E=%d K=%d H=%d I=%d T=%d R=%d routing %s, -1 rate %.2f, padding %.2f, %d non-finite rows",
             k_variants[d->variant].name, s->E, s->K, s->H, s->I, d->T, R, d->routing, d->p_minus1,
             d->p_padding, d->nonfinite_rows);
}

/* Runs input i; returns the failures it found (0 when every comparison held), -1 when its layers could
 * not be made. */
static int run_input(soak *S, uint64_t seed, long i) {
    draw d;
    tu_inputs in;
    draw_input(S, seed, i, &d, &in);
    soak_layer *L = &S->layers[d.shape][d.variant];
    if (make_layers(S, d.shape, d.variant, seed)) {
        tu_inputs_free(&in);
        return -1;
    }
    int failures = 0;
    char what[256], why[1200];
    double t = now();
    megamoe_status st = tu_forward(S->ref_group, L->ref, &in, S->y_ref);
    S->ref_seconds += now() - t;
    t = now();
    if (st) {
        describe(&d, 1, what, sizeof what);
        fprintf(stderr, "FAIL input %ld (%s): the CPU reference: %s\n", i, what,
                megamoe_layer_last_error(L->ref));
        tu_inputs_free(&in);
        return 1;
    }
    if (copy_in(S, &in)) {
        fprintf(stderr, "FAIL input %ld: copying the input to the device failed\n", i);
        tu_inputs_free(&in);
        return 1;
    }
    S->per_variant[d.variant]++;
    S->tokens0 += d.T == 0, S->tokens1 += d.T == 1, S->skewed += d.routing[0] != 'u';
    S->nonfinite += d.nonfinite_rows > 0, S->minus1 += d.p_minus1 > 0, S->padded += d.p_padding > 0;
    int first_R = 0;
    const size_t bytes = (size_t)in.T * in.H * 2;
    for (int R = 1; R <= MAX_R; R++)
        for (int split = 0; split < (R > 1 && in.T > 0 ? S->splits : 1); split++) {
            if (!L->ranks[R]) continue;
            /* Split 0 is the even one; the others cut the T tokens at R - 1 random points (ranks with
             * no tokens included), drawn from (seed, i, R, split) alone. */
            int cuts[MAX_R + 1];
            describe(&d, R, what, sizeof what);
            if (split > 0) {
                tu_rng r = {(seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)i * 0xD1B54A32D192ED03ull)) +
                            (uint64_t)(R * 64 + split) * 0xBF58476D1CE4E5B9ull};
                cuts[0] = 0, cuts[R] = in.T;
                for (int c = 1; c < R; c++) { /* insertion sort of the random cut points */
                    int v = (int)(tu_next(&r) % (uint64_t)(in.T + 1)), j = c;
                    for (; j > 1 && cuts[j - 1] > v; j--)
                        cuts[j] = cuts[j - 1];
                    cuts[j] = v;
                }
                size_t len = strlen(what);
                len += (size_t)snprintf(what + len, sizeof what - len, ", split");
                for (int c = 0; c < R && len < sizeof what; c++)
                    len += (size_t)snprintf(what + len, sizeof what - len, " %d", cuts[c + 1] - cuts[c]);
            }
            S->forwards++;
            S->per_r[R]++;
            if (run_under_test(S, L->ranks[R], R, split > 0 ? cuts : NULL, &in, why, sizeof why)) {
                fprintf(stderr, "FAIL input %ld (%s): %s\n", i, what, why);
                failures++;
                continue;
            }
            const double rel = tu_compare_y(&in, S->y_host, S->y_ref, why, sizeof why);
            const double tol = tu_device_tol(&L->model.cfg);
            if (rel < 0 || !(rel <= tol)) {
                if (rel >= 0 || rel != rel) snprintf(why, sizeof why, "relative L2 %.3e over %.0e", rel, tol);
                fprintf(stderr, "FAIL input %ld (%s): against the CPU: %s\n", i, what, why);
                failures++;
                continue;
            }
            if (rel > S->worst[d.variant] || !S->worst_what[d.variant][0]) {
                S->worst[d.variant] = rel;
                snprintf(S->worst_what[d.variant], sizeof S->worst_what[d.variant], "input %ld: %s", i, what);
            }
            if (!first_R) {
                first_R = R;
                memcpy(S->y_first, S->y_host, bytes);
            } else if (memcmp(S->y_first, S->y_host, bytes) != 0) {
                size_t e = 0;
                while (e < bytes / 2 && S->y_first[e] == S->y_host[e])
                    e++;
                fprintf(
                    stderr,
                    "FAIL input %ld (%s): y differs from R=%d's at token %zu element %zu (%04x vs %04x)\n", i,
                    what, first_R, e / (size_t)in.H, e % (size_t)in.H, S->y_host[e], S->y_first[e]);
                failures++;
            }
        }
    S->test_seconds += now() - t;
    tu_inputs_free(&in);
    return failures;
}

static long parse_long(const char *flag, const char *v) {
    char *end = NULL;
    const long n = v ? strtol(v, &end, 10) : -1;
    if (!v || *end || n < 0) {
        fprintf(stderr, "soak: %s needs a non-negative integer, got '%s'\n", flag, v ? v : "");
        exit(2);
    }
    return n;
}

int main(int argc, char **argv) {
    long forwards = 100000, only = -1;
    double seconds = 0;
    uint64_t seed = 1;
    soak *S = calloc(1, sizeof *S);
    if (!S) return 1;
    S->splits = 4;
    S->threads = 1;
    for (int a = 1; a < argc; a++) {
        const char *v = a + 1 < argc ? argv[a + 1] : NULL;
        if (strcmp(argv[a], "--forwards") == 0)
            forwards = parse_long(argv[a], v), a++;
        else if (strcmp(argv[a], "--seed") == 0)
            seed = (uint64_t)parse_long(argv[a], v), a++;
        else if (strcmp(argv[a], "--seconds") == 0)
            seconds = (double)parse_long(argv[a], v), a++;
        else if (strcmp(argv[a], "--only") == 0)
            only = parse_long(argv[a], v), a++;
        else if (strcmp(argv[a], "--splits") == 0)
            S->splits = (int)parse_long(argv[a], v), a++;
        else if (strcmp(argv[a], "--threads") == 0)
            S->threads = (int)parse_long(argv[a], v), a++;
        else if (strcmp(argv[a], "--cpu") == 0)
            S->cpu_only = 1;
        else {
            fprintf(stderr,
                    "usage: megamoe_soak [--forwards N] [--seed S] [--seconds LIMIT] [--only I] [--splits N] "
                    "[--threads N] [--cpu]\n");
            return 2;
        }
    }
    if (S->splits < 1) {
        fprintf(stderr, "soak: --splits needs at least 1 (the even split)\n");
        return 2;
    }
    if (!S->cpu_only && !megamoe_backend_available(MEGAMOE_BACKEND_CUDA)) {
        printf("SKIPPED: no usable sm_90 GPU here, or this build has no CUDA backend (--cpu runs the CPU "
               "backend's ranks instead)\n");
        free(S);
        return 77;
    }
    printf("soak: %s, R = 1..%d ranks against the CPU backend, %d shapes x %d format/activation modes, seed "
           "%llu, %ld "
           "forwards%s\n",
           S->cpu_only ? "the CPU backend" : "the CUDA backend on one GPU", MAX_R, NUM_SHAPES, NUM_VARIANTS,
           (unsigned long long)seed, forwards, seconds > 0 ? " or the time limit" : "");
    if (only >= 0) printf("soak: input %ld only\n", only);
    fflush(stdout);
    if (setup(S, seed)) {
        teardown(S);
        free(S);
        return 1;
    }
    const double t0 = now();
    double last = t0;
    for (long i = only >= 0 ? only : 0; only >= 0 ? i == only : S->forwards < forwards; i++) {
        const int f = run_input(S, seed, i);
        if (f < 0) {
            S->failures++;
            break;
        }
        S->inputs++;
        S->failures += f;
        if (S->failures >= 20) {
            fprintf(stderr, "soak: stopping after %ld failures\n", S->failures);
            break;
        }
        const double t = now();
        if (t - last >= 10) {
            printf(
                "soak: %ld inputs, %ld forwards under test, %ld failures, worst of its bound %.2f, %.0f s\n",
                S->inputs, S->forwards, S->failures, worst_ratio(S, NULL), t - t0);
            fflush(stdout);
            last = t;
        }
        if (seconds > 0 && t - t0 >= seconds) {
            printf("soak: time limit of %.0f s reached\n", seconds);
            break;
        }
    }
    int wv = 0;
    const double ratio = worst_ratio(S, &wv);
    printf(
        "soak: %s -- %ld inputs, %ld forwards under test compared with the CPU (the bound of test_gpu) and "
        "across "
        "R (bitwise), %ld failures; worst %.2f of the bound (%s rel L2 %.3e); %.0f s (CPU reference %.0f s, "
        "%.2f ms per input; under test %.0f s)\n",
        S->failures ? "FAILED" : "passed", S->inputs, S->forwards, S->failures, ratio, k_variants[wv].name,
        S->worst[wv], now() - t0, S->ref_seconds, S->inputs ? 1e3 * S->ref_seconds / (double)S->inputs : 0.0,
        S->test_seconds);
    for (int v = 0; v < NUM_VARIANTS; v++)
        if (S->worst_what[v][0])
            printf("soak: worst rel L2 %-12s %.3e, bound %.0e (%s)\n", k_variants[v].name, S->worst[v],
                   tu_device_tol(&S->layers[0][v].model.cfg), S->worst_what[v]);
    printf("soak: inputs with T = 0: %ld, T = 1: %ld, skewed routing: %ld, -1 slots: %ld, padding: %ld, "
           "non-finite rows: %ld; by format:",
           S->tokens0, S->tokens1, S->skewed, S->minus1, S->padded, S->nonfinite);
    for (int v = 0; v < NUM_VARIANTS; v++)
        printf(" %s %ld", k_variants[v].name, S->per_variant[v]);
    printf("; forwards by R:");
    for (int R = 1; R <= MAX_R; R++)
        printf(" %ld", S->per_r[R]);
    printf("\n");
    const int rc = S->failures ? 1 : 0;
    teardown(S);
    free(S);
    return rc;
}
