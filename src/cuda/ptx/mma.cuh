/*
 * ptx/mma.cuh -- the warp-level tensor-core instructions: mma.sync m16n8k16 with f32 accumulation
 * (f16 for NVFP4's biased decode, bf16 for BF16 weights) and ldmatrix.x4 (four 8 x 8 matrices of
 * 16-bit values from shared memory, in the mma.sync fragment order), and plain shared loads by 32-bit
 * address.
 */
#ifndef MEGAMOE_PTX_MMA_CUH
#define MEGAMOE_PTX_MMA_CUH

#include <stdint.h>

/* d[4] += A (16 x 16, a[4]) . B (16 x 8, b0 b1), f32 accumulators. */
template <bool BF16>
__device__ __forceinline__ void mma_m16n8k16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1) {
    if constexpr (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

/* Four 8 x 8 matrices of 16-bit values: lane l gives the shared address of row l & 7 of matrix l >> 3;
 * thread (g, c) receives row g, columns 2c, 2c + 1 of matrix j in r[j]. */
__device__ __forceinline__ void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                            uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

/* 16 and 8 bytes from a shared address: for operands whose addresses a kernel keeps as 32-bit values
 * (volatile, like ldmatrix_x4: they stay after the mbarrier wait that releases the bytes). */
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}
__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}

#endif /* MEGAMOE_PTX_MMA_CUH */
