/*
 * trace.cuh -- timestamps of the kernels around the expert GEMMs (the stage kernel with its routing
 * block, the combine), in the development build -DMM_STREAM_TRACE=1 only (the default build has
 * none of it). The table lives in sm90_expert_stream.cu, whose exit report prints it beside the
 * streaming kernel's timeline (same origin: the first gate/up block's entry). Each translation unit
 * that stamps holds its own constant pointer to the table, set by its *_trace_bind (host).
 */
#pragma once
#include <cuda_runtime.h>

#ifndef MM_STREAM_TRACE
#define MM_STREAM_TRACE 0
#endif

#define MM_KTRACE_BLOCKS 64
enum { MM_K_STAGE, MM_K_COMBINE, MM_K_KERNELS };
/* The stage kernel's finer stamps (after MM_KT_EXIT): its token's amax known; its routing block's
 * staged slots read, experts counted, tiles written. */
enum { MM_KT_ENTRY, MM_KT_WAITED, MM_KT_MID, MM_KT_EXIT, MM_KT_AMAX, MM_KT_R_READ, MM_KT_R_COUNTED, MM_KT_R_TILES,
       MM_KT_EVENTS };

#if MM_STREAM_TRACE
static __constant__ unsigned long long *mm_ktrace_table; /* [MM_K_KERNELS][MM_KTRACE_BLOCKS][MM_KT_EVENTS] */
/* Thread 0 of blocks < MM_KTRACE_BLOCKS: %globaltimer (ns) for event ev of kernel k (the last forward's). */
__device__ __forceinline__ void mm_kstamp(int k, int ev) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (threadIdx.x != 0 || blockIdx.x >= MM_KTRACE_BLOCKS || !mm_ktrace_table) return;
    unsigned long long *row = mm_ktrace_table + ((size_t)k * MM_KTRACE_BLOCKS + blockIdx.x) * MM_KT_EVENTS;
    if (ev == MM_KT_ENTRY) /* a new forward: the block's stamps of the last one cleared (exit is the routing block's only) */
        for (int i = 1; i < MM_KT_EVENTS; i++) row[i] = 0;
    row[ev] = t;
}
static inline cudaError_t mm_ktrace_bind_here(unsigned long long *table) {
    return cudaMemcpyToSymbol(mm_ktrace_table, &table, sizeof table);
}
#define MM_KSTAMP(k, ev) mm_kstamp(k, ev)
#else
#define MM_KSTAMP(k, ev) ((void)0)
#endif
