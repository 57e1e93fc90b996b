/*
 * launch.h -- the CUDA backend's kernel launchers (host side), one per kernel or kernel family: each
 * takes the stream, launches, checks the launch. The forward calls them in the order of dispatch.cu,
 * whose opening table says which kernel runs when.
 */
#ifndef MEGAMOE_CUDA_LAUNCH_H
#define MEGAMOE_CUDA_LAUNCH_H

#include "common.cuh"
#include "gemm_plan.h" /* ROUTE_*, the plans the launchers follow */

/* ---- stage (sm90_stage.cu) and routing (sm90_route.cu, sm90_gather.cu) ------------------------- */

/* route_warp (plan_route ROUTE_WARP): the stage block's last warp builds the routing tables, and
 * sm90_route_launch is not called. */
megamoe_status sm90_stage_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *base,
                                 uint8_t *err_base, int rank, const mm_dev_rank_args &a, bool route_warp,
                                 cudaStream_t s);
/* The routing of a forward of total_tokens tokens in the whole group (gemm_plan.h plan_route). */
int sm90_route_plan(const mm_dev_shape &sh, long total_tokens);
/* The routing kernels of `route` (not ROUTE_WARP, which the stage kernel runs). */
megamoe_status sm90_route_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                 int route, long total_slots, cudaStream_t s);
/* Each routed slot's gate/up input into its rank's slot-ordered copy L.xg (for a forward with sh.gathered).
 */
megamoe_status sm90_gather_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                  cudaStream_t s);

/* ---- expert GEMMs (gemm_plan.h plans, dispatch.cu executes the plan; one file per kernel) -------- */

/* Once per device, before the first launch and outside stream capture: every built instance's
 * shared-memory opt-in; refuses a layer whose gemm_kernel (override_kernel) this build leaves out
 * (gemm_override_built). */
megamoe_status sm90_expert_gemm_prepare(int override_kernel, int nvfp4);
/* Both phases of a forward: desc -> plan_gemm -> the plan's gather, gate/up, act_f16, down. */
megamoe_status sm90_expert_gemm_launch(const mm_dev_shape &sh, const mm_buffer_layout &L,
                                       uint8_t *const *peers, uint8_t *base0, const mm_dev_weights *weights,
                                       int total_tokens, int override_kernel, cudaStream_t s);

/* What every GEMM launch passes its kernel besides the plan's launch: the forward's shape (gathered
 * set from the plan), the buffer layout, the peer table, local rank 0's buffer (the ws kernel's token
 * tensor map) and the local ranks' weights. */
struct mm_gemm_args {
    const mm_dev_shape &sh;
    const mm_buffer_layout &L;
    uint8_t *const *peers;
    uint8_t *base0;
    const mm_dev_weights *weights;
};
static inline dim3 gemm_grid(const gemm_launch &g) {
    return dim3((unsigned)g.grid[0], (unsigned)g.grid[1], (unsigned)g.grid[2]);
}
/* A launch whose instance the build left out (finalize refuses the gemm_kernel that reaches one). */
megamoe_status sm90_expert_gemm_unbuilt(const gemm_launch &g);

/* One launch of the plan (gemm_launch: kernel, instance, splits, grid), each family's launcher. */
megamoe_status sm90_expert_mma_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s);
megamoe_status sm90_expert_wgmma_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s);
megamoe_status sm90_expert_ws_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s);
megamoe_status sm90_expert_stream_launch(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s);
/* Each family's shared-memory opt-in, over its instance table. */
megamoe_status sm90_expert_mma_prepare();
megamoe_status sm90_expert_wgmma_prepare();
megamoe_status sm90_expert_ws_prepare();
megamoe_status sm90_expert_stream_prepare();

/* W4A16 (sh.bf16_act) only, between the phases: each slot row of act from bf16 to exact f16 times its
 * power of two, which goes into the row's slot_scale (sm90_act_f16.cu). max_rows bounds a rank's rows. */
megamoe_status sm90_act_f16_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                   long max_rows, cudaStream_t s);

/* ---- cross-rank barrier (sm90_barrier.cu) and combine (sm90_combine.cu) ------------------------- */

/* Every rank of the group arrives at and waits for the others (NCCL backend: ranks on other GPUs),
 * through flags in the symmetric buffers; a wait longer than timeout_ms sets the timeout word.
 * held < 0: one block, this process's rank. held >= 0 (the test hold, mm_test_hold_rank): one block per
 * local rank, and global rank `held` leaves without arriving. */
megamoe_status sm90_barrier_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                   int timeout_ms, int held, cudaStream_t s);
/* Opts the combine kernels in to the chunk sums' shared memory of a layer with top-k K and hidden size H. */
megamoe_status sm90_combine_prepare(int K, int H);
/* The combine of one rank in the form c (gemm_plan.h plan_combine of its token count). err_words /
 * host_err: given to the forward's last combine (the error words' hand-off), else NULL. */
megamoe_status sm90_combine_launch(const combine_plan &c, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                   const uint8_t *base, const float *gamma, const mm_dev_rank_args &a,
                                   uint8_t *err_words, uint8_t *host_err, cudaStream_t s);

#endif /* MEGAMOE_CUDA_LAUNCH_H */
