/*
 * backend.cu -- the CUDA backend's host side: R ranks sharing one sm_90 device, each with its own
 * communication buffer, reaching each other through a device table of the buffers' addresses (the
 * code path the NCCL backend fills with LSA peer pointers). Weights are uploaded at finalize and the
 * host copies freed; a forward enqueues kernels on the caller's stream with no allocation and no host
 * synchronization, so it can be captured in a CUDA graph.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch.h"
#include "../weight_layout.h"

struct mm_cuda_group {
    int device;
};

struct mm_cuda_layer {
    mm_dev_weights *host_weights; /* [local ranks] device pointers, host copy */
    mm_dev_weights *dev_weights;  /* the same table on the device            */
    void **allocs;                /* every device allocation, freed in reverse */
    int num_allocs, cap_allocs;
    uint64_t resident_bytes;
    float *gamma;            /* [H] or NULL */
    uint8_t *host_error;     /* mapped pinned: the error words of the last forward */
    uint8_t *host_error_dev; /* the same, as the device sees it */
    cudaStream_t last_stream;
    int held_rank; /* mm_test_hold_rank: the global rank that never arrives, -1 = none */
};

static int device_of(const megamoe_group *g) { return ((const mm_cuda_group *)g->device)->device; }

int mm_cuda_group_device(const megamoe_group *g) { return device_of(g); }

extern "C" int mm_cuda_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError(); /* clear the sticky "no device" error */
        return 0;
    }
    for (int d = 0; d < n; d++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, d) == cudaSuccess && p.major == 9) return 1;
    }
    return 0;
}

extern "C" megamoe_status mm_cuda_group_init(megamoe_group *g) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        cudaGetLastError();
        mm_set_error(g->error, "no CUDA device is visible (%s)",
                     err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return MEGAMOE_ERR_UNSUPPORTED;
    }
    if (g->config.device < 0 || g->config.device >= n) {
        mm_set_error(g->error, "device %d does not exist (%d visible)", g->config.device, n);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, g->config.device) != cudaSuccess || p.major != 9) {
        mm_set_error(g->error, "device %d (%s, sm_%d%d) is not a Hopper GPU (sm_90)", g->config.device,
                     p.name, p.major, p.minor);
        return MEGAMOE_ERR_UNSUPPORTED;
    }
    mm_cuda_group *cg = (mm_cuda_group *)calloc(1, sizeof *cg);
    if (!cg) return MEGAMOE_ERR_OUT_OF_MEMORY;
    cg->device = g->config.device;
    g->device = cg;
    return MEGAMOE_OK;
}

extern "C" void mm_cuda_group_fini(megamoe_group *g) {
    free(g->device);
    g->device = NULL;
}

extern "C" megamoe_status mm_cuda_buffer_alloc(megamoe_group *g, mm_buffer *b) {
    device_scope scope(device_of(g));
    megamoe_status st = MEGAMOE_OK;
    for (int r = 0; r < g->local_ranks && st == MEGAMOE_OK; r++) {
        cudaError_t err = cudaMalloc(&b->rank_base[r], (size_t)b->layout.total);
        if (err != cudaSuccess) {
            st = mm_cuda_error(err, "cudaMalloc(communication buffer)", __FILE__, __LINE__);
            b->rank_base[r] = NULL;
        }
    }
    if (st == MEGAMOE_OK) st = mm_cuda_buffer_init(g, b);
    if (st == MEGAMOE_OK) {
        cudaError_t err = cudaMalloc(&b->peer_table, sizeof(void *) * (size_t)g->local_ranks);
        if (err == cudaSuccess)
            err = cudaMemcpy(b->peer_table, b->rank_base, sizeof(void *) * (size_t)g->local_ranks,
                             cudaMemcpyHostToDevice);
        if (err != cudaSuccess) st = mm_cuda_error(err, "peer table", __FILE__, __LINE__);
    }
    if (st != MEGAMOE_OK) {
        mm_set_error(g->error, "%s", mm_cuda_last_message());
        mm_cuda_buffer_free(g, b);
    }
    return st;
}

