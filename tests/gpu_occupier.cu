/*
 * gpu_occupier.cu -- for test_gpu: a kernel on its own stream that holds part of every SM (one block
 * of 128 threads and 16 KB of shared memory per SM) until the host releases it, so that a forward on
 * another stream has to finish with fewer of its blocks resident than its grid holds (issue 3: a
 * persistent kernel must not hang when another stream occupies SMs). Sized so that one block of
 * every forward kernel still fits beside it (16 KB of 228: the streaming kernel then has 3 of its 4
 * blocks per SM resident, the NVFP4 wgmma kernel 1 of 2; 2K registers: the 128-token BF16 wgmma
 * block of 58K registers still fits). The warp-specialized kernel's blocks take a whole SM's
 * registers and wait for the occupier to go (test_gpu.c says how that case is checked).
 */
#include <cuda_runtime.h>

#include "gpu_occupier.h"

#define OCC_THREADS 128
#define OCC_SMEM (16 * 1024)

/* flags[0]: set by the host to release; flags[1]: blocks that have started. Gives up by itself after
 * limit_ns, so a test that dies cannot leave it spinning. */
__global__ void __launch_bounds__(OCC_THREADS) occupier_kernel(volatile int *flags, unsigned long long limit_ns) {
    extern __shared__ int pad[];
    __shared__ int stop;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    if (threadIdx.x == 0) {
        pad[0] = 0;
        atomicAdd((int *)&flags[1], 1);
        __threadfence_system();
    }
    for (;;) { /* thread 0 polls the host word; the others wait at the barrier without issuing */
        if (threadIdx.x == 0) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            stop = flags[0] != 0 || t - t0 > limit_ns;
        }
        __syncthreads();
        if (stop) break;
        __syncthreads();
        if (threadIdx.x == 0) __nanosleep(10000);
    }
}

extern "C" int tu_occupier_start(tu_occupier *o) {
    int device = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) e = cudaHostAlloc((void **)&o->host_flags, 2 * sizeof(int), cudaHostAllocMapped);
    if (e != cudaSuccess) return (int)e;
    o->host_flags[0] = o->host_flags[1] = 0;
    o->blocks = sms;
    int *dev_flags = NULL;
    e = cudaHostGetDevicePointer((void **)&dev_flags, (void *)o->host_flags, 0);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&o->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) return (int)e;
    occupier_kernel<<<sms, OCC_THREADS, OCC_SMEM, o->stream>>>(dev_flags, 20ull * 1000 * 1000 * 1000);
    if ((e = cudaGetLastError()) != cudaSuccess) return (int)e;
    /* Every block resident before the forward is enqueued (at most 5 s). */
    for (int i = 0; i < 5000 && o->host_flags[1] < sms; i++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return o->host_flags[1] == sms ? 0 : -1;
}

extern "C" int tu_occupier_release(tu_occupier *o) {
    o->host_flags[0] = 1;
    cudaError_t e = cudaStreamSynchronize(o->stream);
    cudaStreamDestroy(o->stream);
    cudaFreeHost((void *)o->host_flags);
    return (int)e;
}
