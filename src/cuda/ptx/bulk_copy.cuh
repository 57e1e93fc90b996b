/*
 * ptx/bulk_copy.cuh -- the bulk copy engine (TMA): 1D copies global -> shared completed on an
 * mbarrier's transaction count, 1D stores shared -> global in bulk async-groups, 2D loads through a
 * tensor map, and the host encoder of the 16-bit tile maps.
 */
#ifndef MEGAMOE_PTX_BULK_COPY_CUH
#define MEGAMOE_PTX_BULK_COPY_CUH

#include <cuda.h> /* CUtensorMap; the encoder comes through the runtime's driver entry point (no -lcuda) */
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mbarrier.cuh" /* mm_smem_u32 */

/* bytes (a multiple of 16, both addresses 16-byte aligned) from global to shared memory, counted
 * on the mbarrier's transaction count. */
__device__ __forceinline__ void mm_bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            mm_smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(mm_smem_u32(bar))
        : "memory");
}

/* bytes (a multiple of 16; both addresses 16-byte aligned) from shared to global memory by the
 * bulk copy engine (TMA 1D), in this thread's bulk async-group; mm_bulk_store_drain commits the group
 * and waits until its sources have been read (the shared memory may then be reused, or the block
 * exit: the writes complete by the grid's end, as with CUTLASS's TMA-store epilogues). */
__device__ __forceinline__ void mm_bulk_store(void *dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(mm_smem_u32(src)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mm_bulk_store_drain() {
    asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

/* The box of a 2D tensor map (CUtensorMap, passed as a __grid_constant__ kernel parameter) at
 * element coordinates (inner, outer) to shared memory, counted on the mbarrier's transaction count. */
__device__ __forceinline__ void mm_tma_load_2d(void *dst, const void *map, int inner, int outer,
                                               uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
                 "{%2, %3}], [%4];\n" ::"r"(mm_smem_u32(dst)),
                 "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(mm_smem_u32(bar))
                 : "memory");
}

/* Host: a 2D tensor map of rows x K 16-bit elements at base (K innermost), in boxes of 64 K x box_rows
 * rows with the 128-byte swizzle (a box is a K-major wgmma operand for a 128-byte-swizzle
 * descriptor). CUDA_ERROR_NOT_FOUND when the driver has no encoder to give. */
static inline CUresult mm_tile_map_16bit(CUtensorMap *m, void *base, uint64_t rows, uint64_t K,
                                         uint32_t box_rows, CUtensorMapDataType type) {
    /* Looked up once (a thread-safe static: the CLI's NCCL ranks are threads). */
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
        const cudaError_t e =
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
#else /* before 12.5: the unversioned lookup (the function's 12.0 form) */
        const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q);
#endif
        return e == cudaSuccess && q == cudaDriverEntryPointSuccess ? (PFN_cuTensorMapEncodeTiled_v12000)fn
                                                                    : NULL;
    }();
    if (!encode) return CUDA_ERROR_NOT_FOUND;
    const cuuint64_t dims[2] = {K, rows}, strides[1] = {K * 2};
    const cuuint32_t box[2] = {64, box_rows}, estr[2] = {1, 1};
    return encode(m, type, 2, base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

#endif /* MEGAMOE_PTX_BULK_COPY_CUH */
