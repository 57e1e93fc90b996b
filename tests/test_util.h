/*
 * test_util.h -- helpers of the C tests: seeded random data, random layers, forwards over R ranks.
 */
#ifndef MEGAMOE_TEST_UTIL_H
#define MEGAMOE_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "megamoe.h"

typedef struct tu_rng {
    uint64_t state;
} tu_rng;
uint64_t tu_next(tu_rng *r);
double tu_uniform(tu_rng *r);
double tu_normal(tu_rng *r);
uint16_t tu_bf16(float f);
float tu_f32(uint16_t h);

/* A random model in the stacked layout of SPEC §3-4, host memory. */
typedef struct tu_model {
    megamoe_layer_config cfg;
    uint8_t *w13, *w13_sf, *w2, *w2_sf; /* NVFP4 */
    float *w13_s2, *w13_in, *w2_s2, *w2_in;
    uint16_t *w13_bf16, *w2_bf16; /* BF16 */
    float *norm;                  /* [H] or NULL */
} tu_model;

void tu_model_random(tu_model *m, const megamoe_layer_config *cfg, int with_norm, uint64_t seed);
void tu_model_free(tu_model *m);
/* Loads every stacked tensor; returns the first failing status. */
megamoe_status tu_model_load(const tu_model *m, megamoe_layer *layer);

/* Creates a CPU group of R ranks and a finalized layer of the model. Asserts on failure. */
void tu_layer_make(const tu_model *m, int R, megamoe_group **g, megamoe_layer **l);

/* Random inputs for T tokens. */
typedef struct tu_inputs {
    int T, K, H;
    uint16_t *x;      /* [T, H] */
    int32_t *ids;     /* [T, K] */
    float *weights;   /* [T, K] */
    uint8_t *padding; /* [T] */
} tu_inputs;

void tu_inputs_random(tu_inputs *in, int T, int K, int H, int E, uint64_t seed);
void tu_inputs_free(tu_inputs *in);
/* Random inputs with the edge cases in tokens 1-7 (T >= 8): -1 slot (1), duplicate ids (2), no valid
 * slot (3), padding with a NaN x (4), +inf (5) and NaN (6) tokens, an all-zero token (7). */
void tu_inputs_edge_cases(tu_inputs *in, int T, const megamoe_layer_config *c, uint64_t seed);

/* Runs the layer with the T tokens split over the group's R ranks in contiguous chunks. y is
 * poisoned (0xFFFF) first. */
megamoe_status tu_forward(megamoe_group *g, megamoe_layer *l, const tu_inputs *in, uint16_t *y);

/* A fresh temporary folder (under MEGAMOE_TEST_TMP or /tmp); the caller frees the string. */
char *tu_tmpdir(void);
/* Writes bytes to dir/name; returns the malloc'd path. */
char *tu_write_file(const char *dir, const char *name, const void *data, size_t n);

#endif
