/*
 * internal.h -- the library's own structures, shared by the API boundary, the loaders and the
 * backends. Nothing here is visible to programs: they see include/megamoe.h only.
 */
#ifndef MEGAMOE_INTERNAL_H
#define MEGAMOE_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "megamoe.h"

#define MM_ERR_LEN 1024
#define MM_NAME_LEN 256

/* printf-style formatting into a fixed message buffer; always NUL-terminated. */
void mm_set_error(char *dst, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void mm_set_errorv(char *dst, const char *fmt, va_list ap);

/* Multiplications that report overflow instead of wrapping. */
static inline int mm_mul_overflows_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out);
}

/* ---- The communication buffer (SPEC §7) ----------------------------------------------------------
 * One per (group, E, T_max, K, H, I), shared by every layer of that shape and by both formats.
 * Per rank it holds the staged inputs of that rank's tokens and the expert outputs that come back
 * to them. Its byte layout is defined once, by mm_buffer_layout_compute() (buffer_layout.c). */
typedef struct mm_buffer_layout {
    uint64_t num_tokens;   /* i32: T of this rank's current forward                             */
    uint64_t topk_ids;     /* [T_max, K] i32 global expert ids                                  */
    uint64_t topk_weights; /* [T_max, K] f32                                                     */
    uint64_t token_state;  /* [T_max] u8: MM_TOKEN_*                                             */
    uint64_t x;            /* BF16 view: [T_max, H] bf16. NVFP4 view: codes, then sf, then s    */
    uint64_t x_sf;         /* NVFP4 view: [T_max, H/16] e4m3 block scales                        */
    uint64_t x_scale;      /* NVFP4 view: [T_max] f32 per-token scale s                          */
    uint64_t p;            /* [T_max, K, H] f32 expert outputs (after the norm), by slot        */
    /* Device backends only (0 bytes on the CPU): the routing of tokens to this rank's experts. */
    uint64_t slots;           /* [R*T_max*K] i32 slot codes (src*T_max + t)*K + k, grouped by expert */
    uint64_t slot_scale;      /* [R*T_max*K] f32 per slot row: its token's NVFP4 activation scale s  */
    uint64_t expert_count;    /* [E_r] i32 slots routed to each local expert                        */
    uint64_t expert_offset;   /* [E_r+1] i32 where each expert's slots start                        */
    uint64_t num_tiles;       /* i32: token tiles of this forward                                   */
    uint64_t tile_expert;     /* [max_tiles] i32 local expert of each token tile                    */
    uint64_t tile_start;      /* [max_tiles] i32 first slot (within the expert) of each tile        */
    uint64_t tile_rows;       /* [max_tiles] i32 x 2: each tile's first slot row and its tokens     */
    uint64_t tile_order;      /* [max_tiles] i32 tiles by tokens, most first (where the routing      */
                              /* writes it: plan_route_orders_tiles), for the streaming kernel       */
    uint64_t x_f16;           /* NVFP4: [T_max, H] f16 code * 2^-14 * sf of the staged tokens        */
    uint64_t act;             /* [R*T_max*K, I_padded] 16-bit down-projection input (f16 NVFP4, bf16  */
                              /* BF16); I_padded: weight_layout.h                                    */
    uint64_t xg;              /* group.c gathers(), else 0: [xg_rows, H] 16-bit gate/up input by       */
                              /* slot row (x_f16 NVFP4, x BF16), copied once from the home ranks        */
    uint64_t route_chunks;    /* E_r <= MM_ROUTE_CHUNK_EXPERTS, else 0: [R * route_chunks_per_src,   */
                              /* E_r] i32 per (home rank's chunk of MM_ROUTE_CHUNK slots, local      */
                              /* expert): the chunk's slots routed there, then its first slot row    */
    uint64_t error;           /* u64 first bad (slot key << 32 | id), u32 count of bad ids           */
    uint64_t splitk_ws;       /* [MM_SPLITK_ENTRIES] x 32 KB f32 partial sums of split-K blocks     */
    uint64_t splitk_counters; /* [MM_SPLITK_ENTRIES + 2] i32 arrivals per (row block, tile), then the */
                              /* ws walking grid's next item and finished blocks; all self-reset    */
    uint64_t barrier;         /* u64 epoch, then [R] u64 arrival flags written by the peers (NCCL)  */
    int max_tiles;            /* E_r + ceil(R*T_max*K / MM_TILE_TOKENS)                               */
    int xg_rows;              /* slot rows xg holds: min(R, MM_GATHER_CAP) * T_max * K (0: none)      */
    int route_chunks_per_src; /* ceil(T_max * K / MM_ROUTE_CHUNK) where route_chunks is held, else 0 */
    uint64_t total;           /* bytes per rank                                                     */
} mm_buffer_layout;

