/*
 * sm90_stream_probe.cu -- an experiment, not part of the library: which way of streaming NVFP4
 * weights into an SM reaches HBM bandwidth in the decode regime, with no math in the way.
 *
 * Both expert GEMM kernels stream weights at ~2.0 TB/s of the 4.3 the copy engine reaches (DSv3,
 * T = 8..128, docs/BENCHMARKS.md), although ~97 KB per SM are in flight. This probe streams a 2 GB
 * buffer laid out like the kernel layout (per block step: 4096 B of codes, then elsewhere 512 B of
 * scales; each block its own contiguous run of steps, like one 128-row slab of one expert) and only
 * XORs what arrives, so the copy path alone is timed:
 *   A. cp.async, 16 B per lane, a ring of S steps per warp (the mma.sync kernel's path: 4 warps,
 *      each 2 x 512 B of codes + 2 x 64 B of scales per step);
 *   B. plain 16-byte loads into registers, D steps ahead (no shared memory);
 *   C. one bulk copy (cp.async.bulk, TMA 1D) of 4096 + 512 B per block step into a block ring of S
 *      slots, a producer warp and 4 consumer warps synchronized by mbarriers (no block barrier).
 * Swept: ring depth; runs of 112, 37 and 16 steps (a DSv3 gate/up slab whole, split 3 ways as at
 * T = 1, a down slab split 2 ways); a block per run (the GEMM kernels' grids, with their ramp-up per
 * block) or a persistent grid of 3 blocks per SM walking the runs back to back. Prints the best of 5
 * launches in GB/s against the 4276 GB/s copy ceiling.
 * Build and run on the GPU machine:
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 -Isrc/cuda dev/sm90_stream_probe.cu -o /tmp/s && /tmp/s
 */
#include "dev_util.cuh"


constexpr int CODES = 4096, SCALES = 512; /* bytes of one block step (128 rows x 64 K) */


/* A block streams the runs blockIdx.x, blockIdx.x + gridDim.x, ... (runs of `steps` block steps,
 * contiguous in memory) back to back: one run per block when the grid has a block per run (like the
 * GEMM kernels' grids), several when the grid is persistent (a few blocks per SM). */
