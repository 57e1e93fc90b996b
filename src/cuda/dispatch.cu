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
 *   gather     sm90_gather.cu   where the rows are gathered (across GPUs; one GPU when ws / ws64
 *                               take gate/up)
 *   gate/up, down: the expert GEMMs, chosen below (gemm_plan.h plan_gemm), per phase; between
 *              them, for NVFP4 weights with bf16 activations (W4A16), sm90_act_f16.cu: act to f16
 *   barrier    sm90_barrier.cu  NCCL only: every p written
 *   combine    sm90_combine.cu  per token; a cluster of 8 blocks per token up to 16 tokens of a rank
 *                               (gemm_plan.h plan_combine)
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
 * megamoe_layer_config.gemm_kernel replaces the choice for every phase (tests, benchmarks). The
 * streaming kernel runs one of five instantiations per phase (gemm_plan.h plan_stream_variant: the
 * grouped layout from 4 slots per expert, on 32-token chunks above 8, one block per SM more, the K
 * loop not unrolled). Every choice is a function of the group's slot count and the shape only
 * (never of R or of which rank computes), so y is bitwise the same for any R and number of GPUs.
 *
 * desc -> plan -> launch: gemm_desc_of below describes the forward, gemm_plan.h plan_gemm makes the
 * plan (a value: per phase the launches, each with its family, instance, splits and grid), and
 * sm90_expert_gemm_launch executes it, a family's launcher per launch. One process knows S and the
 * plan holds exactly the chosen kernel; with NCCL a rank knows only its own count, the plan holds
 * every kernel the group's count may choose, and each kernel's blocks leave at once unless
 * gemm_device_choice (gemm/fragments.cuh: the same rules, from every rank's staged count) names it.
 */
#include "launch.h"

/* The forward's shape and counts: the group's slots (NCCL: this rank's, a lower bound) and their bound. */
static gemm_desc gemm_desc_of(const mm_dev_shape &sh, const mm_buffer_layout &L, int total_tokens,
                              int override_kernel, int sms) {
    gemm_desc d;
    memset(&d, 0, sizeof d);
    d.slots = (long)total_tokens * sh.K;
    d.max_slots = (long)sh.R * sh.T_max * sh.K;
    d.R = sh.R;
    d.local_ranks = sh.local_ranks;
    d.E = sh.E;
    d.E_r = sh.E_r;
    d.K = sh.K;
    d.H = sh.H;
    d.I = sh.I;
    d.nvfp4 = sh.nvfp4 != 0;
    d.bf16_act = sh.bf16_act != 0;
    d.max_tiles = L.max_tiles;
    d.has_xg = L.xg != 0;
    d.sms = sms;
    d.override_kernel = override_kernel;
    return d;
}

static megamoe_status launch_one(const gemm_launch &g, const mm_gemm_args &a, cudaStream_t s) {
    switch (g.kernel) {
    case GEMM_MMA: return sm90_expert_mma_launch(g, a, s);
    case GEMM_STREAM: return sm90_expert_stream_launch(g, a, s);
    case GEMM_WGMMA: return sm90_expert_wgmma_launch(g, a, s);
    default: return sm90_expert_ws_launch(g, a, s); /* GEMM_WS64, GEMM_WS */
    }
}

static megamoe_status launch_phase(const gemm_phase_plan &p, const mm_gemm_args &a, cudaStream_t s) {
    megamoe_status st = MEGAMOE_OK;
    for (int i = 0; i < p.num_launches && st == MEGAMOE_OK; i++)
        st = launch_one(p.launch[i], a, s);
    return st;
}

megamoe_status sm90_expert_gemm_launch(const mm_dev_shape &sh_in, const mm_buffer_layout &L,
                                       uint8_t *const *peers, uint8_t *base0, const mm_dev_weights *weights,
                                       int total_tokens, int override_kernel, cudaStream_t s) {
    if (L.max_tiles <= 0) return MEGAMOE_OK;
    int sms = 0;
    MM_CUDA_TRY(mm_device_sms(&sms));
    const gemm_desc d = gemm_desc_of(sh_in, L, total_tokens, override_kernel, sms);
    const gemm_plan p = plan_gemm(&d);
    if (p.tiles <= 0) return MEGAMOE_OK;
    mm_dev_shape sh = sh_in;
    sh.gathered = p.gathered;
    const mm_gemm_args a = {sh, L, peers, base0, weights};
    megamoe_status st = p.gathered ? sm90_gather_launch(sh, L, peers, s) : MEGAMOE_OK;
    if (st == MEGAMOE_OK) st = launch_phase(p.phase[PHASE_GATE_UP], a, s);
    if (st == MEGAMOE_OK && p.act_f16) st = sm90_act_f16_launch(sh, L, peers, p.act_rows, s);
    if (st == MEGAMOE_OK) st = launch_phase(p.phase[PHASE_DOWN], a, s);
    if (st != MEGAMOE_OK) return st;
    MM_CUDA_TRY(cudaGetLastError());
    return MEGAMOE_OK;
}

megamoe_status sm90_expert_gemm_unbuilt(const gemm_launch &g) {
    return mm_cuda_fail(MEGAMOE_ERR_UNSUPPORTED,
                        "gemm_kernel=%d reaches an instance this build leaves out "
                        "(family %d, row %d): a test mode, built with MEGAMOE_FORCED_KERNELS=ON",
                        g.rule.override_kernel, g.kernel, g.instance);
}

megamoe_status sm90_expert_gemm_prepare(int override_kernel, int nvfp4) {
    if (!gemm_override_built(override_kernel, nvfp4))
        return mm_cuda_fail(MEGAMOE_ERR_UNSUPPORTED,
                            "gemm_kernel=%d on %s weights is a test mode this build leaves "
                            "out (MEGAMOE_FORCED_KERNELS=OFF)",
                            override_kernel, nvfp4 ? "NVFP4" : "BF16");
    megamoe_status st = sm90_expert_wgmma_prepare();
    if (st == MEGAMOE_OK) st = sm90_expert_ws_prepare();
    if (st == MEGAMOE_OK) st = sm90_expert_stream_prepare();
    if (st == MEGAMOE_OK) st = sm90_expert_mma_prepare();
    return st;
}