extern "C" megamoe_status mm_cuda_buffer_init(megamoe_group *g, mm_buffer *b) {
    device_scope scope(device_of(g));
    const mm_buffer_layout &L = b->layout;
    for (int r = 0; r < g->local_ranks; r++) {
        uint8_t *base = (uint8_t *)b->rank_base[r];
        /* Every byte once: kernels read some regions past what a forward wrote -- a TMA box of act or
         * xg rows past the last slot, whose columns the epilogue drops -- and a fresh allocation
         * holds no defined value there (compute-sanitizer initcheck). */
        MM_CUDA_TRY(cudaMemset(base, 0, (size_t)L.total)); /* split-K counters, barrier epochs: 0 */
        MM_CUDA_TRY(cudaMemset(base + L.error, 0xFF, 8));  /* no bad id yet; counts 0 */
    }
    MM_CUDA_TRY(cudaDeviceSynchronize()); /* zero before any peer can see the buffer */
    return MEGAMOE_OK;
}

extern "C" void mm_cuda_buffer_free(megamoe_group *g, mm_buffer *b) {
    device_scope scope(device_of(g));
    cudaFree(b->peer_table);
    b->peer_table = NULL;
    for (int r = g->local_ranks - 1; r >= 0; r--) {
        cudaFree(b->rank_base[r]);
        b->rank_base[r] = NULL;
    }
}

/* ---- Finalize: upload ----------------------------------------------------------------------- */

static megamoe_status upload(mm_cuda_layer *cl, void **host, size_t bytes, const void **dev_out) {
    if (!*host) {
        *dev_out = NULL;
        return MEGAMOE_OK;
    }
    void *d = NULL;
    MM_CUDA_TRY(cudaMalloc(&d, bytes ? bytes : 1));
    cl->allocs[cl->num_allocs++] = d;
    MM_CUDA_TRY(cudaMemcpy(d, *host, bytes, cudaMemcpyHostToDevice));
    cl->resident_bytes += bytes;
    free(*host); /* SPEC §6: the checkpoint-layout copy is not kept */
    *host = NULL;
    *dev_out = d;
    return MEGAMOE_OK;
}

/* The per-rank table of device weight pointers, read by the expert GEMMs. */
static megamoe_status upload_table(mm_cuda_layer *cl, int R) {
    const size_t bytes = sizeof(mm_dev_weights) * (size_t)R;
    MM_CUDA_TRY(cudaMalloc((void **)&cl->dev_weights, bytes));
    cl->allocs[cl->num_allocs++] = cl->dev_weights;
    MM_CUDA_TRY(cudaMemcpy(cl->dev_weights, cl->host_weights, bytes, cudaMemcpyHostToDevice));
    return MEGAMOE_OK;
}

extern "C" void mm_cuda_layer_free(megamoe_layer *l) {
    mm_cuda_layer *cl = (mm_cuda_layer *)l->device;
    if (!cl) return;
    device_scope scope(device_of(l->group));
    for (int i = cl->num_allocs - 1; i >= 0; i--)
        cudaFree(cl->allocs[i]);
    if (cl->host_error) cudaFreeHost(cl->host_error);
    free(cl->allocs);
    free(cl->host_weights);
    free(cl);
    l->device = NULL;
}

