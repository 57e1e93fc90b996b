/*
 * cli_util.c -- option parsing, progress lines, random data and the shared layer setup of the CLI.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

int cli_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("megamoe: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

int cli_bad_value(const char *cmd, const struct option *opts, int c, const char *value, const char *want) {
    const char *name = "?";
    for (const struct option *o = opts; o->name; o++)
        if (o->val == c) {
            name = o->name;
            break;
        }
    return cli_fail("%s: --%s %s: expected %s (see megamoe %s --help)", cmd, name, value[0] ? value : "''", want,
                    cmd);
}

int cli_unexpected(const char *cmd, const char *arg, const char *usage) {
    cli_fail("%s: unexpected argument '%s'", cmd, arg);
    fputs(usage, stderr);
    return 2;
}

void cli_progress(void *user, const char *what, uint64_t done, uint64_t total) {
    (void)user;
    static int tty = -1;
    if (tty < 0) tty = isatty(STDERR_FILENO);
    if (tty) {
        fprintf(stderr, "\r%s %llu/%llu", what, (unsigned long long)done, (unsigned long long)total);
        if (done == total) fputc('\n', stderr);
    } else if (total >= 10 ? done % (total / 10) == 0 || done == total : done == total) {
        fprintf(stderr, "%s %llu/%llu\n", what, (unsigned long long)done, (unsigned long long)total);
    }
    fflush(stderr);
}

int cli_parse_int(const char *s, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < -2147483647L || v > 2147483647L) return 0;
    *out = (int)v;
    return 1;
}

int cli_check_threads(const char *cmd, int threads) {
    if (threads >= 0 && threads <= MEGAMOE_MAX_THREADS) return 0;
    return cli_fail("%s: --threads %d must be in 1..%d (leave it out for one thread per core)", cmd, threads,
                    MEGAMOE_MAX_THREADS);
}

int cli_check_ranks(const char *cmd, int ranks) {
    if (ranks >= 1 && ranks <= 72) return 0;
    return cli_fail("%s: --ranks R=%d must be in 1..72", cmd, ranks);
}

int cli_same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

int cli_check_routing(const char *path, int T, int K, int E, const int32_t *ids, const float *w,
                      const uint8_t *pad, int check_weights) {
    for (int t = 0; t < T; t++) {
        if (pad && pad[t]) continue;
        for (int k = 0; k < K; k++) {
            const size_t i = (size_t)t * (size_t)K + (size_t)k;
            if (ids[i] < -1 || ids[i] >= E)
                return cli_fail("%s: token %d slot %d: expert id %d is outside [-1, %d)", path, t, k, ids[i],
                                E);
            if (check_weights && ids[i] != -1 && !isfinite(w[i]))
                return cli_fail("%s: token %d slot %d: topk_weights is %g; routing weights must be finite",
                                path, t, k, (double)w[i]);
        }
    }
    return 0;
}

int cli_warn_nonfinite_y(int T, int H, const uint16_t *x, const uint8_t *pad, const uint16_t *y) {
    int count = 0, first = -1;
    for (int t = 0; t < T; t++) {
        if (pad && pad[t]) continue;
        int x_finite = 1, y_finite = 1;
        for (int h = 0; h < H; h++) {
            x_finite &= (x[(size_t)t * H + h] & 0x7F80u) != 0x7F80u;
            y_finite &= (y[(size_t)t * H + h] & 0x7F80u) != 0x7F80u;
        }
        if (x_finite && !y_finite && count++ == 0) first = t;
    }
    if (count)
        fprintf(
            stderr,
            "megamoe: warning: y of %d token%s (first: token %d) is not finite although the hidden states "
            "are: a value overflowed float inside the layer (routing weights or weight scales too large)\n",
            count, count == 1 ? "" : "s", first);
    return count;
}

int cli_parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end) return 0;
    *out = v;
    return 1;
}

int cli_parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end || s[0] == '-') return 0;
    *out = v;
    return 1;
}

int cli_parse_backend(const char *s, int allow_auto, megamoe_backend *out) {
    if (strcmp(s, "cpu") == 0)
        *out = MEGAMOE_BACKEND_CPU;
    else if (strcmp(s, "cuda") == 0)
        *out = MEGAMOE_BACKEND_CUDA;
    else if (allow_auto && strcmp(s, "auto") == 0)
        *out = megamoe_backend_available(MEGAMOE_BACKEND_CUDA) ? MEGAMOE_BACKEND_CUDA : MEGAMOE_BACKEND_CPU;
    else
        return 0;
    return 1;
}

int cli_parse_activations(const char *s, int *out) {
    if (strcmp(s, "bf16") == 0)
        *out = MEGAMOE_ACTIVATIONS_BF16;
    else if (strcmp(s, "nvfp4") == 0)
        *out = MEGAMOE_ACTIVATIONS_NVFP4;
    else
        return 0;
    return 1;
}

uint64_t cli_rng_next(cli_rng *r) {
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double cli_rng_uniform(cli_rng *r) { return (double)(cli_rng_next(r) >> 11) / 9007199254740992.0; }

double cli_rng_normal(cli_rng *r) {
    const double u1 = 1.0 - cli_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * cli_rng_uniform(r));
}

uint16_t cli_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float cli_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

double cli_now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void cli_random_routing(cli_rng *r, int T, int K, int E, int32_t *ids, float *weights) {
    for (int t = 0; t < T; t++) {
        float sum = 0.0f;
        for (int k = 0; k < K; k++) {
            int id, dup;
            do { /* distinct ids while K <= E */
                id = (int)(cli_rng_next(r) % (uint64_t)E);
                dup = 0;
                for (int j = 0; j < k && K <= E; j++)
                    dup |= ids[(size_t)t * K + j] == id;
            } while (dup);
            ids[(size_t)t * K + k] = id;
            weights[(size_t)t * K + k] = (float)exp(cli_rng_normal(r));
            sum += weights[(size_t)t * K + k];
        }
        for (int k = 0; k < K; k++)
            weights[(size_t)t * K + k] /= sum;
    }
}