/* Ranks in a group at most (megamoe_group_config.num_ranks, an NCCL communicator's size): the
 * streaming kernel keeps a tile count per local rank in shared memory. */
#define MM_MAX_RANKS 72
#define MM_TILE_TOKENS 64      /* tokens per tile of the device expert GEMMs */
/* The routing of many slots (sm90_route.cu) counts and places them by chunks of MM_ROUTE_CHUNK slots
 * of one home rank (a block each), for ranks of at most MM_ROUTE_CHUNK_EXPERTS experts (a block holds
 * a count per expert and warp in shared memory: 8 x 4 KB). MM_ROUTE_CHUNK is a multiple of 256; 512
 * gives mid-size forwards more blocks to count and fill than 2048 (docs/DECISIONS.md). */
#define MM_ROUTE_CHUNK 512
#define MM_ROUTE_CHUNK_EXPERTS 1024
#define MM_SPLITK_ENTRIES 2048 /* (row block, tile, split) partial sums a device buffer holds */
#define MM_WS_COUNTERS MM_SPLITK_ENTRIES /* where splitk_counters holds the ws walking grid's two */

enum { MM_TOKEN_LIVE = 0, MM_TOKEN_PADDING = 1, MM_TOKEN_POISONED = 2 };

/* The gathered copy holds MM_GATHER_CAP times a rank's balanced share of slots (T_max * K) at most,
 * not the R times of every slot on one rank: a forward whose rank received more reads its rows in
 * place (the same y). EP8 DSv3 T_max 8192: 1.9 GB per rank instead of 7.5. */
#define MM_GATHER_CAP 2

/* The byte layout of one rank's buffer. `device` adds the routing and activation regions a device
 * backend needs (they depend on R, E_r and I too); `gather` adds the slot-ordered copy of the gate/up
 * input that a rank gathers from the home ranks (one row per slot) for the forwards that use it. */
void mm_buffer_layout_compute(int max_tokens, int top_k, int hidden_size, int device, int gather, int num_ranks,
                              int experts_per_rank, int intermediate_size, mm_buffer_layout *layout);

typedef struct mm_buffer {
    int key[5]; /* E, T_max, K, H, I                                       */
    int refs;   /* layers using it                                          */
    mm_buffer_layout layout;
    void **rank_base; /* [local ranks] base address of each rank's buffer          */
    void *peer_table; /* device backends: device array of the ranks' base addresses */
    void *backend;    /* NCCL: the window and device communicator                   */
    struct mm_buffer *next;
} mm_buffer;

/* ---- Group ------------------------------------------------------------------------------------ */

struct megamoe_group {
    megamoe_group_config config;
    const struct mm_backend_ops *ops; /* config.backend's operations, picked at creation */
    int world_size;     /* R                                          */
    int local_ranks;    /* ranks this process drives                  */
    int first_rank;     /* global rank of local rank 0                */
    int num_threads;    /* resolved CPU worker count                  */
    mm_buffer *buffers; /* communication buffers, one per shape       */
    void *device;       /* the CUDA backend's state, NULL on the CPU  */
    char error[MM_ERR_LEN];
};

/* The global rank of a local rank; the backends' way to megamoe_group_rank (they never call up into
 * the API boundary). */
static inline int mm_group_rank(const megamoe_group *group, int local_rank) {
    return group->first_rank + local_rank;
}

/* Gets (creating on first use) the buffer of a shape; releases it when the last layer goes. */
megamoe_status mm_group_acquire_buffer(megamoe_group *group, const megamoe_layer_config *config,
                                       mm_buffer **buffer);
void mm_group_release_buffer(megamoe_group *group, mm_buffer *buffer);

/* ---- Layer weights ------------------------------------------------------------------------------ */

/* Which (projection, field) parts of an expert were loaded: bit proj * 4 + field. */
#define MM_PART(proj, field) (1u << ((proj)*4 + (field)))

