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
/* Whether the routing of a forward of total_slots slots writes L.tile_order (the tiles by tokens,
 * most first: gemm_plan.h tile_order_before), which the streaming kernel then walks. */
bool sm90_route_orders_tiles(const mm_dev_shape &sh, long total_slots);
/* Each routed slot's gate/up input into its rank's slot-ordered copy L.xg (for a forward with sh.gathered). */
megamoe_status sm90_gather_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                  cudaStream_t s);

/* ---- expert GEMMs (dispatch.cu chooses; one file per kernel) ------------------------------------ */

/* Once per device, before the first launch and outside stream capture: the kernels' shared-memory opt-in. */
megamoe_status sm90_expert_gemm_prepare();
/* Both phases of a forward: gather, gate/up, down, with the kernels gemm_plan.h chooses. */
megamoe_status sm90_expert_gemm_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, uint8_t *const *peers,
                                       uint8_t *base0, const mm_dev_weights *weights, int total_tokens, int force,
                                       cudaStream_t s);
/* The mma.sync kernel of one phase: grid (tiles, row blocks, local ranks x sp K splits). */
megamoe_status sm90_expert_mma_launch(int phase, dim3 grid, int sp, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                      uint8_t *const *peers, const mm_dev_weights *weights, int force, cudaStream_t s);
megamoe_status sm90_expert_mma_prepare();
/* The wgmma kernel of one phase over `tiles` token tiles of every local rank. */
megamoe_status sm90_expert_wgmma_launch(int phase, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                        uint8_t *const *peers, const mm_dev_weights *weights, int tiles, int splits,
                                        int force, cudaStream_t s);
megamoe_status sm90_expert_wgmma_prepare();
/* The warp-specialized kernel of one phase over `tiles` token tiles of every local rank, with blocks
 * of ntok (128: GEMM_WS, 64: GEMM_WS64) tokens. base0: local rank 0's buffer (the token tiles'
 * tensor map where the rows are slot-ordered and the process drives one rank). slots: the group's
 * slot count (with NCCL this rank's, a lower bound), for the form gemm_plan.h ws_split_n picks. */
megamoe_status sm90_expert_ws_launch(int phase, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                     uint8_t *const *peers, uint8_t *base0, const mm_dev_weights *weights, int tiles,
                                     int ntok, long slots, int force, cudaStream_t s);
megamoe_status sm90_expert_ws_prepare();
/* The streaming kernel of one phase (NVFP4), a persistent grid over the tiles of every local rank. */
megamoe_status sm90_expert_stream_launch(int phase, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                         uint8_t *const *peers, const mm_dev_weights *weights, int tiles, long slots,
                                         int force, cudaStream_t s);
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
/* err_words/host_err: given to the forward's last combine (the error words' hand-off), else NULL. */
megamoe_status sm90_combine_launch(const mm_dev_shape &sh, const mm_buffer_layout &L, const uint8_t *base,
                                   const float *gamma, const mm_dev_rank_args &a, uint8_t *err_words,
                                   uint8_t *host_err, cudaStream_t s);

#endif /* MEGAMOE_CUDA_LAUNCH_H */