double cli_rel_l2_bf16(const uint16_t *a, const uint16_t *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double x = cli_bf16_to_f32(a[i]), y = cli_bf16_to_f32(ref[i]);
        num += (x - y) * (x - y);
        den += y * y;
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

int cli_layer_create(megamoe_backend backend, int ranks, int threads, const megamoe_layer_config *cfg,
                     cli_layer *out) {
    memset(out, 0, sizeof *out);
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.backend = backend;
    gc.num_ranks = ranks;
    gc.num_threads = threads;
    megamoe_status st = megamoe_group_create(&gc, &out->group);
    if (st) return cli_fail("%s: %s", megamoe_status_string(st), megamoe_group_last_error(out->group));
    st = megamoe_layer_create(out->group, cfg, &out->layer);
    if (st) return cli_fail("%s: %s", megamoe_status_string(st), megamoe_layer_last_error(out->layer));
    return 0;
}

void cli_layer_destroy(cli_layer *c) {
    megamoe_layer_destroy(c->layer);
    megamoe_group_destroy(c->group);
    memset(c, 0, sizeof *c);
}

megamoe_status cli_forward_split(cli_layer *c, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                                 const float *weights, const uint8_t *padding, uint16_t *y) {
    return cli_forward_split_on(c, T, K, H, x, ids, weights, padding, y, NULL);
}

megamoe_status cli_forward_split_on(cli_layer *c, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                                    const float *weights, const uint8_t *padding, uint16_t *y, void *stream) {
    const int R = megamoe_group_local_ranks(c->group);
    megamoe_forward_args *args = calloc((size_t)R, sizeof *args);
    if (!args) return MEGAMOE_ERR_OUT_OF_MEMORY;
    const int chunk = (T + R - 1) / R;
    for (int r = 0; r < R; r++) {
        const int t0 = r * chunk < T ? r * chunk : T;
        const int t1 = t0 + chunk < T ? t0 + chunk : T;
        args[r].num_tokens = t1 - t0;
        args[r].x = x + (size_t)t0 * H;
        args[r].topk_ids = ids + (size_t)t0 * K;
        args[r].topk_weights = weights + (size_t)t0 * K;
        args[r].is_padding = padding ? padding + t0 : NULL;
        args[r].y = y + (size_t)t0 * H;
    }
    megamoe_status st = megamoe_layer_forward(c->layer, args, stream);
    free(args);
    return st;
}
