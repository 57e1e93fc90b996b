/*
 * api.c -- status strings, dtypes, the expert-parallel group and its communication buffers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "internal.h"

/* ---- Messages ---------------------------------------------------------------------------------- */

void mm_set_errorv(char *dst, const char *fmt, va_list ap) { vsnprintf(dst, MM_ERR_LEN, fmt, ap); }

void mm_set_error(char *dst, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mm_set_errorv(dst, fmt, ap);
    va_end(ap);
}

int mm_mul_overflows_u64(uint64_t a, uint64_t b, uint64_t *out) { return __builtin_mul_overflow(a, b, out); }

const char *megamoe_status_string(megamoe_status status) {
    switch (status) {
    case MEGAMOE_OK: return "ok";
    case MEGAMOE_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MEGAMOE_ERR_OUT_OF_MEMORY: return "out of memory";
    case MEGAMOE_ERR_BAD_WEIGHT: return "bad weight";
    case MEGAMOE_ERR_NOT_FINALIZED: return "layer not finalized";
    case MEGAMOE_ERR_BAD_INPUT: return "bad input";
    case MEGAMOE_ERR_IO: return "i/o error";
    case MEGAMOE_ERR_FORMAT: return "malformed file";
    case MEGAMOE_ERR_UNSUPPORTED: return "unsupported";
    case MEGAMOE_ERR_TIMEOUT: return "timeout";
    case MEGAMOE_ERR_CUDA: return "CUDA error";
    case MEGAMOE_ERR_NCCL: return "NCCL error";
    case MEGAMOE_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

#define MM_STR2(x) #x
#define MM_STR(x) MM_STR2(x)
const char *megamoe_version_string(void) {
    return MM_STR(MEGAMOE_VERSION_MAJOR) "." MM_STR(MEGAMOE_VERSION_MINOR) "." MM_STR(MEGAMOE_VERSION_PATCH);
}

/* ---- Dtypes ------------------------------------------------------------------------------------ */

static const struct {
    megamoe_dtype dtype;
    const char *name;
    size_t size;
} k_dtypes[] = {
    {MEGAMOE_DTYPE_BOOL, "BOOL", 1},       {MEGAMOE_DTYPE_U8, "U8", 1},
    {MEGAMOE_DTYPE_I8, "I8", 1},           {MEGAMOE_DTYPE_I16, "I16", 2},
    {MEGAMOE_DTYPE_U16, "U16", 2},         {MEGAMOE_DTYPE_F16, "F16", 2},
    {MEGAMOE_DTYPE_BF16, "BF16", 2},       {MEGAMOE_DTYPE_I32, "I32", 4},
    {MEGAMOE_DTYPE_U32, "U32", 4},         {MEGAMOE_DTYPE_F32, "F32", 4},
    {MEGAMOE_DTYPE_F64, "F64", 8},         {MEGAMOE_DTYPE_I64, "I64", 8},
    {MEGAMOE_DTYPE_U64, "U64", 8},         {MEGAMOE_DTYPE_F8_E4M3, "F8_E4M3", 1},
    {MEGAMOE_DTYPE_F8_E5M2, "F8_E5M2", 1},
};

const char *megamoe_dtype_name(megamoe_dtype dtype) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (k_dtypes[i].dtype == dtype) return k_dtypes[i].name;
    return "INVALID";
}

size_t megamoe_dtype_size(megamoe_dtype dtype) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (k_dtypes[i].dtype == dtype) return k_dtypes[i].size;
    return 0;
}

megamoe_dtype megamoe_dtype_from_name(const char *name) {
    if (!name) return MEGAMOE_DTYPE_INVALID;
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (strcmp(k_dtypes[i].name, name) == 0) return k_dtypes[i].dtype;
    return MEGAMOE_DTYPE_INVALID;
}

