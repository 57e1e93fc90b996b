/*
 * sm90_async.cuh -- the mbarrier and bulk-copy (cp.async.bulk: TMA 1D, and 2D through a tensor map)
 * primitives of the streaming and warp-specialized GEMM kernels, shared with the experiments of dev/.
 * Shared memory at CTA scope; an arrive releases and a wait acquires (PTX defaults).
 */
#ifndef MEGAMOE_SM90_ASYNC_CUH
#define MEGAMOE_SM90_ASYNC_CUH

#include <cuda.h> /* CUtensorMap; the encoder comes through the runtime's driver entry point (no -lcuda) */
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t mm_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mm_mbar_init(uint64_t *b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mm_smem_u32(b)), "r"(count));
}
/* After the initializing thread's inits, before the block barrier that publishes them. */
__device__ __forceinline__ void mm_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* Arrives, expecting `bytes` more of asynchronous copies before the phase can complete. */
__device__ __forceinline__ void mm_mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mm_smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mm_mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(mm_smem_u32(b)) : "memory");
}
/* Waits until the phase of the given parity has completed. */
__device__ __forceinline__ void mm_mbar_wait_parity(uint64_t *b, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}\n" ::"r"(mm_smem_u32(b)),
                 "r"(parity)
                 : "memory");
}
/* Arrives and returns the phase state, then waits for that phase (the cuda::barrier way). */
__device__ __forceinline__ uint64_t mm_mbar_arrive_state(uint64_t *b) {
    uint64_t state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(mm_smem_u32(b)) : "memory");
    return state;
}
__device__ __forceinline__ void mm_mbar_wait_state(uint64_t *b, uint64_t state) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}\n" ::"r"(mm_smem_u32(b)),
                 "l"(state)
                 : "memory");
}
/* bytes (a multiple of 16, both addresses 16-byte aligned) from global to shared memory, counted
 * on the mbarrier's transaction count. */
__device__ __forceinline__ void mm_bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     mm_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(mm_smem_u32(bar))
                 : "memory");
}

/* bytes (a multiple of 16; both addresses 16-byte aligned) from shared to global memory by the
 * bulk copy engine (TMA 1D), in this thread's bulk async-group; mm_bulk_store_drain commits the group
 * and waits until its sources have been read (the shared memory may then be reused, or the block
 * exit: the writes complete by the grid's end, as with CUTLASS's TMA-store epilogues). */
__device__ __forceinline__ void mm_bulk_store(void *dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(mm_smem_u32(src)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mm_bulk_store_drain() {
    asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

/* The box of a 2D tensor map (CUtensorMap, passed as a __grid_constant__ kernel parameter) at
 * element coordinates (inner, outer) to shared memory, counted on the mbarrier's transaction count. */
__device__ __forceinline__ void mm_tma_load_2d(void *dst, const void *map, int inner, int outer, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(mm_smem_u32(dst)), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(mm_smem_u32(bar))
                 : "memory");
}

/* Host: a 2D tensor map of rows x K 16-bit elements at base (K innermost), in boxes of 64 K x box_rows
 * rows with the 128-byte swizzle (a box is a K-major wgmma operand for a 128-byte-swizzle
 * descriptor). CUDA_ERROR_NOT_FOUND when the driver has no encoder to give. */
static inline CUresult mm_tile_map_16bit(CUtensorMap *m, void *base, uint64_t rows, uint64_t K, uint32_t box_rows,
                                         CUtensorMapDataType type) {
    /* Looked up once (a thread-safe static: the CLI's NCCL ranks are threads). */
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
        const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
#else /* before 12.5: the unversioned lookup (the function's 12.0 form) */
        const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q);
#endif
        return e == cudaSuccess && q == cudaDriverEntryPointSuccess ? (PFN_cuTensorMapEncodeTiled_v12000)fn : NULL;
    }();
    if (!encode) return CUDA_ERROR_NOT_FOUND;
    const cuuint64_t dims[2] = {K, rows}, strides[1] = {K * 2};
    const cuuint32_t box[2] = {64, box_rows}, estr[2] = {1, 1};
    return encode(m, type, 2, base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

#endif /* MEGAMOE_SM90_ASYNC_CUH */
