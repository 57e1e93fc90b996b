/*
 * megamoe.h -- the one public header of megamoe.
 *
 * megamoe runs the experts of a Mixture-of-Experts layer, expert-parallel over R ranks, with NVFP4 or
 * BF16 weights. What the layer computes is defined by SPEC.md (shipped in docs/); this header is the
 * C contract. It is C11 and needs no CUDA or NCCL header: streams and communicators pass as void*.
 *
 * Conventions (after nccl.h, zstd and sqlite):
 *   - Every call returns a megamoe_status; MEGAMOE_OK is 0. megamoe_status_string() gives a static
 *     string per code; the handle that failed keeps a message with the detail (*_last_error()).
 *   - Create/open functions hand back a handle even when they fail (like sqlite3_open), so the caller
 *     can read the message; the handle is then only good for *_last_error() and destroy. They return
 *     NULL only when memory for the handle itself could not be had (MEGAMOE_ERR_OUT_OF_MEMORY).
 *   - Destroy functions accept NULL. The library never prints, exits or reads the environment.
 *   - Tensors are described by megamoe_tensor: row-major, contiguous, host memory unless a function
 *     says otherwise. bf16 values are passed as their 16-bit patterns (uint16_t).
 *
 * Threads:
 *   - A group and the layers made from it are used by one thread at a time: the caller serializes
 *     every call on them, forwards of different layers included (layers of one shape share the
 *     group's buffer, SPEC §7, and a layer keeps its last error and forward state on the handle).
 *   - Different groups are independent: each may be used from its own thread at the same time. A
 *     checkpoint is used by one thread at a time (its message is per handle); layers of different
 *     groups may load from one checkpoint only one after the other.
 *   - Calls without a handle (status, dtype and version strings, megamoe_backend_available,
 *     megamoe_safetensors_write, megamoe_quantize_checkpoint on distinct files) may run from any
 *     thread at any time.
 *   - A device backend's forward is asynchronous: forwards of layers that share a buffer run in stream
 *     order, so they go on one stream or on streams the caller orders (events).
 *   - NCCL groups: creating and destroying layers and every forward are collective, in the same order
 *     on every rank, so one thread per rank makes them.
 *   The Python package enforces this (docs/PYTHON.md, "Threads").
 *
 * Life of a layer:
 *   megamoe_group_create -> megamoe_layer_create -> megamoe_layer_load_* (any order, any number of
 *   times) -> megamoe_layer_finalize -> megamoe_layer_forward (many times) -> megamoe_layer_destroy ->
 *   megamoe_group_destroy.
 */
#ifndef MEGAMOE_H
#define MEGAMOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MEGAMOE_VERSION_MAJOR 0
#define MEGAMOE_VERSION_MINOR 1
#define MEGAMOE_VERSION_PATCH 0

/* ------------------------------------------------------------------------------------------------ */
/* Status                                                                                            */
/* ------------------------------------------------------------------------------------------------ */

/* Values are pinned: they never change meaning between releases. */
typedef enum megamoe_status {
    MEGAMOE_OK = 0,
    MEGAMOE_ERR_INVALID_ARGUMENT = 1, /* a size, pointer or option breaks a documented rule      */
    MEGAMOE_ERR_OUT_OF_MEMORY = 2,    /* host or device allocation failed                         */
    MEGAMOE_ERR_BAD_WEIGHT = 3,       /* unknown name, wrong shape or dtype, invalid scale         */
    MEGAMOE_ERR_NOT_FINALIZED = 4,    /* forward before finalize, or weights missing at finalize   */
    MEGAMOE_ERR_BAD_INPUT = 5,        /* forward input out of range (expert id, token count)       */
    MEGAMOE_ERR_IO = 6,               /* a file could not be opened, mapped, read or written        */
    MEGAMOE_ERR_FORMAT = 7,           /* a checkpoint or inputs file is malformed                  */
    MEGAMOE_ERR_UNSUPPORTED = 8,      /* backend or feature not available in this build/machine    */
    MEGAMOE_ERR_TIMEOUT = 9,          /* a wait on another rank expired                            */
    MEGAMOE_ERR_CUDA = 10,            /* a CUDA call failed                                        */
    MEGAMOE_ERR_NCCL = 11,            /* an NCCL call failed                                       */
    MEGAMOE_ERR_INTERNAL = 12         /* a bug in megamoe: please report it                        */
} megamoe_status;