extern "C" megamoe_status mm_cuda_layer_finalize(megamoe_layer *l) {
    device_scope scope(device_of(l->group));
    const int R = l->group->local_ranks, E_r = l->experts_per_rank;
    /* I: the kernels' intermediate size, padded (weight_layout.h); every size below is at it. */
    const size_t H = (size_t)l->config.hidden_size, n = (size_t)E_r,
                 I = (size_t)mm_layout_intermediate_padded(l->config.intermediate_size);
    mm_cuda_layer *cl = (mm_cuda_layer *)calloc(1, sizeof *cl);
    if (!cl) return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory");
    l->device = cl;
    cl->held_rank = -1;
    cl->cap_allocs = R * 10 + 4;
    cl->allocs = (void **)calloc((size_t)cl->cap_allocs, sizeof(void *));
    cl->host_weights = (mm_dev_weights *)calloc((size_t)R, sizeof(mm_dev_weights));
    if (!cl->allocs || !cl->host_weights) {
        mm_cuda_layer_free(l);
        return mm_layer_fail(l, MEGAMOE_ERR_OUT_OF_MEMORY, "out of host memory");
    }
    megamoe_status st = MEGAMOE_OK;
    uint64_t peak = 0;
    for (int r = 0; r < R && st == MEGAMOE_OK; r++) {
        mm_rank_weights *w = &l->ranks[r];
        mm_dev_weights *d = &cl->host_weights[r];
        /* Into the kernel layout (weight_layout.h) at the padded I, experts on the group's CPU threads. */
        if (!mm_layout_pack_experts(&w->w13, &w->w13_sf, &w->w2, &w->w2_sf, &w->w13_bf16, &w->w2_bf16, E_r,
                                    (int64_t)H, l->config.intermediate_size, l->group->num_threads)) {
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
            break;
        }
        if (st == MEGAMOE_OK) st = upload(cl, (void **)&w->w13, n * 2 * I * H / 2, (const void **)&d->w13);
        if (st == MEGAMOE_OK)
            st = upload(cl, (void **)&w->w13_sf, n * 2 * I * H / 16, (const void **)&d->w13_sf);
        if (st == MEGAMOE_OK) st = upload(cl, (void **)&w->w2, n * H * I / 2, (const void **)&d->w2);
        if (st == MEGAMOE_OK) st = upload(cl, (void **)&w->w2_sf, n * H * I / 16, (const void **)&d->w2_sf);
        if (st == MEGAMOE_OK)
            st = upload(cl, (void **)&w->w13_alpha, n * 2 * 4, (const void **)&d->w13_alpha);
        if (st == MEGAMOE_OK) st = upload(cl, (void **)&w->w2_alpha, n * 4, (const void **)&d->w2_alpha);
        if (st == MEGAMOE_OK) st = upload(cl, (void **)&w->w2_input_scale, n * 4, (const void **)&d->w2_in);
        if (st == MEGAMOE_OK)
            st = upload(cl, (void **)&w->w13_bf16, n * 2 * I * H * 2, (const void **)&d->w13_bf16);
        if (st == MEGAMOE_OK)
            st = upload(cl, (void **)&w->w2_bf16, n * H * I * 2, (const void **)&d->w2_bf16);
        /* The unused static input scales of gate/up stay on the host (SPEC: kept, unused). */
        peak = cl->resident_bytes;
    }
    if (st == MEGAMOE_OK)
        st = sm90_expert_gemm_prepare(l->config.gemm_kernel, l->config.format == MEGAMOE_FORMAT_NVFP4);
    if (st == MEGAMOE_OK) st = sm90_combine_prepare(l->config.top_k, (int)H);
    if (st == MEGAMOE_OK) st = upload_table(cl, R);
    if (st == MEGAMOE_OK && l->norm_gamma) {
        void *g = malloc(H * 4);
        if (!g)
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
        else {
            memcpy(g, l->norm_gamma, H * 4);
            const void *dg = NULL;
            st = upload(cl, &g, H * 4, &dg);
            cl->gamma = (float *)dg;
        }
    }
    if (st == MEGAMOE_OK) {
        cudaError_t err = cudaHostAlloc((void **)&cl->host_error, 16, cudaHostAllocMapped);
        if (err == cudaSuccess) {
            memset(cl->host_error, 0, 16);
            err = cudaHostGetDevicePointer((void **)&cl->host_error_dev, cl->host_error, 0);
        }
        if (err != cudaSuccess) st = mm_cuda_error(err, "cudaHostAlloc(error words)", __FILE__, __LINE__);
    }
    if (st != MEGAMOE_OK) {
        /* Host copies already uploaded are gone: the layer cannot be finalized again. */
        const char *msg = mm_cuda_last_message();
        mm_layer_fail(l, st, "finalize on device %d failed: %s", device_of(l->group),
                      msg[0] ? msg : "out of memory");
        return st;
    }
    l->finalize_peak_bytes = peak > cl->resident_bytes ? peak : cl->resident_bytes;
    return MEGAMOE_OK;
}

extern "C" uint64_t mm_cuda_layer_resident_bytes(const megamoe_layer *l) {
    const mm_cuda_layer *cl = (const mm_cuda_layer *)l->device;
    return cl ? cl->resident_bytes : 0;
}

/* ---- Forward -------------------------------------------------------------------------------- */

