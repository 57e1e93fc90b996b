/*
 * ptx/wgmma.cuh -- Hopper's warpgroup MMA (wgmma.mma_async, f32 accumulation, M = 64, K = 16): the
 * shared-memory matrix descriptors, the fence / commit / wait of a warpgroup's batch, and the two
 * operand forms the kernels use -- A from registers (RS: the mma.sync A fragments of weight_layout.h,
 * one warp's 16 rows each) and A from shared memory (SS: BF16 weights in core-matrix order). B is
 * always the token tile in shared memory. One asm definition per form (MM_WGMMA_RS_ASM,
 * MM_WGMMA_SS_ASM); the templates pick the instruction N and the 16-bit type.
 */
#ifndef MEGAMOE_PTX_WGMMA_CUH
#define MEGAMOE_PTX_WGMMA_CUH

#include <stdint.h>

/* Shared-memory matrix descriptor, no swizzle (dev/sm90_wgmma_probe.cu). */
__device__ __forceinline__ uint64_t smem_desc(const void *p, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}

/* K-major operand in 128-byte swizzled shared memory (1024-byte aligned): rows of 128 bytes, 8-row
 * groups 1024 bytes apart; +2 advances 32 bytes (one k16 step) within the swizzle atom. */
__device__ __forceinline__ uint64_t desc_sw128(const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* The "+f" operands of a wgmma accumulator in inline assembly: 8, 16, 32 or 64 floats from d[o]. */
#define MM_ACC8(d, o)                                                                                        \
    "+f"(d[(o) + 0]), "+f"(d[(o) + 1]), "+f"(d[(o) + 2]), "+f"(d[(o) + 3]), "+f"(d[(o) + 4]),                \
        "+f"(d[(o) + 5]), "+f"(d[(o) + 6]), "+f"(d[(o) + 7])
#define MM_ACC16(d, o) MM_ACC8(d, o), MM_ACC8(d, (o) + 8)
#define MM_ACC32(d, o) MM_ACC8(d, o), MM_ACC8(d, (o) + 8), MM_ACC8(d, (o) + 16), MM_ACC8(d, (o) + 24)
#define MM_ACC64(d) MM_ACC32(d, 0), MM_ACC32(d, 32)

/* The accumulator register lists of the PTX text, and the operand numbers after them. */
#define MM_WG_D8 "%0,%1,%2,%3,%4,%5,%6,%7"
#define MM_WG_D16 MM_WG_D8 ",%8,%9,%10,%11,%12,%13,%14,%15"
#define MM_WG_D32 MM_WG_D16 ",%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define MM_WG_D48 MM_WG_D32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
#define MM_WG_D64 MM_WG_D48 ",%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"

/* d (+)= A (64 x 16, this warp's 16 rows in a[4]) . B (N tokens x 16, descriptor db)^T; accumulate 0
 * overwrites d. N: the instruction's N; TYPE: "f16" or "bf16"; D: its accumulator list; A0: the
 * number of a[0] (then a[1..3], db, accumulate follow). */
#define MM_WGMMA_RS_ASM(N, TYPE, D, ACC, A0, A1, A2, A3, DB, P)                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                             \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TYPE "." TYPE " "                          \
                 "{" D "}, {%" A0 ",%" A1 ",%" A2 ",%" A3 "}, %" DB ", p, 1, 1, 0;\n}\n"                     \
                 : ACC                                                                                       \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate))

/* RS form: N 16, 32, 64 or 128 tokens; f16 (NVFP4's biased decode) or bf16 operands. */
template <int N, bool BF16>
__device__ __forceinline__ void wgmma_rs(float *d, const uint32_t *a, uint64_t db, int accumulate) {
    static_assert(N == 16 || N == 32 || N == 64 || N == 128, "instruction N");
    if constexpr (N == 16 && !BF16)
        MM_WGMMA_RS_ASM("16", "f16", MM_WG_D8, MM_ACC8(d, 0), "8", "9", "10", "11", "12", "13");
    else if constexpr (N == 16)
        MM_WGMMA_RS_ASM("16", "bf16", MM_WG_D8, MM_ACC8(d, 0), "8", "9", "10", "11", "12", "13");
    else if constexpr (N == 32 && !BF16)
        MM_WGMMA_RS_ASM("32", "f16", MM_WG_D16, MM_ACC16(d, 0), "16", "17", "18", "19", "20", "21");
    else if constexpr (N == 32)
        MM_WGMMA_RS_ASM("32", "bf16", MM_WG_D16, MM_ACC16(d, 0), "16", "17", "18", "19", "20", "21");
    else if constexpr (N == 64 && !BF16)
        MM_WGMMA_RS_ASM("64", "f16", MM_WG_D32, MM_ACC32(d, 0), "32", "33", "34", "35", "36", "37");
    else if constexpr (N == 64)
        MM_WGMMA_RS_ASM("64", "bf16", MM_WG_D32, MM_ACC32(d, 0), "32", "33", "34", "35", "36", "37");
    else if constexpr (!BF16)
        MM_WGMMA_RS_ASM("128", "f16", MM_WG_D64, MM_ACC64(d), "64", "65", "66", "67", "68", "69");
    else
        MM_WGMMA_RS_ASM("128", "bf16", MM_WG_D64, MM_ACC64(d), "64", "65", "66", "67", "68", "69");
}

/* SS form, BF16: d (+)= A (64 x 16 from shared memory, descriptor da) . B (N tokens x 16)^T. */
#define MM_WGMMA_SS_ASM(N, D, ACC, DA, DB, P)                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                             \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32.bf16.bf16 "                                  \
                 "{" D "}, %" DA ", %" DB ", p, 1, 1, 0, 0;\n}\n"                                            \
                 : ACC                                                                                       \
                 : "l"(da), "l"(db), "r"(accumulate))
template <int N>
__device__ __forceinline__ void wgmma_ss_bf16(float *d, uint64_t da, uint64_t db, int accumulate) {
    static_assert(N == 64 || N == 128, "instruction N");
    if constexpr (N == 128)
        MM_WGMMA_SS_ASM("128", MM_WG_D64, MM_ACC64(d), "64", "65", "66");
    else
        MM_WGMMA_SS_ASM("64", MM_WG_D32, MM_ACC32(d, 0), "32", "33", "34");
}

/* A warp's RS-wgmma A registers: [16-row group q][k16 step s][register] (2 groups per warp). */
using a_regs = uint32_t[2][4][4];
/* Makes the compiler keep registers (an RS wgmma's A operand) unchanged and live up to here. */
__device__ __forceinline__ void keep_alive(a_regs &a) {
#pragma unroll
    for (int q = 0; q < 2; q++)
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                asm volatile("" : "+r"(a[q][s][j])::"memory");
}

#endif /* MEGAMOE_PTX_WGMMA_CUH */
