/*
 * common.cuh -- what the CUDA backend's kernels and their host side share: the shape of a forward,
 * a rank's device weights, launch checking, the device switch, and small device helpers.
 */
#ifndef MEGAMOE_CUDA_COMMON_CUH
#define MEGAMOE_CUDA_COMMON_CUH

#include <utility>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "../internal.h"
}
#include "../formats.h"
#include "gemm_plan.h"
#include "ptx/sync.cuh"

/* The sizes one forward's kernels need, by value. */
/* f32 to the bits of the nearest f16 (ties to even). */
__device__ __forceinline__ uint16_t to_f16_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }

struct mm_dev_shape {
    int R;           /* ranks in the group                                        */
    int first_rank;  /* global rank of this process's local rank 0               */
    int local_ranks; /* ranks this process drives (R on one GPU, 1 with NCCL)    */
    int E, E_r, K;   /* experts, experts per rank, top-k                          */
    int H, I;        /* hidden and intermediate sizes                             */
    int T_max;
    int nvfp4;    /* 1: NVFP4 weights, 0: BF16                                 */
    int bf16_act; /* NVFP4 weights with bf16 activations (W4A16, SPEC §3b): x staged as exact f16
                     times a power of two, act rescaled to f16 between the GEMMs (sm90_act_f16.cu) */
    int has_norm;
    float clamp; /* 0 = off */
    float eps;
    int gathered; /* this forward gathers the gate/up input into L.xg (sm90_gather_kernel): see rank_gathered
                   */
};

/* W4A16: the exponent e of the power of two that puts amax * 2^-e in [2^15, 2^16), at least lo; 0
 * when amax is 0 or not finite. Every bf16 value of at least amax * 2^-33 is then exactly an f16
 * times 2^e (f16 keeps 8 significant bits down to 2^-17, bf16 has 8). */
__device__ __forceinline__ int mm_f16_exponent(float amax, int lo) {
    if (!(amax > 0.0f) || !mm_isfinite(amax)) return 0;
    int E;
    frexpf(amax, &E); /* amax in [2^(E-1), 2^E) */
    return E - 16 < lo ? lo : E - 16;
}

/* A slot code (src * T_max + token) * K + slot: the home rank, token and top-k position. */
struct slot_info {
    int src, token, slot;
};

__device__ __forceinline__ slot_info decode_slot(const mm_dev_shape &sh, int code) {
    slot_info s;
    s.src = code / (sh.T_max * sh.K);
    const int rem = code - s.src * sh.T_max * sh.K;
    s.token = rem / sh.K;
    s.slot = rem - s.token * sh.K;
    return s;
}

/* Whether the rank whose buffer is `mine` reads its gathered copy in this forward (gemm_plan.h
 * plan_rank_gathers): where the plan gathers, from the rank's own slot count (known on the device
 * after routing; the same answer in every kernel of the forward, as they read the same count). */
__device__ __forceinline__ bool rank_gathered(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                              const uint8_t *mine) {
    if (!sh.gathered) return false;
    const int n = ((const int32_t *)(mine + L.expert_offset))[sh.E_r];
    if (n > L.xg_rows) return false; /* more than the copy holds: rows in place */
    return plan_rank_gathers(sh.local_ranks == sh.R, n);
}

/* The buffer region of the gate/up GEMM's 16-bit input rows: the gathered copy L.xg (g), else the
 * staged tokens -- x_f16 (NVFP4 weights: the decoded quantized x, or with bf16 activations x itself
 * as exact f16 times a power of two; both written by the stage kernel) or x (BF16). */
__device__ __forceinline__ uint64_t gate_up_rows(const mm_dev_shape &sh, const mm_buffer_layout &L, bool g) {
    return g ? L.xg : sh.nvfp4 ? L.x_f16 : L.x;
}

/* One rank's weights on the device (checkpoint layout, see mm_rank_weights). */
struct mm_dev_weights {
    const uint8_t *w13, *w13_sf; /* [E_r, 2I, H/2], [E_r, 2I, H/16] */
    const uint8_t *w2, *w2_sf;   /* [E_r, H, I/2],  [E_r, H, I/16]  */
    const float *w13_alpha;      /* [E_r, 2] */
    const float *w2_alpha;       /* [E_r]    */
    const float *w2_in;          /* [E_r]    a2 */
    const uint16_t *w13_bf16;    /* [E_r, 2I, H] */
    const uint16_t *w2_bf16;     /* [E_r, H, I]  */
};

