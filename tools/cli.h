/*
 * cli.h -- helpers shared by the megamoe command's subcommands. The CLI is a client of
 * include/megamoe.h only.
 */
#ifndef MEGAMOE_CLI_H
#define MEGAMOE_CLI_H

#include <stdint.h>
#include <stdio.h>

#include "megamoe.h"

/* Subcommands: each returns the process exit code (0 ok, 1 failure, 2 usage). */
int cmd_demo(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_quantize(int argc, char **argv);

/* Prints "megamoe: <fmt>" to stderr; returns 1. */
int cli_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A bad option value, named: "megamoe: CMD: --OPTION VALUE: expected WANT (see megamoe CMD --help)",
 * the option found in opts by its getopt value c. Returns 1. */
struct option;
int cli_bad_value(const char *cmd, const struct option *opts, int c, const char *value, const char *want);

/* Arguments past the ones a command takes: "megamoe: CMD: unexpected argument 'ARG'" and the usage on
 * stderr. Returns 2 (the usage exit code). */
int cli_unexpected(const char *cmd, const char *arg, const char *usage);

/* Progress line on stderr (rewritten in place on a terminal, a line per ~10% elsewhere). */
void cli_progress(void *user, const char *what, uint64_t done, uint64_t total);

/* Strict number parsing for options: 1 on success. */
int cli_parse_int(const char *s, int *out);
int cli_parse_float(const char *s, float *out);
int cli_parse_u64(const char *s, uint64_t *out);
/* Checks --threads (0 = one per core, else 1..MEGAMOE_MAX_THREADS) and --ranks (1..72, SPEC §1) for
 * command cmd; 0 when in range, else prints the rule and returns 1. */
int cli_check_threads(const char *cmd, int threads);
int cli_check_ranks(const char *cmd, int ranks);

/* 1 when both paths name one existing file (same device and inode: links and other spellings count). */
int cli_same_file(const char *a, const char *b);

/* Routing of T tokens checked on the host: every expert id in [-1, E) and, where check_weights, the
 * weights of the slots that count finite (device backends read them on the device, where the library
 * does not check them). Names the first bad token and slot; returns 1 when bad. */
int cli_check_routing(const char *path, int T, int K, int E, const int32_t *ids, const float *w,
                      const uint8_t *pad, int check_weights);

/* Warns (stderr) about rows of y that are not finite although the token's hidden state is finite and it
 * is not padding: an overflow inside the layer (huge routing weights or scales), not the NaN row of a
 * non-finite input. Returns the number of such rows. */
int cli_warn_nonfinite_y(int T, int H, const uint16_t *x, const uint8_t *pad, const uint16_t *y);

/* "cpu" or "cuda" (and "auto" = cuda when a usable GPU is there, else cpu, where allow_auto). */
int cli_parse_backend(const char *s, int allow_auto, megamoe_backend *out);

/* "bf16" or "nvfp4" (SPEC §3b) into *out (a megamoe_activations); 1 on success. */
int cli_parse_activations(const char *s, int *out);

/* Seeded random numbers (splitmix64 + Box-Muller). */
typedef struct cli_rng {
    uint64_t state;
} cli_rng;
uint64_t cli_rng_next(cli_rng *r);
double cli_rng_uniform(cli_rng *r); /* [0, 1) */
double cli_rng_normal(cli_rng *r);

uint16_t cli_f32_to_bf16(float f);
float cli_bf16_to_f32(uint16_t h);

double cli_now_seconds(void);

/* Random routing: for each token K distinct experts out of E and softmax-like positive weights. */
void cli_random_routing(cli_rng *r, int T, int K, int E, int32_t *ids, float *weights);

/* Relative L2 distance of two bf16 vectors (NaN-aware: a NaN anywhere gives NaN). */
double cli_rel_l2_bf16(const uint16_t *a, const uint16_t *ref, size_t n);

/* A group of R ranks on the backend, one layer on it: set up from a config. */
typedef struct cli_layer {
    megamoe_group *group;
    megamoe_layer *layer;
} cli_layer;

int cli_layer_create(megamoe_backend backend, int ranks, int threads, const megamoe_layer_config *cfg,
                     cli_layer *out);
void cli_layer_destroy(cli_layer *c);

/* Splits T tokens over R ranks in contiguous chunks of ceil(T/R) and runs one forward (on `stream`,
 * a cudaStream_t, for a device backend; NULL is the default stream). */
megamoe_status cli_forward_split(cli_layer *c, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                                 const float *weights, const uint8_t *padding, uint16_t *y);
megamoe_status cli_forward_split_on(cli_layer *c, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                                    const float *weights, const uint8_t *padding, uint16_t *y, void *stream);

/* The same on a device backend: host inputs are uploaded, y is downloaded. With iters > 0 the
 * forward is captured in a CUDA graph and replayed iters times after a warm-up, the L2 cache flushed
 * before each replay, and *ms gets the median replay time (CUDA events). */
megamoe_status cli_forward_split_device(cli_layer *c, int T, int K, int H, const uint16_t *x, const int32_t *ids,
                                        const float *weights, const uint8_t *padding, uint16_t *y, int iters,
                                        double *ms);

/* The same with the minimum, median and maximum replay time (any pointer may be NULL). */
megamoe_status cli_forward_split_device_stats(cli_layer *c, int T, int K, int H, const uint16_t *x,
                                              const int32_t *ids, const float *weights, const uint8_t *padding,
                                              uint16_t *y, int iters, double *min_ms, double *ms,
                                              double *max_ms);

/* The name of CUDA device 0, or "" when there is none. */
void cli_device_name(char *out, size_t n);

/* `bench --json`: appends one JSON object (one line) with the keys shape, format, activations, T,
 * median_ms, min_ms, max_ms, tflops, weight_gbps, pct_copy (null when < 0), commit (the git describe of
 * the build), gpu, date (UTC, ISO 8601) and source ("megamoe": bench/records.py's schema); activations
 * NULL is written as null. Returns 1 when the write fails. */
int cli_bench_json_record(FILE *f, const char *shape, const char *format, const char *activations, int T,
                          double median_ms, double min_ms, double max_ms, double tflops, double weight_gbps,
                          double pct_copy, const char *gpu);

/* The layer's activations in words ("nvfp4", "bf16"), NULL for a BF16 layer (no such setting). */
const char *cli_activations_name(const megamoe_layer_config *cfg);

/* The device's copy bandwidth in GB/s (read + written bytes of a 512 MB device-to-device copy, best
 * of 5), the ceiling `bench` reports its weight stream against; 0 when it cannot be measured. */
double cli_device_copy_gbps(void);

/* `run --gpus N`: the layer on N GPUs of this machine, one NCCL rank each; returns the exit code. */
int cli_run_gpus(int gpus, const megamoe_layer_config *cfg, megamoe_checkpoint *ck, const char *prefix, int T, int K,
                 int H, const uint16_t *x, const int32_t *ids, const float *w, const uint8_t *pad, uint16_t *y);

/* `bench --gpus N`: a layer of random weights (`load` fills and finalizes it) on N GPUs, one NCCL
 * rank each, timed at each T per rank; prints a line per T; returns the exit code. */
typedef int (*cli_bench_loader)(megamoe_layer *layer, const megamoe_layer_config *cfg, uint64_t seed);
int cli_bench_gpus(int gpus, const megamoe_layer_config *cfg, cli_bench_loader load, uint64_t seed, const int *Ts,
                   int nT, int iters);

#endif /* MEGAMOE_CLI_H */