/* One local rank's experts in checkpoint layout (host). The CPU backend reads this layout as is. */
typedef struct mm_rank_weights {
    /* NVFP4 */
    uint8_t *w13;           /* [E_r, 2I, H/2]  e2m1 codes, rows 0..I-1 gate, I..2I-1 up        */
    uint8_t *w13_sf;        /* [E_r, 2I, H/16] e4m3 block scales                                 */
    float *w13_alpha;       /* [E_r, 2]        global scales (gate, up)                          */
    float *w13_input_scale; /* [E_r, 2]        static input scales, kept and unused              */
    uint8_t *w2;            /* [E_r, H, I/2]   e2m1 codes                                       */
    uint8_t *w2_sf;         /* [E_r, H, I/16]  e4m3 block scales                                 */
    float *w2_alpha;        /* [E_r]           global scale alpha_2                              */
    float *w2_input_scale;  /* [E_r]           static scale a2 of the down projection's input;  */
                            /*                 0 where never loaded (weight-only, bf16 activations) */
    /* BF16 */
    uint16_t *w13_bf16; /* [E_r, 2I, H] bf16                                                */
    uint16_t *w2_bf16;  /* [E_r, H, I]  bf16                                                */
    uint16_t *loaded;   /* [E_r] MM_PART bits                                               */
} mm_rank_weights;

struct megamoe_layer {
    megamoe_group *group;
    megamoe_layer_config config;
    char name[MM_NAME_LEN];
    int experts_per_rank;   /* E_r                                    */
    mm_rank_weights *ranks; /* [local ranks]                          */
    float *norm_weight;     /* [H] as loaded (f32), NULL = no norm    */
    float *norm_gamma;      /* [H] gamma with the gain folded in      */
    int finalized;
    uint64_t finalize_peak_bytes;
    mm_buffer *buffer;
    void *device; /* the CUDA backend's weights, NULL on the CPU */
    char error[MM_ERR_LEN];
};

/* Whether the layer quantizes its activations to NVFP4 (SPEC §3): NVFP4 weights with
 * activations=NVFP4. BF16 layers and NVFP4 layers in W4A16 mode (§3b) keep them bf16. */
static inline int mm_layer_quantizes_activations(const megamoe_layer *l) {
    return l->config.format == MEGAMOE_FORMAT_NVFP4 && l->config.activations == MEGAMOE_ACTIVATIONS_NVFP4;
}

/* Appended to the message that names a missing down-projection input scale (layer.c, the loaders). */
extern const char mm_weight_only_hint[];

