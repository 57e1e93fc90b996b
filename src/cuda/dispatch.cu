/*
 * dispatch.cu -- which kernel runs when. A forward enqueues, on the caller's stream (backend.cu):
 *
 *   stage      sm90_stage.cu    one block per token: ids, token state, NVFP4 quantization / BF16 copy
 *   route      one of (sm90_stage.cu / sm90_route.cu; gemm_plan.h plan_route, from the group's slots S):
 *                one process, 1 token, R = 1    the stage block's last warp      (route_one_warp)
 *                one process, S <= 1024         one kernel, a block per expert   (sm90_route_small_kernel)
 *                else, E_r <= 1024              count / scan / fill over chunks  (sm90_route_chunk_*)
 *                else                           count / tiles / fill per expert  (sm90_route_*_kernel)
 *              (E_r <= 1024 for the warp, <= 8192 for the one kernel; all write the same tables)
 *   barrier    sm90_barrier.cu  NCCL only: every rank's tokens staged
 *   gather     sm90_gather.cu   where the rows are gathered (across GPUs; one GPU when ws / ws64 take gate/up)
 *   gate/up, down: the expert GEMMs, chosen below (gemm_plan.h gemm_choice), per phase; between
 *              them, for NVFP4 weights with bf16 activations (W4A16), sm90_act_f16.cu: act to f16
 *   barrier    sm90_barrier.cu  NCCL only: every p written
 *   combine    sm90_combine.cu  per token; a cluster of 8 blocks per token up to 16 tokens of a rank
 *
 * The expert GEMM of a phase, from the group's slots per expert n = S / E (both phases take the same
 * kernel unless one of them plans a K split where the other does not) and min_k = min(H, I):
 *
 *   format  n                                    kernel (file)                          split-K
 *   NVFP4   n <= 16                              streaming   (sm90_expert_stream.cu)    plan_stream_splits
 *   NVFP4   16 < n < 64, min_k >= 4096           ws64        (sm90_expert_ws.cu, N 64)  none
 *   NVFP4   16 < n, otherwise below ws           wgmma       (sm90_expert_wgmma.cu)     plan_wgmma_splits
 *   NVFP4   n >= 64                              ws          (sm90_expert_ws.cu, N 128) none
 *           (n < 128: the N 128 as 64 + 32 + 32, the parts past an item's tokens skipped: ws_split_n)
 *   BF16    n < 4                                mma.sync    (sm90_expert_mma.cu)       plan_splitk
 *   BF16    n >= 4 (n >= 64 with a split planned) ws64                                  none
 *   BF16    n >= 64, no split planned            ws                                     none
 *
 * megamoe_layer_config.gemm_kernel forces one kernel for every phase (tests, benchmarks). The
 * streaming kernel runs one of five instantiations per phase (gemm_plan.h plan_stream_variant: the
 * grouped layout from 4 slots per expert, on 32-token chunks above 8, one block per SM more, the K
 * loop not unrolled). Every choice is a function of the group's slot count and the shape only
 * (never of R or of which rank computes), so y is bitwise the same for any R and number of GPUs. One
 * process knows S and launches exactly the chosen kernel; with NCCL a rank knows only its own count,
 * launches every kernel the group's count may choose, and each kernel's blocks leave at once unless
 * gemm_choice on the device (from every rank's staged count) names it.
 */
#include "gemm/fragments.cuh"
#include "launch.h"

/* One phase: the few-token kernel `kernel` names (mma.sync or streaming), then wgmma when `wgmma`
 * (with wsp K splits per rank in its grid, NVFP4), then the warp-specialized kernels when `ws64`
 * (64-token blocks) and `ws`. */
template <int PH>
static megamoe_status launch_phase(int kernel, bool wgmma, bool ws64, bool ws, int wsp, dim3 grid, int sp, int tiles,
                                   long slots, const mm_dev_shape &sh, const mm_buffer_layout &L,
                                   uint8_t *const *peers, uint8_t *base0, const mm_dev_weights *weights, int force,
                                   cudaStream_t s) {
    megamoe_status st = MEGAMOE_OK;
    if (kernel == GEMM_MMA) st = sm90_expert_mma_launch(PH, grid, sp, sh, L, peers, weights, force, s);
    if (kernel == GEMM_STREAM) st = sm90_expert_stream_launch(PH, sh, L, peers, weights, tiles, slots, force, s);
    if (st == MEGAMOE_OK && wgmma) st = sm90_expert_wgmma_launch(PH, sh, L, peers, weights, tiles, wsp, force, s);
    if (st == MEGAMOE_OK && ws64) st = sm90_expert_ws_launch(PH, sh, L, peers, base0, weights, tiles, 64, slots, force, s);
    if (st == MEGAMOE_OK && ws) st = sm90_expert_ws_launch(PH, sh, L, peers, base0, weights, tiles, 128, slots, force, s);
    return st;
}