/* A static, never-NULL string naming the status ("invalid argument", ...). */
const char *megamoe_status_string(megamoe_status status);

/* "0.1.0" */
const char *megamoe_version_string(void);

/* ------------------------------------------------------------------------------------------------ */
/* Tensors                                                                                           */
/* ------------------------------------------------------------------------------------------------ */

/* Values are pinned. The names follow safetensors ("BF16", "F8_E4M3", ...). */
typedef enum megamoe_dtype {
    MEGAMOE_DTYPE_INVALID = 0,
    MEGAMOE_DTYPE_BOOL = 1,
    MEGAMOE_DTYPE_U8 = 2,
    MEGAMOE_DTYPE_I8 = 3,
    MEGAMOE_DTYPE_I16 = 4,
    MEGAMOE_DTYPE_U16 = 5,
    MEGAMOE_DTYPE_F16 = 6,
    MEGAMOE_DTYPE_BF16 = 7,
    MEGAMOE_DTYPE_I32 = 8,
    MEGAMOE_DTYPE_U32 = 9,
    MEGAMOE_DTYPE_F32 = 10,
    MEGAMOE_DTYPE_F64 = 11,
    MEGAMOE_DTYPE_I64 = 12,
    MEGAMOE_DTYPE_U64 = 13,
    MEGAMOE_DTYPE_F8_E4M3 = 14,
    MEGAMOE_DTYPE_F8_E5M2 = 15
} megamoe_dtype;

#define MEGAMOE_MAX_DIMS 8

typedef struct megamoe_tensor {
    megamoe_dtype dtype;
    int ndim;                        /* 0 (a scalar) ... MEGAMOE_MAX_DIMS                 */
    int64_t shape[MEGAMOE_MAX_DIMS]; /* shape[0..ndim)                                     */
    const void *data;                /* row-major, contiguous                              */
} megamoe_tensor;

/* "BF16", "F8_E4M3", ...; "INVALID" for anything else. */
const char *megamoe_dtype_name(megamoe_dtype dtype);
/* Bytes per element; 0 for MEGAMOE_DTYPE_INVALID. */
size_t megamoe_dtype_size(megamoe_dtype dtype);
/* MEGAMOE_DTYPE_INVALID when the name is not one of the above. */
megamoe_dtype megamoe_dtype_from_name(const char *name);
/* Product of the shape (1 for a scalar). */
int64_t megamoe_tensor_numel(const megamoe_tensor *t);

/* ------------------------------------------------------------------------------------------------ */
/* Expert-parallel group                                                                             */
/* ------------------------------------------------------------------------------------------------ */

typedef enum megamoe_backend {
    MEGAMOE_BACKEND_CPU = 0,  /* R ranks inside this process, computed on the host             */
    MEGAMOE_BACKEND_CUDA = 1, /* R ranks sharing one CUDA device (sm_90)                        */
    MEGAMOE_BACKEND_NCCL = 2  /* one rank per process, one GPU each, peers through NCCL symmetric
                                 memory (all ranks on NVLink). Creating and destroying layers is then
                                 collective: every rank does it, in the same order; destroy the group
                                 before the communicator. */
} megamoe_backend;

typedef struct megamoe_group_config {
    megamoe_backend backend;
    int num_ranks;   /* ranks driven by this process: CPU and CUDA 1..72; NCCL: must be 1      */
    int device;      /* CUDA device ordinal (CUDA, NCCL)                                       */
    void *nccl_comm; /* ncclComm_t of the EP group (NCCL only)                                 */
    int num_threads; /* CPU backend worker threads: 1..MEGAMOE_MAX_THREADS; 0 = one per core    */
} megamoe_group_config;

/* The most CPU worker threads a group takes (more overflow the OpenMP runtime's stacks). */
#define MEGAMOE_MAX_THREADS 1024

typedef struct megamoe_group megamoe_group;

/* Fills *config with the defaults: CPU backend, 1 rank, device 0, all cores. */
void megamoe_group_config_init(megamoe_group_config *config);