struct schedule {
    int steps, total; /* steps per run, steps of this block */
    __device__ schedule(int runs, int steps_) : steps(steps_) {
        const int mine = blockIdx.x < runs ? (runs - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
        total = mine * steps;
    }
    __device__ size_t index(int j) const { /* global step of this block's j-th step */
        return ((size_t)blockIdx.x + (size_t)(j / steps) * gridDim.x) * steps + j % steps;
    }
};

/* ---- A: cp.async per warp ---------------------------------------------------------------------- */
template <int S>
__global__ void __launch_bounds__(128) stream_cp_async(const uint8_t *codes, const uint8_t *scales, int runs,
                                                       int run_steps, uint32_t *sink) {
    extern __shared__ __align__(128) uint8_t ring[]; /* 4 warps x S x 1152 */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const schedule sc(runs, run_steps);
    const int steps = sc.total;
    uint8_t *mine = ring + warp * S * 1152;
    auto issue = [&](int st) {
        if (st < steps) {
            const uint8_t *c = codes + sc.index(st) * CODES + warp * 1024;
            const uint8_t *s = scales + sc.index(st) * SCALES + warp * 128;
            uint8_t *slot = mine + (st % S) * 1152;
            for (int q = 0; q < 2; q++) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(mm_smem_u32(slot + q * 576 + lane * 16)),
                             "l"(c + q * 512 + lane * 16));
                if (lane < 8)
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(mm_smem_u32(slot + q * 576 + 512 + lane * 8)),
                                 "l"(s + q * 64 + lane * 8));
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    for (int st = 0; st < S - 1; st++) issue(st);
    uint32_t acc = 0;
    for (int st = 0; st < steps; st++) {
        __syncwarp();
        issue(st + S - 1);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 1));
        __syncwarp();
        const uint8_t *slot = mine + (st % S) * 1152;
        for (int q = 0; q < 2; q++) {
            const uint4 v = *(const uint4 *)(slot + q * 576 + lane * 16);
            const uint2 w = *(const uint2 *)(slot + q * 576 + 512 + (lane >> 2) * 8);
            acc ^= v.x ^ v.y ^ v.z ^ v.w ^ w.x ^ w.y;
        }
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

/* ---- B: registers ------------------------------------------------------------------------------ */
template <int D>
__global__ void __launch_bounds__(128) stream_regs(const uint8_t *codes, const uint8_t *scales, int runs,
                                                   int run_steps, uint32_t *sink) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const schedule sc(runs, run_steps);
    const int steps = sc.total;
    uint4 v[D][2];
    uint2 w[D][2];
    auto load = [&](int st, uint4 (&vv)[2], uint2 (&ww)[2]) {
        const uint8_t *c = codes + sc.index(st) * CODES + warp * 1024;
        const uint8_t *s = scales + sc.index(st) * SCALES + warp * 128;
        for (int q = 0; q < 2; q++) {
            vv[q] = __ldg((const uint4 *)(c + q * 512) + lane);
            ww[q] = __ldg((const uint2 *)(s + q * 64) + (lane >> 2));
        }
    };
#pragma unroll
    for (int d = 0; d < D; d++) load(d < steps ? d : 0, v[d], w[d]);
    uint32_t acc = 0;
    for (int st = 0; st < steps; st += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            if (st + d >= steps) break;
            for (int q = 0; q < 2; q++) acc ^= v[d][q].x ^ v[d][q].y ^ v[d][q].z ^ v[d][q].w ^ w[d][q].x ^ w[d][q].y;
            if (st + d + D < steps) load(st + d + D, v[d], w[d]);
        }
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

/* ---- C: one bulk copy per block step, mbarriers -------------------------------------------------- */
template <int S>
__global__ void __launch_bounds__(160) stream_bulk(const uint8_t *codes, const uint8_t *scales, int runs,
                                                   int run_steps, uint32_t *sink) {
    extern __shared__ __align__(128) uint8_t ring[]; /* S x (4096 + 512) */
    __shared__ __align__(8) uint64_t full[S], empty[S];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const schedule sc(runs, run_steps);
    const int steps = sc.total;
    if (threadIdx.x == 0) {
        for (int i = 0; i < S; i++) mm_mbar_init(&full[i], 1), mm_mbar_init(&empty[i], 4);
        mm_mbar_init_fence();
    }
    __syncthreads();
    if (warp == 4) { /* producer */
        if (lane == 0)
            for (int st = 0; st < steps; st++) {
                const int slot = st % S;
                if (st >= S) mm_mbar_wait_parity(&empty[slot], ((st / S) - 1) & 1);
                mm_mbar_expect_tx(&full[slot], CODES + SCALES);
                uint8_t *dst = ring + slot * (CODES + SCALES);
                mm_bulk_copy(dst, codes + sc.index(st) * CODES, CODES, &full[slot]);
                mm_bulk_copy(dst + CODES, scales + sc.index(st) * SCALES, SCALES, &full[slot]);
            }
        return;
    }
    uint32_t acc = 0;
    for (int st = 0; st < steps; st++) {
        const int slot = st % S;
        mm_mbar_wait_parity(&full[slot], (st / S) & 1);
        const uint8_t *src = ring + slot * (CODES + SCALES);
        for (int q = 0; q < 2; q++) {
            const uint4 v = *(const uint4 *)(src + warp * 1024 + q * 512 + lane * 16);
            const uint2 w = *(const uint2 *)(src + CODES + warp * 128 + q * 64 + (lane >> 2) * 8);
            acc ^= v.x ^ v.y ^ v.z ^ v.w ^ w.x ^ w.y;
        }
        __syncwarp();
        if (lane == 0) mm_mbar_arrive(&empty[slot]);
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

/* ---- driver -------------------------------------------------------------------------------------- */
template <typename F>
static void time_it(const char *name, F launch, size_t bytes) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int i = 0; i < 5; i++) {
        CK(cudaEventRecord(a));
        launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        best = ms < best ? ms : best;
    }
    printf("%-48s %7.1f GB/s  (%.0f%% of 4276)\n", name, bytes / (best * 1e-3) / 1e9, bytes / (best * 1e-3) / 1e9 / 42.76);
    cudaEventDestroy(a), cudaEventDestroy(b);
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    /* 2 GB of codes (+ 1/8 of scales) in block steps of 4096 + 512 B. */
    const size_t total_steps = (size_t)2 * 1024 * 1024 * 1024 / CODES;
    uint8_t *codes, *scales;
    uint32_t *sink;
    CK(cudaMalloc(&codes, total_steps * CODES));
    CK(cudaMalloc(&scales, total_steps * SCALES));
    CK(cudaMalloc(&sink, total_steps * 160 * 4 / 16 + 160 * 4 * 8 * sms));
    CK(cudaMemset(codes, 0x5A, total_steps * CODES));
    CK(cudaMemset(scales, 0x33, total_steps * SCALES));
    const size_t bytes = total_steps * (CODES + SCALES);
    printf("%d SMs, %.2f GB streamed per run\n", sms, bytes / 1e9);
    char name[128];
    /* Runs of 112 steps (one DSv3 gate/up slab, K = 7168), 37 (the same split 3 ways, as at T = 1) and
     * 16 (a DSv3 down slab split 2 ways); a block per run, or a persistent grid of 3 blocks per SM. */
    const int run_lengths[3] = {112, 37, 16};
    for (int li = 0; li < 3; li++) {
        const int steps = run_lengths[li], runs = (int)(total_steps / steps);
        const size_t used = (size_t)runs * steps * (CODES + SCALES);
        for (int persistent = 0; persistent < 2; persistent++) {
            const int grid = persistent ? 3 * sms : runs;
            const char *how = persistent ? "persistent" : "block/run";
#define RUN_A(S)                                                                                          \
    do {                                                                                                  \
        const int smem = 4 * (S) * 1152;                                                                  \
        CK(cudaFuncSetAttribute(stream_cp_async<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));  \
        snprintf(name, sizeof name, "run %3d %-10s A cp.async per warp, %2d stages", steps, how, S);     \
        time_it(name, [&] { stream_cp_async<S><<<grid, 128, smem>>>(codes, scales, runs, steps, sink); }, used); \
    } while (0)
            RUN_A(4);
            RUN_A(8);
            RUN_A(16);
#define RUN_B(D)                                                                                          \
    do {                                                                                                  \
        snprintf(name, sizeof name, "run %3d %-10s B registers, %d steps ahead", steps, how, D);         \
        time_it(name, [&] { stream_regs<D><<<grid, 128>>>(codes, scales, runs, steps, sink); }, used);    \
    } while (0)
            RUN_B(2);
            RUN_B(4);
#define RUN_C(S)                                                                                          \
    do {                                                                                                  \
        const int smem = (S) * (CODES + SCALES);                                                          \
        CK(cudaFuncSetAttribute(stream_bulk<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));      \
        snprintf(name, sizeof name, "run %3d %-10s C bulk copy per block step, %2d slots", steps, how, S);\
        time_it(name, [&] { stream_bulk<S><<<grid, 160, smem>>>(codes, scales, runs, steps, sink); }, used); \
    } while (0)
            RUN_C(4);
            RUN_C(8);
            RUN_C(16);
        }
    }
    /* The reference: a device-to-device copy of the same bytes (counted read + write, as DEVICE.md). */
    uint8_t *dst;
    CK(cudaMalloc(&dst, total_steps * CODES));
    time_it("cudaMemcpy D2D (read + write bytes)", [&] { CK(cudaMemcpyAsync(dst, codes, total_steps * CODES, cudaMemcpyDeviceToDevice)); },
            2 * total_steps * CODES);
    cudaFree(dst), cudaFree(codes), cudaFree(scales), cudaFree(sink);
    return 0;
}
