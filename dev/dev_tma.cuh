/*
 * dev_tma.cuh -- what the TMA / warpgroup-MMA experiments of dev/ share: the SS wgmma m64n256 and a
 * tensor map that exits on failure; the 2D tensor maps and bulk tensor copy (ptx/mbarrier.cuh, ptx/bulk_copy.cuh), the
 * descriptors and wgmma fences (gemm/fragments.cuh) are the library's. Not part of the library.
 */
#ifndef MEGAMOE_DEV_TMA_CUH
#define MEGAMOE_DEV_TMA_CUH

#include "dev_util.cuh"
#include "gemm/fragments.cuh" /* with ptx/wgmma.cuh: */
#include "ptx/wgmma.cuh" /* desc_sw128, wgmma_fence / commit / wait (build with -Iinclude -Isrc -Isrc/cuda) */

/* d[128] (+)= A (64 x 16, shared memory, desc da) . B (256 x 16, shared memory, desc db)^T, both
 * K-major bf16, f32 accumulators (the m64n256 accumulator layout: thread t of the warpgroup holds rows
 * 16 (t / 32) + (t % 32) / 4 (+ 8), columns 8 j + 2 (t % 4) (+ 1) in d[4 j ...]). */
__device__ __forceinline__ void wgmma_256(float *d, uint64_t da, uint64_t db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 :
          MM_ACC64(d), MM_ACC32(d, 64), MM_ACC32(d, 96)
                 : "l"(da), "l"(db), "r"(accumulate));
}
/* The library's tensor map (mm_tile_map_16bit, ptx/mbarrier.cuh, ptx/bulk_copy.cuh), exiting on failure. */
static CUtensorMap tile_map_16bit(void *base, uint64_t rows, uint64_t K, uint32_t box_rows, CUtensorMapDataType type) {
    CUtensorMap m;
    const CUresult r = mm_tile_map_16bit(&m, base, rows, K, box_rows, type);
    if (r != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled: error %d\n", (int)r);
        exit(1);
    }
    return m;
}

#endif /* MEGAMOE_DEV_TMA_CUH */