/* Creates a group. On failure *group may still be set (see conventions); destroy it. */
megamoe_status megamoe_group_create(const megamoe_group_config *config, megamoe_group **group);
void megamoe_group_destroy(megamoe_group *group);
const char *megamoe_group_last_error(const megamoe_group *group);

/* Number of ranks of the whole EP group (R) and of those this process drives. */
int megamoe_group_world_size(const megamoe_group *group);
int megamoe_group_local_ranks(const megamoe_group *group);
/* Global rank of local rank i (0 for the CPU/CUDA backends' rank 0, ...). */
int megamoe_group_rank(const megamoe_group *group, int local_rank);
megamoe_backend megamoe_group_backend(const megamoe_group *group);

/* Whether this build and machine can create a group of that backend (a usable sm_90 device for CUDA). */
int megamoe_backend_available(megamoe_backend backend);

/* ------------------------------------------------------------------------------------------------ */
/* Layer                                                                                             */
/* ------------------------------------------------------------------------------------------------ */

typedef enum megamoe_weight_format {
    MEGAMOE_FORMAT_NVFP4 = 0, /* E2M1 codes + E4M3 block scales per 16 + f32 global scales      */
    MEGAMOE_FORMAT_BF16 = 1
} megamoe_weight_format;

/* What an NVFP4 layer does with its activations (SPEC §3b). Values are pinned; BF16 is 0 so that a
 * zeroed config gets the default. A BF16-weight layer accepts only MEGAMOE_ACTIVATIONS_BF16. */
typedef enum megamoe_activations {
    MEGAMOE_ACTIVATIONS_BF16 = 0, /* never quantized: NVFP4 weights x BF16 activations (W4A16)     */
    MEGAMOE_ACTIVATIONS_NVFP4 = 1 /* quantized to NVFP4 per token (and the down input with a2): §3 */
} megamoe_activations;

/* Which kernel runs the expert GEMMs of the device backends (megamoe_layer_config.gemm_kernel). */
typedef enum megamoe_gemm_kernel {
    MEGAMOE_GEMM_AUTO = 0,   /* chosen per forward from the token count and the shape (default) */
    MEGAMOE_GEMM_MMA = 1,    /* mma.sync, split-K for few tokens                                */
    MEGAMOE_GEMM_WGMMA = 2,  /* wgmma, A from registers                                         */
    MEGAMOE_GEMM_STREAM = 3, /* the streaming kernel (NVFP4; BF16 layers get mma.sync)          */
    MEGAMOE_GEMM_WS = 4,     /* the warp-specialized kernel, 128-token blocks                   */
    MEGAMOE_GEMM_WS64 = 5    /* the warp-specialized kernel, 64-token blocks                    */
} megamoe_gemm_kernel;

typedef struct megamoe_layer_config {
    const char *name;      /* layer name used in messages, e.g. "model.layers.3.mlp"; copied */
    int num_experts;       /* E, global; E % R == 0                                      */
    int top_k;             /* K, 1..32                                                   */
    int hidden_size;       /* H, multiple of 256                                         */
    int intermediate_size; /* I, per expert, multiple of 64 (the CUDA backend pads to 256) */
    int max_tokens;        /* T_max, tokens per rank per forward, >= 1                    */
    megamoe_weight_format format;
    megamoe_activations activations; /* NVFP4 layers: BF16 (default, SPEC §3b) or NVFP4 (§3);
                                        BF16 layers: BF16 only                                  */
    float norm_eps;         /* post-expert RMSNorm epsilon, > 0 (default 1e-6)             */
    int norm_zero_centered; /* gamma = weight + norm_gain_center (folded at finalize)      */
    float norm_gain_center; /* default 1.0                                                */
    float activation_clamp; /* C > 0 clamps gate and up before SwiGLU; 0 = off (default)    */
    int timeout_ms;         /* bound on every wait for another rank (default 10000)        */
    /* Device backends' expert GEMMs: MEGAMOE_GEMM_AUTO (default) or a forced kernel, for tests and
     * benchmarks only: every rank must pass the same value. */
    megamoe_gemm_kernel gemm_kernel;
} megamoe_layer_config;