megamoe_status sm90_expert_gemm_launch(const mm_dev_shape &sh_in, const mm_buffer_layout &L, uint8_t *const *peers,
                                       uint8_t *base0, const mm_dev_weights *weights, int total_tokens, int force,
                                       cudaStream_t s) {
    if (L.max_tiles <= 0) return MEGAMOE_OK;
    mm_dev_shape sh = sh_in; /* gathered: decided below */
    /* Single process: the host knows the group's token count and plans exactly as the kernels will.
     * NCCL: it knows only its own count, a lower bound of the group's, so it launches the most splits
     * the kernels may plan for any count from there up, the bound of tiles sized for T_max, and each
     * GEMM kernel unless the bounds rule it out; the kernels keep what the group's count plans. */
    const bool nccl = sh.local_ranks < sh.R;
    const long slots = (long)total_tokens * sh.K;
    const int y_gate_up = 2 * sh.I / MM_MMA_ROWS, y_down = sh.H / MM_MMA_ROWS;
    const splitk_plan p1 = plan_splitk(slots, sh.E, y_gate_up, sh.H / BK), p2 = plan_splitk(slots, sh.E, y_down, sh.I / BK);
    const int w1 = splitk_wanted(slots, sh.E, y_gate_up, sh.H / BK), w2 = splitk_wanted(slots, sh.E, y_down, sh.I / BK);
    const int sp1 = nccl ? (w1 > 1 ? w1 : 1) : p1.splits, sp2 = nccl ? (w2 > 1 ? w2 : 1) : p2.splits;
    /* A rank has at most ws_tiles tiles: launching max_tiles (sized for T_max) would schedule
     * thousands of blocks that only read the tile count and exit, ~0.2 ms at T = 1. */
    const int tiles = nccl || L.max_tiles < p1.ws_tiles ? L.max_tiles : p1.ws_tiles;
    if (tiles <= 0) return MEGAMOE_OK;
    const dim3 grid_gate_up(tiles, y_gate_up, sh.local_ranks * sp1), grid_down(tiles, y_down, sh.local_ranks * sp2);
    /* Which kernel runs each phase: exactly as the kernels will decide in one process. With NCCL a
     * kernel is launched unless ruled out (the others leave at once): the few-token kernel (mma.sync,
     * or the streaming kernel for NVFP4) when wgmma is certain (this rank's count already plans one
     * split and reaches the threshold), wgmma when even every rank at T_max stays under it. */
    const bool nv = sh.nvfp4 != 0;
    const int mk = sh.H < sh.I ? sh.H : sh.I;
    const int k1 = gemm_choice(force, slots, sh.E, sp1, nv, mk), k2 = gemm_choice(force, slots, sh.E, sp2, nv, mk);
    /* NCCL: the kernels from this rank's choice up to the choice at every rank's T_max (gemm_rank). */
    const int top = gemm_rank(gemm_choice(force, (long)sh.R * sh.T_max * sh.K, sh.E, 1, nv, mk));
    const bool wg1 = nccl ? gemm_rank(k1) <= 1 && top >= 1 : k1 == GEMM_WGMMA;
    const bool wg2 = nccl ? gemm_rank(k2) <= 1 && top >= 1 : k2 == GEMM_WGMMA;
    const bool w64_1 = nccl ? gemm_rank(k1) <= 2 && top >= 2 : k1 == GEMM_WS64;
    const bool w64_2 = nccl ? gemm_rank(k2) <= 2 && top >= 2 : k2 == GEMM_WS64;
    const bool ws1 = nccl ? top >= 3 : k1 == GEMM_WS, ws2 = nccl ? top >= 3 : k2 == GEMM_WS;
    /* The wgmma kernel's K splits (NVFP4), planned like the mma.sync kernel's. */
    const int wy1 = 2 * sh.I / MM_WGMMA_ROWS, wy2 = sh.H / MM_WGMMA_ROWS;
    const int wsp1 = nccl ? wgmma_splits_wanted(slots, sh.E, wy1, sh.H / BK) : plan_wgmma_splits(slots, sh.E, wy1, sh.H / BK).splits;
    const int wsp2 = nccl ? wgmma_splits_wanted(slots, sh.E, wy2, sh.I / BK) : plan_wgmma_splits(slots, sh.E, wy2, sh.I / BK).splits;
    /* The gate/up input in slot order (L.xg, where the layout holds it): always across GPUs (a remote
     * row then crosses NVLink once, not once per row block), and in one process when the
     * warp-specialized kernels take gate/up (their token tile is then one TMA box per K step;
     * DECISIONS 89). The copy is exact: y is the same. */
    sh.gathered = L.xg != 0 && (nccl || k1 == GEMM_WS || k1 == GEMM_WS64);
    megamoe_status st = sh.gathered ? sm90_gather_launch(sh, L, peers, s) : MEGAMOE_OK;
    if (st == MEGAMOE_OK)
        st = launch_phase<PHASE_GATE_UP>(k1, wg1, w64_1, ws1, wsp1, grid_gate_up, sp1, tiles, slots, sh, L, peers, base0,
                                         weights, force, s);
    if (st == MEGAMOE_OK && sh.bf16_act)
        st = sm90_act_f16_launch(sh, L, peers, nccl ? (long)sh.R * sh.T_max * sh.K : slots, s);
    if (st == MEGAMOE_OK)
        st = launch_phase<PHASE_DOWN>(k2, wg2, w64_2, ws2, wsp2, grid_down, sp2, tiles, slots, sh, L, peers, base0,
                                      weights, force, s);
    if (st != MEGAMOE_OK) return st;
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}

megamoe_status sm90_expert_gemm_prepare() {
    megamoe_status st = sm90_expert_wgmma_prepare();
    if (st == MEGAMOE_OK) st = sm90_expert_ws_prepare();
    if (st == MEGAMOE_OK) st = sm90_expert_stream_prepare();
    if (st == MEGAMOE_OK) st = sm90_expert_mma_prepare();
    return st;
}