/* One rank's forward arguments (device pointers of the caller). */
struct mm_dev_rank_args {
    int T;
    const uint16_t *x;
    const int32_t *ids;
    const float *weights;
    const uint8_t *padding;
    uint16_t *y;
};

#define MM_CUDA_TRY(call)                                                                                    \
    do {                                                                                                     \
        cudaError_t err_ = (call);                                                                           \
        if (err_ != cudaSuccess) return mm_cuda_error(err_, #call, __FILE__, __LINE__);                      \
    } while (0)

template <typename... KArgs, typename... Args>
static inline cudaError_t mm_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t s, Args &&...args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/* The current device's SM count (host side; a plain query, allowed while a stream captures). */
static inline cudaError_t mm_device_sms(int *sms) {
    int device = 0;
    const cudaError_t e = cudaGetDevice(&device);
    return e != cudaSuccess ? e : cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

/* Makes the group's device current for the scope and restores the caller's afterwards. */
struct device_scope {
    int previous = -1;
    explicit device_scope(int device) {
        if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
        if (previous != device) cudaSetDevice(device);
    }
    ~device_scope() {
        if (previous >= 0) cudaSetDevice(previous);
    }
};

/* The CUDA device of a device-backend group. */
int mm_cuda_group_device(const megamoe_group *g);

/* Records a CUDA failure as a message for the caller's handle (set by the host side). */
megamoe_status mm_cuda_error(cudaError_t err, const char *what, const char *file, int line);
/* Records a failure that is not CUDA's (printf-style message) and returns st. */
megamoe_status mm_cuda_fail(megamoe_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The message of the last mm_cuda_error (host side, per thread). */
const char *mm_cuda_last_message(void);
/* Clears it, before a call whose failure message is read afterwards. */
void mm_cuda_clear_message(void);

/* v, opaque to the compiler's arithmetic (no instruction): what is computed from it stays computed from
 * it, e.g. addresses kept in registers rather than recomputed, or a * 8 kept a multiply-add rather
 * than rewritten into shifts and masks of what a came from. */
__device__ __forceinline__ void mm_opaque(uint32_t &v) { asm("" : "+r"(v)); }

/* One byte of two E2M1 codes -> an f16x2 of code * 2^-14 (low nibble in the low lane): sign to bit 15,
 * e1 e0 m to bits 11..9 of each lane. Exact; the 2^-14 returns in the GEMM epilogues. */
__device__ __forceinline__ uint32_t e2m1x2_to_f16x2_biased(uint32_t byte) {
    const uint32_t lo = ((byte & 0x8u) << 12) | ((byte & 0x7u) << 9);
    const uint32_t hi = ((byte & 0x80u) << 24) | ((byte & 0x70u) << 21);
    return lo | hi;
}

/* E4M3 bytes 2h and 2h + 1 of w -> an f16x2 (cvt.rn.f16x2.e4m3x2, exact). The half is named in the
 * PTX, so ptxas reads it in place (F2FP's .H1 operand) where a shift to the low half costs a SHF. */
__device__ __forceinline__ __half2 e4m3x2_to_half2(uint32_t w, int h) {
    uint32_t d;
    if (h == 0)
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(d) : "r"(w));
    else
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(d) : "r"(w));
    return *reinterpret_cast<const __half2 *>(&d);
}

__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, __half2 s) {
    __half2 r = __hmul2(*reinterpret_cast<__half2 *>(&a), s);
    return *reinterpret_cast<uint32_t *>(&r);
}

/* 8 E2M1 codes (4 bytes) times one E4M3 scale -> 8 f16 of code * 2^-14 * scale (exact, f16
 * subnormals included), as the activation operand of the gate/up GEMM. */
__device__ __forceinline__ uint4 decode8_biased(uint32_t codes, uint8_t sf) {
    const __half2_raw sr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)sf, __NV_E4M3);
    const __half2 s2 = __low2half2(*reinterpret_cast<const __half2 *>(&sr));
    uint4 v;
    v.x = hmul2_bits(e2m1x2_to_f16x2_biased(codes & 0xFFu), s2);
    v.y = hmul2_bits(e2m1x2_to_f16x2_biased((codes >> 8) & 0xFFu), s2);
    v.z = hmul2_bits(e2m1x2_to_f16x2_biased((codes >> 16) & 0xFFu), s2);
    v.w = hmul2_bits(e2m1x2_to_f16x2_biased(codes >> 24), s2);
    return v;
}

/* Warp-wide sum and max by butterfly shuffles (every lane gets the result, in a fixed order). */
__device__ __forceinline__ float mm_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}
__device__ __forceinline__ float mm_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}
#endif /* MEGAMOE_CUDA_COMMON_CUH */