typedef struct megamoe_layer megamoe_layer;

/* Fills *config with defaults; sizes are 0 and must be set by the caller. */
void megamoe_layer_config_init(megamoe_layer_config *config);

/* Creates the layer on every local rank of the group. Sizes breaking a SPEC §1 rule are refused with
 * a message naming the rule and the values. On failure *layer may still be set: destroy it. */
megamoe_status megamoe_layer_create(megamoe_group *group, const megamoe_layer_config *config,
                                    megamoe_layer **layer);
void megamoe_layer_destroy(megamoe_layer *layer);
const char *megamoe_layer_last_error(const megamoe_layer *layer);

/*
 * Loads one stacked weight from the full tensor of all E experts ([E, ...], host memory); each local
 * rank copies its slice [r*E_r, (r+1)*E_r) and checks shape and dtype. Names and shapes (SPEC §3-4):
 *   NVFP4: w13_weight [E,2I,H/2] U8, w13_weight_scale [E,2I,H/16] F8_E4M3, w13_weight_scale_2 [E,2] F32,
 *          w13_input_scale [E,2] F32, w2_weight [E,H,I/2] U8, w2_weight_scale [E,H,I/16] F8_E4M3,
 *          w2_weight_scale_2 [E] F32, w2_input_scale [E] F32  ([E] may also be [E,1])
 *   BF16:  w13_weight [E,2I,H] BF16, w2_weight [E,H,I] BF16
 * Scales are validated (SPEC §5). On any error nothing of the layer changes.
 */
megamoe_status megamoe_layer_load_weight(megamoe_layer *layer, const char *name, const megamoe_tensor *full);

typedef enum megamoe_proj { MEGAMOE_PROJ_GATE = 0, MEGAMOE_PROJ_UP = 1, MEGAMOE_PROJ_DOWN = 2 } megamoe_proj;
typedef enum megamoe_field {
    MEGAMOE_FIELD_WEIGHT = 0,         /* gate/up [I, H/2] U8 or [I, H] BF16; down [H, I/2] or [H, I] */
    MEGAMOE_FIELD_WEIGHT_SCALE = 1,   /* gate/up [I, H/16] F8_E4M3; down [H, I/16]                 */
    MEGAMOE_FIELD_WEIGHT_SCALE_2 = 2, /* [] or [1] F32: the global scale alpha                      */
    MEGAMOE_FIELD_INPUT_SCALE = 3     /* [] or [1] F32                                              */
} megamoe_field;

/* Loads one projection field of one expert (the per-expert naming of SPEC §6). `expert` is global;
 * an expert no local rank owns is accepted and ignored (every rank sees every expert's weights). */
megamoe_status megamoe_layer_load_expert_weight(megamoe_layer *layer, int expert, megamoe_proj proj,
                                                megamoe_field field, const megamoe_tensor *tensor);

/* Loads the post-expert RMSNorm weight, [H] F32 or BF16. A layer with none runs without the norm. */
megamoe_status megamoe_layer_load_norm_weight(megamoe_layer *layer, const megamoe_tensor *weight);

/* Checks every weight was loaded, repacks into the kernel layout, folds the norm gain, frees the
 * checkpoint-layout copies. Idempotent. On failure the loaded weights are kept. */
megamoe_status megamoe_layer_finalize(megamoe_layer *layer);

/* Inputs and output of one rank's forward. Pointers are host memory for the CPU backend and device
 * memory for CUDA/NCCL, where x and y must be 16-byte aligned (as cudaMalloc'd rows are). */
typedef struct megamoe_forward_args {
    int num_tokens;            /* T, 0..T_max                                   */
    const uint16_t *x;         /* [T, H] bf16 hidden states                     */
    const int32_t *topk_ids;   /* [T, K] global expert ids, -1 = empty slot     */
    const float *topk_weights; /* [T, K] routing weights                        */
    const uint8_t *is_padding; /* [T] 0/1, or NULL                              */
    uint16_t *y;               /* [T, H] bf16 output                            */
} megamoe_forward_args;

