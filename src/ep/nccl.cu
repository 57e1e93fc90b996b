/*
 * nccl.cu -- the NCCL backend: one rank per process and GPU, the caller's ncclComm_t. The
 * communication buffer of SPEC §7 comes from ncclMemAlloc, registered as a symmetric window; every
 * rank's base address in every peer's view is read on the device with ncclGetLsaPointer into the
 * same peer table the single-GPU backend uses, so all kernels are shared. Cross-rank ordering comes
 * from sm90_barrier (bounded waits), inserted by the forward when the backend is NCCL. The LSA
 * pointers need only the window (ncclGetLsaPointer); no device communicator is created, since the
 * library's own barrier (with its timeout) replaces NCCL's device-side barriers.
 * Built against NCCL >= 2.28 (device API); see docs/DECISIONS.md on the headers and library.
 */
#include <nccl.h>
#include <nccl_device.h>
#include <stdlib.h>

#include "../cuda/common.cuh" /* device_scope, mm_launch, MM_CUDA_TRY */

struct mm_nccl_buffer {
    ncclWindow_t window;
};

static megamoe_status nccl_fail(megamoe_group *g, ncclResult_t r, const char *what) {
    mm_set_error(g->error, "%s failed: %s", what, ncclGetErrorString(r));
    return MEGAMOE_ERR_NCCL;
}

static ncclComm_t comm_of(const megamoe_group *g) { return (ncclComm_t)g->config.nccl_comm; }

extern "C" int mm_nccl_available(void) { return mm_cuda_available(); }