static megamoe_status enqueue(megamoe_layer *l, const megamoe_forward_args *args, cudaStream_t s) {
    mm_cuda_layer *cl = (mm_cuda_layer *)l->device;
    const megamoe_group *g = l->group;
    const mm_buffer_layout &L = l->buffer->layout;
    mm_dev_shape sh;
    sh.R = g->world_size;
    sh.first_rank = g->first_rank;
    sh.local_ranks = g->local_ranks;
    sh.E = l->config.num_experts;
    sh.E_r = l->experts_per_rank;
    sh.K = l->config.top_k;
    sh.H = l->config.hidden_size;
    sh.I = (int)mm_layout_intermediate_padded(l->config.intermediate_size); /* the kernels' I */
    sh.T_max = l->config.max_tokens;
    sh.nvfp4 = l->config.format == MEGAMOE_FORMAT_NVFP4;
    sh.bf16_act = sh.nvfp4 && l->config.activations == MEGAMOE_ACTIVATIONS_BF16;
    sh.has_norm = cl->gamma != NULL;
    sh.clamp = l->config.activation_clamp;
    sh.eps = l->config.norm_eps;
    sh.gathered = 0; /* set by the GEMM launcher for the forward */
    uint8_t **base = (uint8_t **)l->buffer->rank_base;
    uint8_t *const *peers = (uint8_t *const *)l->buffer->peer_table;
    uint8_t *err = base[0];
    int total_tokens = 0;
    for (int r = 0; r < g->local_ranks; r++)
        total_tokens += args[r].num_tokens;
    /* Which routing (dispatch.cu's table); ROUTE_WARP: the stage block's last warp routes. */
    const int route = sm90_route_plan(sh, total_tokens);
    /* The error words were reset by the last forward's combine (or at buffer creation). */
    for (int r = 0; r < g->local_ranks; r++) {
        const mm_dev_rank_args a = {args[r].num_tokens,   args[r].x,          args[r].topk_ids,
                                    args[r].topk_weights, args[r].is_padding, args[r].y};
        megamoe_status st =
            sm90_stage_launch(sh, L, base[r], err, mm_group_rank(g, r), a, route == ROUTE_WARP, s);
        if (st) return st;
    }
    /* NCCL: the peers' staged tokens are read next, and the last forward's p written into them. */
    const bool nccl = g->ops->one_rank_per_process;
    const int timeout_ms = l->config.timeout_ms;
    megamoe_status st = MEGAMOE_OK;
    /* The test hold: this backend's local ranks meet at the NCCL barrier too, on words it uses for
     * nothing else, zeroed first so the unequal epochs a timed-out forward leaves never reach this one. */
    const int held = cl->held_rank;
    const bool barrier = nccl || held >= 0;
    for (int r = 0; !nccl && held >= 0 && r < g->local_ranks; r++)
        MM_CUDA_TRY(cudaMemsetAsync(base[r] + L.barrier, 0, 8 * (size_t)(sh.R + 1), s));
    if (barrier && (st = sm90_barrier_launch(sh, L, peers, timeout_ms, held, s)) != MEGAMOE_OK) return st;
    if (route != ROUTE_WARP &&
        (st = sm90_route_launch(sh, L, peers, route, (long)total_tokens * sh.K, s)) != MEGAMOE_OK)
        return st;
    st = sm90_expert_gemm_launch(sh, L, peers, base[0], cl->dev_weights, total_tokens, l->config.gemm_kernel,
                                 s);
    if (st) return st;
    /* NCCL: every p this rank's tokens need has been written by its owner. */
    if (barrier && (st = sm90_barrier_launch(sh, L, peers, timeout_ms, held, s)) != MEGAMOE_OK) return st;
    for (int r = 0; r < g->local_ranks; r++) {
        const mm_dev_rank_args a = {args[r].num_tokens,   args[r].x,          args[r].topk_ids,
                                    args[r].topk_weights, args[r].is_padding, args[r].y};
        const bool last = r == g->local_ranks - 1;
        st = sm90_combine_launch(plan_combine(a.T, sh.K, sh.H), sh, L, base[r], cl->gamma, a,
                                 last ? err + L.error : NULL, last ? cl->host_error_dev : NULL, s);
        if (st) return st;
    }
    return MEGAMOE_OK;
}