/*
 * Runs the layer: args[i] is local rank i's input (megamoe_group_local_ranks() entries). `stream` is
 * the cudaStream_t to enqueue on (CUDA/NCCL; NULL = the default stream) and is ignored by the CPU.
 * T > T_max on any rank is refused before anything runs. An expert id outside [-1, E) is skipped and
 * reported as MEGAMOE_ERR_BAD_INPUT after y was written for every token: the CPU backend from this
 * call, a device backend (which reads the ids on the device only) from megamoe_layer_check().
 * Collective over the EP group: every rank calls it, in the same layer order.
 */
megamoe_status megamoe_layer_forward(megamoe_layer *layer, const megamoe_forward_args *args, void *stream);

/* Waits for the layer's last forward and returns the error its device kernels found (bad expert
 * ids), with the detail in megamoe_layer_last_error(). The CPU backend reports those from
 * megamoe_layer_forward itself, so this returns MEGAMOE_OK there. */
megamoe_status megamoe_layer_check(megamoe_layer *layer);

typedef struct megamoe_memory_info {
    uint64_t weight_bytes;        /* resident kernel-layout weights of all local ranks         */
    uint64_t checkpoint_bytes;    /* checkpoint-layout copies still held (0 after finalize)   */
    uint64_t finalize_peak_bytes; /* most weight memory held at once during finalize          */
    uint64_t buffer_bytes;        /* the communication buffer, per rank (shared by layers)    */
    uint64_t workspace_bytes;     /* per-forward scratch held by the layer                     */
} megamoe_memory_info;

megamoe_status megamoe_layer_memory(const megamoe_layer *layer, megamoe_memory_info *info);

/* Bytes of the communication buffer one rank of this group needs for a layer shape (SPEC §7): the
 * same for both formats (the BF16 view is the larger and owns the storage). */
