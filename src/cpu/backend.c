/*
 * backend.c -- the CPU backend's table of operations: host buffers, one per local rank, and the
 * reference forward (forward.c), which reads the weights in the checkpoint layout as loaded.
 */
#include <stdlib.h>

#include "../internal.h"

static int cpu_available(void) { return 1; }

static megamoe_status cpu_group_init(megamoe_group *g) { return MEGAMOE_OK; }

static void cpu_group_fini(megamoe_group *g) {}

/* One host buffer per local rank; on failure nothing stays allocated. */
static megamoe_status cpu_buffer_alloc(megamoe_group *g, mm_buffer *b) {
    for (int r = 0; r < g->local_ranks; r++) {
        b->rank_base[r] = aligned_alloc(256, (size_t)b->layout.total);
        if (!b->rank_base[r]) {
            for (int q = 0; q < r; q++)
                free(b->rank_base[q]);
            return MEGAMOE_ERR_OUT_OF_MEMORY;
        }
    }
    return MEGAMOE_OK;
}

static void cpu_buffer_free(megamoe_group *g, mm_buffer *b) {
    for (int r = 0; r < g->local_ranks; r++)
        free(b->rank_base[r]);
}

/* The checkpoint layout is the CPU kernel layout: nothing to repack, upload or free. */
static megamoe_status cpu_layer_finalize(megamoe_layer *l) { return MEGAMOE_OK; }

static void cpu_layer_free(megamoe_layer *l) {}

static uint64_t cpu_layer_resident_bytes(const megamoe_layer *l) { return 0; }

static megamoe_status cpu_forward(megamoe_layer *l, const megamoe_forward_args *args, void *stream) {
    return mm_cpu_forward(l, args);
}

/* The forward finished before it returned, and reported what it found. */
static megamoe_status cpu_layer_check(megamoe_layer *l) { return MEGAMOE_OK; }

const mm_backend_ops mm_cpu_backend = {
    .name = "CPU",
    .device_memory = 0,
    .one_rank_per_process = 0,
    .available = cpu_available,
    .group_init = cpu_group_init,
    .group_fini = cpu_group_fini,
    .buffer_alloc = cpu_buffer_alloc,
    .buffer_free = cpu_buffer_free,
    .layer_finalize = cpu_layer_finalize,
    .layer_free = cpu_layer_free,
    .layer_resident_bytes = cpu_layer_resident_bytes,
    .forward = cpu_forward,
    .layer_check = cpu_layer_check,
};