extern "C" megamoe_status mm_cuda_forward(megamoe_layer *l, const megamoe_forward_args *args, void *stream) {
    device_scope scope(device_of(l->group));
    mm_cuda_layer *cl = (mm_cuda_layer *)l->device;
    cudaStream_t s = (cudaStream_t)stream;
    cl->last_stream = s;
    mm_cuda_clear_message();
    megamoe_status st = enqueue(l, args, s);
    if (st != MEGAMOE_OK) return mm_layer_fail(l, st, "%s", mm_cuda_last_message());
    return MEGAMOE_OK;
}

extern "C" megamoe_status mm_test_hold_rank(megamoe_layer *l, int rank) {
    if (!l || !l->device)
        return l ? mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT,
                                 "the test hold needs a finalized device layer")
                 : MEGAMOE_ERR_INVALID_ARGUMENT;
    if (rank < -1 || rank >= l->group->world_size)
        return mm_layer_fail(l, MEGAMOE_ERR_INVALID_ARGUMENT, "held rank %d is outside [-1, %d)", rank,
                             l->group->world_size);
    ((mm_cuda_layer *)l->device)->held_rank = rank;
    return MEGAMOE_OK;
}

extern "C" megamoe_status mm_cuda_layer_check(megamoe_layer *l) {
    device_scope scope(device_of(l->group));
    mm_cuda_layer *cl = (mm_cuda_layer *)l->device;
    cudaError_t err = cudaStreamSynchronize(cl->last_stream);
    if (err != cudaSuccess) {
        mm_cuda_error(err, "cudaStreamSynchronize", __FILE__, __LINE__);
        return mm_layer_fail(l, MEGAMOE_ERR_CUDA, "%s", mm_cuda_last_message());
    }
    unsigned long long first;
    unsigned int count, late;
    memcpy(&first, cl->host_error, 8);
    memcpy(&count, cl->host_error + 8, 4);
    memcpy(&late, cl->host_error + 12, 4);
    if (late) {
        memset(cl->host_error, 0, 16);
        const int r0 = mm_group_rank(l->group, 0), r1 = r0 + l->group->local_ranks - 1;
        if (r1 > r0) /* several local ranks (the test hold): any of them but the late one waited */
            return mm_layer_fail(
                l, MEGAMOE_ERR_TIMEOUT,
                "ranks %d..%d waited more than timeout_ms=%d for rank %u, which did not arrive; y "
                "is not valid",
                r0, r1, l->config.timeout_ms, late - 1);
        return mm_layer_fail(l, MEGAMOE_ERR_TIMEOUT,
                             "rank %d waited more than timeout_ms=%d for rank %u; y is not valid", r0,
                             l->config.timeout_ms, late - 1);
    }
    if (count == 0) return MEGAMOE_OK;
    const int K = l->config.top_k, T_max = l->config.max_tokens;
    const unsigned key = (unsigned)(first >> 32);
    const int id = (int)(uint32_t)first, rank = (int)(key / ((unsigned)T_max * K)),
              token = (int)(key / K % T_max), slot = (int)(key % K);
    memset(cl->host_error, 0, 16);
    return mm_layer_fail(
        l, MEGAMOE_ERR_BAD_INPUT,
        "rank %d token %d slot %d: expert id %d is outside [-1, %d) (%u bad slot%s skipped; y was "
        "written)",
        rank, token, slot, id, l->config.num_experts, count, count == 1 ? "" : "s");
}

/* ---- The table of operations ----------------------------------------------------------------- */

/* In member order (internal.h mm_backend_ops): C++17 has no designated initializers. */
const mm_backend_ops mm_cuda_backend = {
    "CUDA",                       /* name                 */
    1,                            /* device_memory        */
    0,                            /* one_rank_per_process */
    mm_cuda_available,            /* available            */
    mm_cuda_group_init,           /* group_init           */
    mm_cuda_group_fini,           /* group_fini           */
    mm_cuda_buffer_alloc,         /* buffer_alloc         */
    mm_cuda_buffer_free,          /* buffer_free          */
    mm_cuda_layer_finalize,       /* layer_finalize       */
    mm_cuda_layer_free,           /* layer_free           */
    mm_cuda_layer_resident_bytes, /* layer_resident_bytes */
    mm_cuda_forward,              /* forward              */
    mm_cuda_layer_check,          /* layer_check          */
};
