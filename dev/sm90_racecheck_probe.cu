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
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Isrc/cuda dev/sm90_racecheck_probe.cu -o /tmp/r
 *   for m in 0 1 2; do compute-sanitizer --tool racecheck /tmp/r $m; done
 */
#include <cuda/barrier>
#pragma nv_diag_suppress static_var_with_dynamic_init

#include "dev_util.cuh"

constexpr int SLOTS = 2, ROUNDS = 16, WORDS = 256;

/* waiters = 0: consumers wait on the phase parity without arriving (modes 0, 1); 1: lane 0 of each
 * waiting warp arrives and waits on its arrival's state, then __syncwarp (3, 4); 32: every lane
 * does (5). bulk: the producer fills a slot with one bulk copy instead of 32 lanes' stores. */
__global__ void handoff(const uint32_t *src, uint32_t *out, int bulk, int waiters) {
    __shared__ __align__(128) uint32_t ring[SLOTS][WORDS];
    __shared__ __align__(8) uint64_t full[SLOTS], empty[SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < SLOTS; i++)
            mm_mbar_init(&full[i], 1 + waiters), mm_mbar_init(&empty[i], waiters ? waiters + 1 : 1);
        mm_mbar_init_fence();
    }
    __syncthreads();
    const bool me = lane < waiters; /* this lane arrives on what it waits for */
    auto wait = [&](uint64_t *b, int parity) {
        if (!waiters) {
            mm_mbar_wait_parity(b, parity);
        } else {
            if (me) mm_mbar_wait_state(b, mm_mbar_arrive_state(b));
            __syncwarp();
        }
    };
    if (warp == 0) { /* producer; with waiters, lane 0 works the barriers */
        for (int n = 0; n < ROUNDS; n++) {
            const int s = n % SLOTS;
            if (n >= SLOTS) {
                if (!waiters) mm_mbar_wait_parity(&empty[s], ((n / SLOTS) - 1) & 1);
                else {
                    if (lane == 0) mm_mbar_wait_state(&empty[s], mm_mbar_arrive_state(&empty[s]));
                    __syncwarp();
                }
            }
            if (bulk) {
                if (lane == 0) {
                    mm_mbar_expect_tx(&full[s], WORDS * 4);
                    mm_bulk_copy(ring[s], src + n * WORDS, WORDS * 4, &full[s]);
                }
            } else {
                for (int i = lane; i < WORDS; i += 32) ring[s][i] = src[n * WORDS + i];
                __syncwarp();
                if (lane == 0) mm_mbar_arrive(&full[s]);
            }
        }
    } else { /* consumer */
        uint32_t acc = 0;
        for (int n = 0; n < ROUNDS; n++) {
            const int s = n % SLOTS;
            wait(&full[s], (n / SLOTS) & 1);
            for (int i = lane; i < WORDS; i += 32) acc += ring[s][i];
            __syncwarp();
            if (waiters ? me : lane == 0) mm_mbar_arrive(&empty[s]);
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
    else handoff<<<1, 64>>>(src, out, mode == 1 || mode >= 4, mode < 2 ? 0 : mode == 5 ? 32 : 1);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    uint32_t h[32], sum = 0;
    CK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
    for (uint32_t v : h) sum += v;
    printf("mode %d (%s): sum %u (expected %u)\n", mode, mode == 0 ? "PTX mbarrier, generic stores" : mode == 1 ? "PTX mbarrier, bulk copy" : mode == 2 ? "cuda::barrier" : mode == 3 ? "waiters arrive, generic stores" : mode == 4 ? "waiters arrive, bulk copy" : "every lane arrives, bulk copy",
           sum, (uint32_t)ROUNDS * WORDS * 0x01010101u);
    return 0;
}