extern "C" megamoe_status mm_nccl_group_init(megamoe_group *g) {
    if (!g->config.nccl_comm) {
        mm_set_error(g->error, "the NCCL backend needs config.nccl_comm (an ncclComm_t)");
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    int R = 0, rank = 0;
    ncclResult_t r = ncclCommCount(comm_of(g), &R);
    if (r == ncclSuccess) r = ncclCommUserRank(comm_of(g), &rank);
    if (r != ncclSuccess) return nccl_fail(g, r, "ncclCommCount/ncclCommUserRank");
    if (R < 1 || R > MM_MAX_RANKS) {
        mm_set_error(g->error, "the communicator has R=%d ranks; 1..%d are supported", R, MM_MAX_RANKS);
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    const ncclTeam_t lsa = ncclTeamLsa(comm_of(g));
    if (lsa.nRanks != R) {
        mm_set_error(g->error,
                     "only %d of the %d ranks share NVLink with rank %d; ranks on other machines need "
                     "GIN (docs/MULTINODE.md), not supported yet",
                     lsa.nRanks, R, rank);
        return MEGAMOE_ERR_UNSUPPORTED;
    }
    megamoe_status st = mm_cuda_group_init(g); /* the device: config.device, sm_90 checked */
    if (st != MEGAMOE_OK) return st;
    g->world_size = R;
    g->local_ranks = 1;
    g->first_rank = rank;
    return MEGAMOE_OK;
}

/* table[p] = rank p's buffer as this GPU sees it. */
__global__ void mm_fill_peer_table(ncclWindow_t window, const int *lsa_rank, int R, uint8_t **table) {
    for (int p = threadIdx.x; p < R; p += blockDim.x)
        table[p] = (uint8_t *)ncclGetLsaPointer(window, 0, lsa_rank[p]);
}

/* The peer table of buffer b: rank p's buffer as this GPU sees it, for every rank p. */
static megamoe_status fill_peer_table(megamoe_group *g, mm_buffer *b, ncclWindow_t window) {
    const int R = g->world_size;
    int *lsa_host = (int *)calloc((size_t)R, sizeof(int));
    if (!lsa_host) return MEGAMOE_ERR_OUT_OF_MEMORY;
    const ncclTeam_t world = ncclTeamWorld(comm_of(g));
    for (int p = 0; p < R; p++)
        lsa_host[p] = ncclTeamRankToLsa(comm_of(g), world, p);
    int *lsa_dev = NULL;
    auto fill = [&]() -> megamoe_status {
        MM_CUDA_TRY(cudaMalloc((void **)&lsa_dev, sizeof(int) * (size_t)R));
        MM_CUDA_TRY(cudaMalloc(&b->peer_table, sizeof(void *) * (size_t)R));
        MM_CUDA_TRY(cudaMemcpy(lsa_dev, lsa_host, sizeof(int) * (size_t)R, cudaMemcpyHostToDevice));
        MM_CUDA_TRY(mm_launch(mm_fill_peer_table, 1, 128, 0, (cudaStream_t)0, window, (const int *)lsa_dev, R,
                              (uint8_t **)b->peer_table));
        MM_CUDA_TRY(cudaDeviceSynchronize());
        return MEGAMOE_OK;
    };
    const megamoe_status st = fill();
    if (st != MEGAMOE_OK) mm_set_error(g->error, "peer table: %s", mm_cuda_last_message());
    cudaFree(lsa_dev);
    free(lsa_host);
    return st;
}

extern "C" megamoe_status mm_nccl_buffer_alloc(megamoe_group *g, mm_buffer *b) {
    device_scope scope(mm_cuda_group_device(g)); /* ncclMemAlloc and the window live on the group's GPU */
    mm_nccl_buffer *nb = (mm_nccl_buffer *)calloc(1, sizeof *nb);
    if (!nb) return MEGAMOE_ERR_OUT_OF_MEMORY;
    b->backend = nb;
    megamoe_status st = MEGAMOE_OK;
    ncclResult_t r = ncclMemAlloc(&b->rank_base[0], (size_t)b->layout.total);
    if (r != ncclSuccess) st = nccl_fail(g, r, "ncclMemAlloc(communication buffer)");
    if (st == MEGAMOE_OK && (st = mm_cuda_buffer_init(g, b)) != MEGAMOE_OK)
        mm_set_error(g->error, "%s", mm_cuda_last_message());
    /* Collective: every rank registers its buffer as one symmetric window. */
    if (st == MEGAMOE_OK && (r = ncclCommWindowRegister(comm_of(g), b->rank_base[0], (size_t)b->layout.total,
                                                        &nb->window, NCCL_WIN_COLL_SYMMETRIC)) != ncclSuccess)
        st = nccl_fail(g, r, "ncclCommWindowRegister");
    if (st == MEGAMOE_OK) st = fill_peer_table(g, b, nb->window);
    if (st != MEGAMOE_OK) mm_nccl_buffer_free(g, b);
    return st;
}

extern "C" void mm_nccl_buffer_free(megamoe_group *g, mm_buffer *b) {
    mm_nccl_buffer *nb = (mm_nccl_buffer *)b->backend;
    device_scope scope(mm_cuda_group_device(g));
    cudaFree(b->peer_table);
    b->peer_table = NULL;
    if (nb && nb->window) ncclCommWindowDeregister(comm_of(g), nb->window);
    if (b->rank_base[0]) ncclMemFree(b->rank_base[0]);
    b->rank_base[0] = NULL;
    free(nb);
    b->backend = NULL;
}

/* ---- The table of operations ----------------------------------------------------------------- */

/* In member order (internal.h mm_backend_ops): C++17 has no designated initializers. A layer's
 * operations are the CUDA backend's: the kernels are shared, only the buffer and the group differ. */
const mm_backend_ops mm_nccl_backend = {
    "NCCL",                       /* name                 */
    1,                            /* device_memory        */
    1,                            /* one_rank_per_process */
    mm_nccl_available,            /* available            */
    mm_nccl_group_init,           /* group_init           */
    mm_cuda_group_fini,           /* group_fini           */
    mm_nccl_buffer_alloc,         /* buffer_alloc         */
    mm_nccl_buffer_free,          /* buffer_free          */
    mm_cuda_layer_finalize,       /* layer_finalize       */
    mm_cuda_layer_free,           /* layer_free           */
    mm_cuda_layer_resident_bytes, /* layer_resident_bytes */
    mm_cuda_forward,              /* forward              */
    mm_cuda_layer_check,          /* layer_check          */
};