int64_t megamoe_tensor_numel(const megamoe_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

/* ---- Group --------------------------------------------------------------------------------------- */

static void free_buffer_storage(megamoe_group *group, mm_buffer *b);

void megamoe_group_config_init(megamoe_group_config *config) {
    memset(config, 0, sizeof *config);
    config->backend = MEGAMOE_BACKEND_CPU;
    config->num_ranks = 1;
}

int megamoe_backend_available(megamoe_backend backend) {
    if (backend == MEGAMOE_BACKEND_CPU) return 1;
    if (backend == MEGAMOE_BACKEND_CUDA) return mm_cuda_available();
    if (backend == MEGAMOE_BACKEND_NCCL) return mm_nccl_available();
    return 0;
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
    if (config->backend != MEGAMOE_BACKEND_CPU && config->backend != MEGAMOE_BACKEND_CUDA &&
        config->backend != MEGAMOE_BACKEND_NCCL) {
        mm_set_error(g->error, "unknown backend %d", (int)config->backend);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (config->backend == MEGAMOE_BACKEND_NCCL && config->num_ranks != 1) {
        mm_set_error(g->error, "the NCCL backend drives one rank per process: num_ranks must be 1, got %d",
                     config->num_ranks);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    if (config->num_ranks < 1 || config->num_ranks > 72) {
        mm_set_error(g->error, "num_ranks R=%d must be in 1..72", config->num_ranks);
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
    if (config->backend != MEGAMOE_BACKEND_CPU) {
        megamoe_status st =
            config->backend == MEGAMOE_BACKEND_NCCL ? mm_nccl_group_init(g) : mm_cuda_group_init(g);
        if (st != MEGAMOE_OK) return st;
    }
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
    if (group->device) mm_cuda_group_fini(group);
    free(group);
}

const char *megamoe_group_last_error(const megamoe_group *group) {
    return group ? group->error : "group is NULL";
}

int megamoe_group_world_size(const megamoe_group *group) { return group ? group->world_size : 0; }
int megamoe_group_local_ranks(const megamoe_group *group) { return group ? group->local_ranks : 0; }
int megamoe_group_rank(const megamoe_group *group, int local_rank) {
    return group ? group->first_rank + local_rank : -1;
}
megamoe_backend megamoe_group_backend(const megamoe_group *group) {
    return group ? group->config.backend : MEGAMOE_BACKEND_CPU;
}

/* ---- Communication buffer ------------------------------------------------------------------------ */

static uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void mm_buffer_layout_compute(int max_tokens, int top_k, int hidden_size, int device, int gather, int num_ranks,
                              int experts_per_rank, int intermediate_size, mm_buffer_layout *l) {
    const uint64_t T = (uint64_t)max_tokens, K = (uint64_t)top_k, H = (uint64_t)hidden_size;
    const uint64_t A = 256; /* every region starts on a 256-byte boundary */
    memset(l, 0, sizeof *l);
    uint64_t off = 0;
    l->num_tokens = off;
    off = A;
    l->topk_ids = off;
    off = align_up(off + T * K * 4, A);
    l->topk_weights = off;
    off = align_up(off + T * K * 4, A);
    l->token_state = off;
    off = align_up(off + T, A);
    /* The x region: the BF16 view [T, H] bf16 is larger than the NVFP4 view (codes H/2 + scales
     * H/16 + s), so it sizes the region and the NVFP4 view lives inside it. */
    l->x = off;
    l->x_sf = align_up(off + T * H / 2, A);
    l->x_scale = align_up(l->x_sf + T * H / 16, A);
    uint64_t nvfp4_end = l->x_scale + T * 4;
    uint64_t bf16_end = off + T * H * 2;
    off = align_up(nvfp4_end > bf16_end ? nvfp4_end : bf16_end, A);
    l->p = off;
    off = align_up(off + T * K * H * 4, A);
    if (device) {
        const uint64_t R = (uint64_t)num_ranks, Er = (uint64_t)experts_per_rank,
                       I = (uint64_t)intermediate_size;
        const uint64_t slots = R * T * K;
        l->max_tiles = (int)(Er + (slots + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS);
        l->slots = off;
        off = align_up(off + slots * 4, A);
        l->slot_scale = off;
        off = align_up(off + slots * 4, A);
        l->expert_count = off;
        off = align_up(off + Er * 4, A);
        l->expert_offset = off;
        off = align_up(off + (Er + 1) * 4, A);
        l->num_tiles = off;
        off = align_up(off + 4, A);
        l->tile_expert = off;
        off = align_up(off + (uint64_t)l->max_tiles * 4, A);
        l->tile_start = off;
        off = align_up(off + (uint64_t)l->max_tiles * 4, A);
        l->tile_rows = off;
        off = align_up(off + (uint64_t)l->max_tiles * 8, A);
        l->tile_order = off;
        off = align_up(off + (uint64_t)l->max_tiles * 4, A);
        l->x_f16 = off;
        off = align_up(off + T * H * 2, A);
        l->act = off;
        off = align_up(off + slots * I * 2, A);
        if (gather) {
            const uint64_t rows = (R < MM_GATHER_CAP ? R : MM_GATHER_CAP) * T * K;
            l->xg_rows = (int)rows;
            l->xg = off;
            off = align_up(off + rows * H * 2, A);
        }
        if (Er <= MM_ROUTE_CHUNK_EXPERTS) {
            l->route_chunks_per_src = (int)((T * K + MM_ROUTE_CHUNK - 1) / MM_ROUTE_CHUNK);
            l->route_chunks = off;
            off = align_up(off + R * (uint64_t)l->route_chunks_per_src * Er * 4, A);
        }
        l->error = off;
        off = align_up(off + 16, A);
        l->stage_arrivals = off;
        off = align_up(off + 4, A);
        l->splitk_ws = off;
        off = align_up(off + (uint64_t)MM_SPLITK_ENTRIES * 128 * 64 * 4, A);
        l->splitk_counters = off;
        off = align_up(off + (uint64_t)MM_SPLITK_ENTRIES * 4, A);
        l->barrier = off;
        off = align_up(off + (R + 1) * 8, A);
    }
    l->total = off;
}

static int is_device(const megamoe_group *g) { return g->config.backend != MEGAMOE_BACKEND_CPU; }
/* Device ranks copy each routed token row once into a slot-ordered region (DECISIONS 51): ranks on
 * several GPUs on every forward (each remote row crosses NVLink once), a process driving one rank
 * when the warp-specialized kernels run (their token tile is then one TMA box). One process driving
 * several ranks (tests) does not. */
static int gathers(const megamoe_group *g) {
    return is_device(g) && (g->local_ranks == 1 || g->config.backend == MEGAMOE_BACKEND_NCCL);
}

/* T_max * K * H * 4 must not overflow; the layer checks this before asking for a buffer. */
megamoe_status megamoe_group_buffer_bytes(megamoe_group *group, int num_experts, int max_tokens, int top_k,
                                          int hidden_size, int intermediate_size, uint64_t *bytes) {
    (void)num_experts;
    (void)intermediate_size;
    if (!group || !bytes) return MEGAMOE_ERR_INVALID_ARGUMENT;
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
    mm_buffer_layout_compute(max_tokens, top_k, hidden_size, is_device(group), gathers(group), group->world_size,
                             num_experts / group->world_size, intermediate_size, &l);
    *bytes = l.total;
    return MEGAMOE_OK;
}

/* One host buffer per local rank (the CPU backend); on failure nothing stays allocated. */
static megamoe_status host_buffer_alloc(megamoe_group *group, mm_buffer *b) {
    for (int r = 0; r < group->local_ranks; r++) {
        b->rank_base[r] = aligned_alloc(256, (size_t)b->layout.total);
        if (!b->rank_base[r]) {
            for (int q = 0; q < r; q++)
                free(b->rank_base[q]);
            return MEGAMOE_ERR_OUT_OF_MEMORY;
        }
    }
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
    mm_buffer_layout_compute(c->max_tokens, c->top_k, c->hidden_size, is_device(group), gathers(group), group->world_size,
                             c->num_experts / group->world_size, c->intermediate_size, &b->layout);
    b->rank_base = calloc((size_t)group->local_ranks, sizeof *b->rank_base);
    if (!b->rank_base) {
        free(b);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    megamoe_status st = group->config.backend == MEGAMOE_BACKEND_NCCL ? mm_nccl_buffer_alloc(group, b)
                        : is_device(group)                            ? mm_cuda_buffer_alloc(group, b)
                                                                      : host_buffer_alloc(group, b);
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
    if (group->config.backend == MEGAMOE_BACKEND_NCCL) /* as it was allocated: ncclMemAlloc + window */
        mm_nccl_buffer_free(group, b);
    else if (is_device(group))
        mm_cuda_buffer_free(group, b);
    else
        for (int r = 0; r < group->local_ranks; r++)
            free(b->rank_base[r]);
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
