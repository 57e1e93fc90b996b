/*
 * dev_tma.cuh -- what the TMA / warpgroup-MMA experiments of dev/ share: 2D tensor maps with the
 * 128-byte swizzle (through the driver entry point, so no -lcuda), the 2D bulk tensor copy, the
 * shared-memory descriptor of a K-major 128-byte-swizzled operand, and the wgmma fences.
 * Not part of the library.
 */
#ifndef MEGAMOE_DEV_TMA_CUH
#define MEGAMOE_DEV_TMA_CUH

#include <cuda.h>
#include <cudaTypedefs.h>

#include "dev_util.cuh"

/* K-major operand in 128-byte swizzled shared memory (tile 1024-byte aligned): rows of 128 bytes,
 * 8-row groups 1024 bytes apart (SBO); LBO unused when swizzled; layout type 1 = 128B swizzle (bits
 * 62-63). Adding 2 to it advances 32 bytes (16 16-bit elements) along K within the swizzle atom. */
__device__ __forceinline__ uint64_t desc_sw128(const void *p) {
    const uint32_t a = mm_smem_u32(p);
    return (uint64_t)((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* Box (inner, outer) of the map at coordinates (inner, outer), completing on the mbarrier. */
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, int inner, int outer, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(mm_smem_u32(dst)), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(mm_smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

/* A [rows, K] matrix of 16-bit elements (K innermost) in boxes of 64 K x box_rows rows, 128-byte
 * swizzle: a box is a K-major wgmma operand for desc_sw128. */
static CUtensorMap tile_map_16bit(void *base, uint64_t rows, uint64_t K, uint32_t box_rows, CUtensorMapDataType type) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
    if (!encode) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !fn) {
            printf("cuTensorMapEncodeTiled not found\n");
            exit(1);
        }
        encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    CUtensorMap m;
    const cuuint64_t dims[2] = {K, rows}, strides[1] = {K * 2};
    const cuuint32_t box[2] = {64, box_rows}, estr[2] = {1, 1};
    const CUresult r = encode(&m, type, 2, base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled: error %d\n", (int)r);
        exit(1);
    }
    return m;
}

#endif /* MEGAMOE_DEV_TMA_CUH */
