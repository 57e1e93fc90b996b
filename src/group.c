/*
 * group.c -- the expert-parallel group: its configuration, its backend (the table of operations it
 * picks once, at creation) and its communication buffers, one per layer shape, shared by layers.
 */
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "internal.h"

/* The operations of a backend, or NULL for a value outside the enum. */
static const mm_backend_ops *backend_ops(megamoe_backend backend) {
    switch (backend) {
    case MEGAMOE_BACKEND_CPU: return &mm_cpu_backend;
    case MEGAMOE_BACKEND_CUDA: return &mm_cuda_backend;
    case MEGAMOE_BACKEND_NCCL: return &mm_nccl_backend;
    }
    return NULL;
}

static void free_buffer_storage(megamoe_group *group, mm_buffer *b);

void megamoe_group_config_init(megamoe_group_config *config) {
    memset(config, 0, sizeof *config);
    config->backend = MEGAMOE_BACKEND_CPU;
    config->num_ranks = 1;
}

int megamoe_backend_available(megamoe_backend backend) {
    const mm_backend_ops *ops = backend_ops(backend);
    return ops ? ops->available() : 0;
}

megamoe_status megamoe_group_create(const megamoe_group_config *config, megamoe_group **out) {
    if (!out) return MEGAMOE_ERR_INVALID_ARGUMENT;
    megamoe_group *g = calloc(1, sizeof *g);
    *out = g;
    if (!g) return MEGAMOE_ERR_OUT_OF_MEMORY;
    if (!config) {
        mm_set_error(g->error, "megamoe_group_create: config is NULL");
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    g->config = *config;
    const mm_backend_ops *ops = backend_ops(config->backend);
    if (!ops) {
        mm_set_error(g->error, "unknown backend %d", (int)config->backend);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    g->ops = ops;
    if (ops->one_rank_per_process && config->num_ranks != 1) {
        mm_set_error(g->error, "the %s backend drives one rank per process: num_ranks must be 1, got %d",
                     ops->name, config->num_ranks);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (config->num_ranks < 1 || config->num_ranks > MM_MAX_RANKS) {
        mm_set_error(g->error, "num_ranks R=%d must be in 1..%d", config->num_ranks, MM_MAX_RANKS);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (config->num_threads < 0 || config->num_threads > MEGAMOE_MAX_THREADS) {
        mm_set_error(g->error, "num_threads=%d must be in 0..%d (0 = one per core)", config->num_threads,
                     MEGAMOE_MAX_THREADS);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    g->world_size = config->num_ranks;
    g->local_ranks = config->num_ranks;
    g->first_rank = 0;
    megamoe_status st = ops->group_init(g);
    if (st != MEGAMOE_OK) return st;
#ifdef _OPENMP
    g->num_threads = config->num_threads > 0 ? config->num_threads : omp_get_num_procs();
#else
    g->num_threads = 1;
#endif
    return MEGAMOE_OK;
}

void megamoe_group_destroy(megamoe_group *group) {
    if (!group) return;
    /* Layers release their buffers; anything left means a layer outlived its group. */
    while (group->buffers) {
        mm_buffer *b = group->buffers;
        group->buffers = b->next;
        free_buffer_storage(group, b);
    }
    if (group->ops) group->ops->group_fini(group);
    free(group);
}

const char *megamoe_group_last_error(const megamoe_group *group) {
    return group ? group->error : "group is NULL";
}

int megamoe_group_world_size(const megamoe_group *group) { return group ? group->world_size : 0; }
int megamoe_group_local_ranks(const megamoe_group *group) { return group ? group->local_ranks : 0; }
int megamoe_group_rank(const megamoe_group *group, int local_rank) {
    return group ? mm_group_rank(group, local_rank) : -1;
}
megamoe_backend megamoe_group_backend(const megamoe_group *group) {
    return group ? group->config.backend : MEGAMOE_BACKEND_CPU;
}

/* ---- Communication buffers ------------------------------------------------------------------- */

/* Device ranks copy each routed token row once into a slot-ordered region (DECISIONS 44) when a
 * process drives one rank: ranks on several GPUs (each remote row crosses NVLink once), or one GPU
 * with R = 1 when the warp-specialized kernels run (their token tile is then one TMA box). One
 * process driving several ranks (tests) does not. */
static int gathers(const megamoe_group *g) { return g->ops->device_memory && g->local_ranks == 1; }

static void layout_of(const megamoe_group *g, int num_experts, int max_tokens, int top_k, int hidden_size,
                      int intermediate_size, mm_buffer_layout *l) {
    mm_buffer_layout_compute(max_tokens, top_k, hidden_size, g->ops->device_memory, gathers(g), g->world_size,
                             num_experts / g->world_size, intermediate_size, l);
}

/* T_max * K * H * 4 must not overflow; the layer checks this before asking for a buffer. */
megamoe_status megamoe_group_buffer_bytes(megamoe_group *group, int num_experts, int max_tokens, int top_k,
                                          int hidden_size, int intermediate_size, uint64_t *bytes) {
    if (!group || !bytes || !group->ops) return MEGAMOE_ERR_INVALID_ARGUMENT; /* ops: a known backend */
    uint64_t tkh;
    if (max_tokens < 1 || top_k < 1 || hidden_size < 1 ||
        mm_mul_overflows_u64((uint64_t)max_tokens * (uint64_t)top_k, (uint64_t)hidden_size * 8, &tkh)) {
        mm_set_error(group->error, "buffer size for T_max=%d K=%d H=%d is out of range", max_tokens, top_k,
                     hidden_size);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (num_experts < group->world_size || intermediate_size < 1) {
        mm_set_error(group->error, "buffer size: E=%d and I=%d must be positive, E >= R", num_experts,
                     intermediate_size);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    mm_buffer_layout l;
    layout_of(group, num_experts, max_tokens, top_k, hidden_size, intermediate_size, &l);
    *bytes = l.total;
    return MEGAMOE_OK;
}

megamoe_status mm_group_acquire_buffer(megamoe_group *group, const megamoe_layer_config *c, mm_buffer **out) {
    const int key[5] = {c->num_experts, c->max_tokens, c->top_k, c->hidden_size, c->intermediate_size};
    for (mm_buffer *b = group->buffers; b; b = b->next) {
        if (memcmp(b->key, key, sizeof key) == 0) {
            b->refs++;
            *out = b;
            return MEGAMOE_OK;
        }
    }
    mm_buffer *b = calloc(1, sizeof *b);
    if (!b) return MEGAMOE_ERR_OUT_OF_MEMORY;
    memcpy(b->key, key, sizeof key);
    layout_of(group, c->num_experts, c->max_tokens, c->top_k, c->hidden_size, c->intermediate_size, &b->layout);
    b->rank_base = calloc((size_t)group->local_ranks, sizeof *b->rank_base);
    if (!b->rank_base) {
        free(b);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    megamoe_status st = group->ops->buffer_alloc(group, b);
    if (st != MEGAMOE_OK) {
        free(b->rank_base);
        free(b);
        return st;
    }
    b->refs = 1;
    b->next = group->buffers;
    group->buffers = b;
    *out = b;
    return MEGAMOE_OK;
}

static void free_buffer_storage(megamoe_group *group, mm_buffer *b) {
    group->ops->buffer_free(group, b); /* as it was allocated (NCCL: ncclMemAlloc + window) */
    free(b->rank_base);
    free(b);
}

void mm_group_release_buffer(megamoe_group *group, mm_buffer *buffer) {
    if (!buffer || --buffer->refs > 0) return;
    for (mm_buffer **p = &group->buffers; *p; p = &(*p)->next) {
        if (*p == buffer) {
            *p = buffer->next;
            break;
        }
    }
    free_buffer_storage(group, buffer);
}
