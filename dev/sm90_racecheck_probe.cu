/*
 * sm90_racecheck_probe.cu -- an experiment, not part of the library: does compute-sanitizer's
 * racecheck see mbarrier hand-offs as synchronization? The streaming GEMM kernel
 * (src/cuda/sm90_expert_stream.cu) passes shared memory between a producer warp and consumer warps
 * through mbarriers only, and racecheck reports hazards on it. Three minimal hand-offs, one per run
 * (argv[1] = 0, 1, 2), each correct by the PTX memory model:
 *   0: producer warp writes shared memory, arrives (release); consumer warp waits on the phase
 *      parity (acquire) and reads; then the reverse for the slot's reuse (a ring of 2 slots);
 *   1: the same with the data brought by a bulk copy (cp.async.bulk) completing on the mbarrier;
 *   2: the same as 0 with cuda::barrier (libcu++) arrive/wait instead of inline PTX;
 *   3, 4: as 0 and 1, but every waiter also arrives on the barrier it waits for and waits on the
 *      state its arrival returned (as cuda::barrier does), lane 0 for its warp, then __syncwarp;
 *   5: as 4 with every lane arriving and waiting.
 * Build and run on the GPU machine:
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 dev/sm90_racecheck_probe.cu -o /tmp/r
 *   for m in 0 1 2; do compute-sanitizer --tool racecheck /tmp/r $m; done
 */
#include <cuda/barrier>
#pragma nv_diag_suppress static_var_with_dynamic_init

#include "dev_util.cuh"

constexpr int SLOTS = 2, ROUNDS = 16, WORDS = 256;

__global__ void ptx_handoff(const uint32_t *src, uint32_t *out, int bulk) {
    __shared__ __align__(128) uint32_t ring[SLOTS][WORDS];
    __shared__ __align__(8) uint64_t full[SLOTS], empty[SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < SLOTS; i++) mbar_init(&full[i], 1), mbar_init(&empty[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) { /* producer */
        for (int n = 0; n < ROUNDS; n++) {
            const int s = n % SLOTS;
            if (n >= SLOTS) mbar_wait(&empty[s], ((n / SLOTS) - 1) & 1);
            if (bulk) {
                if (lane == 0) {
                    mbar_expect_tx(&full[s], WORDS * 4);
                    bulk_copy(ring[s], src + n * WORDS, WORDS * 4, &full[s]);
                }
            } else {
                for (int i = lane; i < WORDS; i += 32) ring[s][i] = src[n * WORDS + i];
                __syncwarp();
                if (lane == 0) mbar_arrive(&full[s]);
            }
        }
    } else { /* consumer */
        uint32_t acc = 0;
        for (int n = 0; n < ROUNDS; n++) {
            const int s = n % SLOTS;
            mbar_wait(&full[s], (n / SLOTS) & 1);
            for (int i = lane; i < WORDS; i += 32) acc += ring[s][i];
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[s]);
        }
        out[lane] = acc;
    }
}

__device__ __forceinline__ uint64_t arrive_state(uint64_t *b) {
    uint64_t st;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(st) : "r"(smem_u32(b)) : "memory");
    return st;
}
__device__ __forceinline__ void wait_state(uint64_t *b, uint64_t st) {
    asm volatile("{\n.reg .pred p;\nW_%=:\n"
                 "mbarrier.try_wait.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra W_%=;\n}\n" ::"r"(smem_u32(b)),
                 "l"(st)
                 : "memory");
}

/* Modes 3-5: waiters take part in the phase they wait for. */
__global__ void token_handoff(const uint32_t *src, uint32_t *out, int bulk, int all_lanes) {
    __shared__ __align__(128) uint32_t ring[SLOTS][WORDS];
    __shared__ __align__(8) uint64_t full[SLOTS], empty[SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int waiters = all_lanes ? 32 : 1;
    if (threadIdx.x == 0) {
        for (int i = 0; i < SLOTS; i++) mbar_init(&full[i], 1 + waiters), mbar_init(&empty[i], waiters + 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const bool me = all_lanes || lane == 0;
    if (warp == 0) { /* producer: lane 0 works the barriers */
        for (int n = 0; n < ROUNDS; n++) {
            const int s = n % SLOTS;
            if (n >= SLOTS && lane == 0) wait_state(&empty[s], arrive_state(&empty[s]));
            __syncwarp();
            if (bulk) {
                if (lane == 0) {
                    mbar_expect_tx(&full[s], WORDS * 4);
                    bulk_copy(ring[s], src + n * WORDS, WORDS * 4, &full[s]);
                }
            } else {
                for (int i = lane; i < WORDS; i += 32) ring[s][i] = src[n * WORDS + i];
                __syncwarp();
                if (lane == 0) mbar_arrive(&full[s]);
            }
        }
    } else {
        uint32_t acc = 0;
        for (int n = 0; n < ROUNDS; n++) {
            const int s = n % SLOTS;
            if (me) wait_state(&full[s], arrive_state(&full[s]));
            __syncwarp();
            for (int i = lane; i < WORDS; i += 32) acc += ring[s][i];
            __syncwarp();
            if (me) mbar_arrive(&empty[s]);
        }
        out[lane] = acc;
    }
}

__global__ void libcu_handoff(const uint32_t *src, uint32_t *out) {
    using barrier = cuda::barrier<cuda::thread_scope_block>;
    __shared__ uint32_t ring[SLOTS][WORDS];
    __shared__ barrier full[SLOTS], empty[SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0)
        for (int i = 0; i < SLOTS; i++) init(&full[i], 64), init(&empty[i], 64);
    __syncthreads();
    uint32_t acc = 0;
    for (int n = 0; n < ROUNDS; n++) {
        const int s = n % SLOTS;
        if (warp == 0) {
            if (n >= SLOTS) empty[s].arrive_and_wait();
            for (int i = lane; i < WORDS; i += 32) ring[s][i] = src[n * WORDS + i];
            (void)full[s].arrive();
        } else {
            full[s].arrive_and_wait();
            for (int i = lane; i < WORDS; i += 32) acc += ring[s][i];
            if (n + SLOTS < ROUNDS) (void)empty[s].arrive();
        }
    }
    if (warp == 1) out[lane] = acc;
}

int main(int argc, char **argv) {
    const int mode = argc > 1 ? atoi(argv[1]) : 0;
    uint32_t *src, *out;
    CK(cudaMalloc(&src, ROUNDS * WORDS * 4));
    CK(cudaMalloc(&out, 32 * 4));
    CK(cudaMemset(src, 1, ROUNDS * WORDS * 4));
    if (mode == 2) libcu_handoff<<<1, 64>>>(src, out);
    else if (mode >= 3) token_handoff<<<1, 64>>>(src, out, mode != 3, mode == 5);
    else ptx_handoff<<<1, 64>>>(src, out, mode);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    uint32_t h[32], sum = 0;
    CK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    for (uint32_t v : h) sum += v;
    printf("mode %d (%s): sum %u (expected %u)\n", mode, mode == 0 ? "PTX mbarrier, generic stores" : mode == 1 ? "PTX mbarrier, bulk copy" : mode == 2 ? "cuda::barrier" : mode == 3 ? "waiters arrive, generic stores" : mode == 4 ? "waiters arrive, bulk copy" : "every lane arrives, bulk copy",
           sum, (uint32_t)ROUNDS * WORDS * 0x01010101u);
    return 0;
}