megamoe_status megamoe_group_buffer_bytes(megamoe_group *group, int num_experts, int max_tokens, int top_k,
                                          int hidden_size, int intermediate_size, uint64_t *bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Checkpoints (safetensors)                                                                         */
/* ------------------------------------------------------------------------------------------------ */

typedef struct megamoe_checkpoint megamoe_checkpoint;

/* Opens a .safetensors file, or a folder holding model.safetensors.index.json (or a single
 * .safetensors file). Files are memory-mapped and every header is validated. */
megamoe_status megamoe_checkpoint_open(const char *path, megamoe_checkpoint **checkpoint);
void megamoe_checkpoint_close(megamoe_checkpoint *checkpoint);
const char *megamoe_checkpoint_last_error(const megamoe_checkpoint *checkpoint);

int megamoe_checkpoint_num_tensors(const megamoe_checkpoint *checkpoint);
/* Tensor i (sorted by name): its name and a view whose data points into the mapped file. */
megamoe_status megamoe_checkpoint_tensor(const megamoe_checkpoint *checkpoint, int i, const char **name,
                                         megamoe_tensor *view);
/* MEGAMOE_ERR_BAD_WEIGHT when there is no tensor of that name. */
megamoe_status megamoe_checkpoint_find(const megamoe_checkpoint *checkpoint, const char *name,
                                       megamoe_tensor *view);
/* Number of files behind the checkpoint and the name of file i (for messages and inspect). */
int megamoe_checkpoint_num_files(const megamoe_checkpoint *checkpoint);
const char *megamoe_checkpoint_file(const megamoe_checkpoint *checkpoint, int i);

typedef enum megamoe_naming {
    MEGAMOE_NAMING_STACKED = 0,           /* {prefix}.w13_weight [E, 2I, H/2] ...                  */
    MEGAMOE_NAMING_PER_EXPERT = 1,        /* {prefix}.experts.{e}.gate_proj.weight ... (or w1/w3/w2)  */
    MEGAMOE_NAMING_COMPRESSED_TENSORS = 2 /* per expert or stacked, weight_packed/weight_global_scale */
} megamoe_naming;

/* What a checkpoint holds for one MoE layer, inferred from its tensors. */
typedef struct megamoe_layer_info {
    char prefix[256];
    megamoe_weight_format format;
    megamoe_naming naming;
    int num_experts;       /* E */
    int hidden_size;       /* H */
    int intermediate_size; /* I */
    int has_norm;          /* {prefix}.post_expert_norm.weight present */
    uint64_t bytes;        /* bytes of the layer's expert tensors in the checkpoint */
} megamoe_layer_info;

/* Finds the MoE layers of a checkpoint: up to max_layers are written to infos; *num_found gets how
 * many there are. */
megamoe_status megamoe_checkpoint_find_layers(megamoe_checkpoint *checkpoint, megamoe_layer_info *infos,
                                              int max_layers, int *num_found);

/* Describes the layer with that prefix ("" = the only one there is). */
megamoe_status megamoe_checkpoint_describe_layer(megamoe_checkpoint *checkpoint, const char *prefix,
                                                 megamoe_layer_info *info);

/* Progress of long work: `done` of `total` units of `what`. */
typedef void (*megamoe_progress_fn)(void *user, const char *what, uint64_t done, uint64_t total);

/* Loads every expert weight (and the norm weight, if any) of the layer `prefix` from the checkpoint,
 * in whichever naming style it uses. Errors name the file and the tensor; they are recorded on the
 * layer. The layer is not finalized. */
megamoe_status megamoe_layer_load_checkpoint(megamoe_layer *layer, megamoe_checkpoint *checkpoint,
                                             const char *prefix, megamoe_progress_fn progress,
                                             void *progress_user);

typedef struct megamoe_named_tensor {
    const char *name;
    megamoe_tensor tensor;
} megamoe_named_tensor;

/* Writes a safetensors file (tensors sorted by name; data 8-byte aligned). err (may be NULL) gets a
 * message on failure. */
megamoe_status megamoe_safetensors_write(const char *path, const megamoe_named_tensor *tensors,
                                         int num_tensors, char *err, size_t err_size);

/* ------------------------------------------------------------------------------------------------ */
/* Quantization (SPEC §2-3)                                                                          */
/* ------------------------------------------------------------------------------------------------ */

/*
 * Quantizes a BF16 matrix [rows, cols] (cols % 16 == 0) to NVFP4 the ModelOpt way: global scale
 * alpha = amax / (6 * 448) (1 when amax is 0), block scales e4m3_rn(block_amax / (alpha * 6)), codes
 * e2m1_rn(w / (scale * alpha)). codes: [rows, cols/2] U8, scales: [rows, cols/16] E4M3 bytes.
 * MEGAMOE_ERR_BAD_WEIGHT when the matrix holds a NaN or an infinity.
 */
megamoe_status megamoe_quantize_nvfp4(const uint16_t *w, int64_t rows, int64_t cols, uint8_t *codes,
                                      uint8_t *scales, float *global_scale);

typedef struct megamoe_quantize_options {
    int calib_tokens;       /* random N(0,1) tokens per expert that estimate the activation amax   */
    uint64_t calib_seed;    /* seed of those tokens                                                */
    float activation_clamp; /* the clamp the layer will run with (affects the calibrated amax)     */
    megamoe_progress_fn progress;
    void *progress_user;
} megamoe_quantize_options;

void megamoe_quantize_options_init(megamoe_quantize_options *options);

/*
 * Estimates the static input scales of one BF16 expert from `tokens` random N(0,1) hidden states
 * (seeded): *x_amax = max|x|, *a_amax = max|silu(g) * u| of the SwiGLU output that the down
 * projection quantizes (with the clamp, if > 0). Input scales are then amax / 2688.
 * w13: [2I, H] bf16 (gate rows then up rows).
 */
megamoe_status megamoe_calibrate_expert_bf16(const uint16_t *w13, int hidden_size, int intermediate_size,
                                             int tokens, uint64_t seed, float activation_clamp, float *x_amax,
                                             float *a_amax);

/*
 * Converts a checkpoint's BF16 expert weights (stacked or per expert) to NVFP4 in the per-expert
 * naming, shard by shard (a folder in, a folder out with its own index; a file in, a file out).
 * Every other tensor is copied unchanged. The static input scales come from a synthetic calibration
 * (options). err (may be NULL) gets a message on failure.
 */
megamoe_status megamoe_quantize_checkpoint(const char *in_path, const char *out_path,
                                           const megamoe_quantize_options *options, char *err,
                                           size_t err_size);

#ifdef __cplusplus
}
#endif

#endif /* MEGAMOE_H */