/* Sets the layer's message, prefixed with the layer name; returns status. */
megamoe_status mm_layer_fail(megamoe_layer *layer, megamoe_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* SPEC §1's shape rules (layer.c, the one place): E in 1..MM_MAX_EXPERTS, H a positive multiple of 256
 * and I of MM_I_MULTIPLE, both up to MM_MAX_DIM; and the activation clamp (finite, >= 0). Write a
 * message naming the value. (The CUDA backend computes at I padded further: weight_layout.h.) */
#define MM_MAX_EXPERTS 65536
#define MM_MAX_DIM (1 << 20)
#define MM_I_MULTIPLE 64
megamoe_status mm_check_layer_shape(int64_t E, int64_t H, int64_t I, char *msg);
megamoe_status mm_check_activation_clamp(float clamp, char *msg);

/* The weight names of SPEC §6, written once (checkpoint/names.c): projections per style, [0]
 * gate_proj/up_proj/down_proj and [1] w1/w3/w2, indexed by megamoe_proj; fields per style, [0] plain
 * (ModelOpt) and [1] compressed-tensors, indexed by megamoe_field. */
extern const char *const mm_proj_names[2][3];
extern const char *const mm_field_names[2][4];
/* "prefix.rest", or "rest" for an empty prefix. */
void mm_join_name(char *out, size_t n, const char *prefix, const char *rest);

/* ---- Backends -------------------------------------------------------------------------------------- */

/* What the API boundary asks of a backend. Each backend defines one table; the group picks its
 * backend's table once, at creation, and every later call goes through it. */
typedef struct mm_backend_ops {
    const char *name;         /* as in messages: "CPU", "CUDA", "NCCL"                           */
    int device_memory;        /* x, y and the communication buffer live in device memory        */
    int one_rank_per_process; /* the group drives exactly one rank (config.num_ranks must be 1) */
    int (*available)(void);   /* usable in this build and on this machine                       */
    /* Sets up the backend's state for the group (may change world_size, local and first rank). */
    megamoe_status (*group_init)(megamoe_group *group);
    void (*group_fini)(megamoe_group *group);
    /* Allocates every local rank's buffer (buffer->rank_base) for buffer->layout; on failure nothing
     * stays allocated. */
    megamoe_status (*buffer_alloc)(megamoe_group *group, mm_buffer *buffer);
    void (*buffer_free)(megamoe_group *group, mm_buffer *buffer);
    /* Brings the loaded weights into the backend's layout; a backend that keeps layer->device sets
     * layer->finalize_peak_bytes (without, the peak is the checkpoint layout's size). */
    megamoe_status (*layer_finalize)(megamoe_layer *layer);
    void (*layer_free)(megamoe_layer *layer);
    uint64_t (*layer_resident_bytes)(const megamoe_layer *layer); /* of layer->device's weights */
    /* The arguments are checked; stream is the caller's (cudaStream_t), unused on the CPU. */
    megamoe_status (*forward)(megamoe_layer *layer, const megamoe_forward_args *args, void *stream);
    /* Waits for the last forward and reports what it found (bad ids, a rank that did not arrive). */
    megamoe_status (*layer_check)(megamoe_layer *layer);
} mm_backend_ops;

extern const mm_backend_ops mm_cpu_backend;  /* src/cpu/backend.c */
extern const mm_backend_ops mm_cuda_backend; /* src/cuda/backend.cu; src/cuda/stub.c without CUDA */
extern const mm_backend_ops mm_nccl_backend; /* src/ep/nccl.cu; src/ep/nccl_stub.c without NCCL */

/* The CPU backend's forward (src/cpu/forward.c). */
megamoe_status mm_cpu_forward(megamoe_layer *layer, const megamoe_forward_args *args);

/* The CUDA backend's entry points, which the NCCL backend shares (the kernels are the same). */
int mm_cuda_available(void);
megamoe_status mm_cuda_group_init(megamoe_group *group);
void mm_cuda_group_fini(megamoe_group *group);
megamoe_status mm_cuda_buffer_alloc(megamoe_group *group, mm_buffer *buffer);
void mm_cuda_buffer_free(megamoe_group *group, mm_buffer *buffer);
/* Zeroes the split-K counters and the barrier words of the local ranks' buffers. */
megamoe_status mm_cuda_buffer_init(megamoe_group *group, mm_buffer *buffer);
/* Uploads the weights into the kernel layout and frees the host copies. */
megamoe_status mm_cuda_layer_finalize(megamoe_layer *layer);
void mm_cuda_layer_free(megamoe_layer *layer);
uint64_t mm_cuda_layer_resident_bytes(const megamoe_layer *layer);
megamoe_status mm_cuda_forward(megamoe_layer *layer, const megamoe_forward_args *args, void *stream);
megamoe_status mm_cuda_layer_check(megamoe_layer *layer);
/* Test only (tests/test_gpu_timeout.c): from the next forward of this finalized device layer, its ranks
 * meet at the cross-rank barrier where global rank `rank` never arrives (-1: none, the default), so the
 * others time out after timeout_ms. UNSUPPORTED in a build without the CUDA backend. */
megamoe_status mm_test_hold_rank(megamoe_layer *layer, int rank);

/* The NCCL backend's own entry points (its table's; the layer's operations are the CUDA ones). */
int mm_nccl_available(void);
megamoe_status mm_nccl_group_init(megamoe_group *group);
megamoe_status mm_nccl_buffer_alloc(megamoe_group *group, mm_buffer *buffer);
void mm_nccl_buffer_free(megamoe_group *group, mm_buffer *buffer);

/* ---- Checkpoint internals (exposed for the fuzzer and the tests) ---------------------------------- */

typedef struct mm_st_entry {
    char *name;
    megamoe_dtype dtype;
    int ndim;
    int64_t shape[MEGAMOE_MAX_DIMS];
    uint64_t begin, end; /* offsets into the data section */
} mm_st_entry;

/* Parses and validates a whole safetensors image (header + data) held in memory. On success
 * *entries gets a malloc'd array sorted by name (free with mm_st_entries_free). `file` names the
 * file in messages. */
megamoe_status mm_safetensors_parse(const uint8_t *image, uint64_t size, const char *file,
                                    mm_st_entry **entries, int *num_entries, uint64_t *data_offset,
                                    char *err);
void mm_st_entries_free(mm_st_entry *entries, int num_entries);

#endif /* MEGAMOE_INTERNAL_H */
