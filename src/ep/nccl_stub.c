/*
 * nccl_stub.c -- the NCCL backend in a build without NCCL's device API (NCCL >= 2.28 headers) or
 * without CUDA: not available, and creating a group says so.
 */
#include "../internal.h"

int mm_nccl_available(void) { return 0; }

megamoe_status mm_nccl_group_init(megamoe_group *g) {
    mm_set_error(g->error,
                 "this build of megamoe has no NCCL backend (it needs CUDA and NCCL >= 2.28 headers)");
    return MEGAMOE_ERR_UNSUPPORTED;
}

megamoe_status mm_nccl_buffer_alloc(megamoe_group *g, mm_buffer *b) {
    (void)g, (void)b;
    return MEGAMOE_ERR_UNSUPPORTED;
}

void mm_nccl_buffer_free(megamoe_group *g, mm_buffer *b) { (void)g, (void)b; }

/* The layer's operations are the CUDA backend's, as in a build with NCCL (no group reaches them). */
const mm_backend_ops mm_nccl_backend = {
    .name = "NCCL",
    .device_memory = 1,
    .one_rank_per_process = 1,
    .available = mm_nccl_available,
    .group_init = mm_nccl_group_init,
    .group_fini = mm_cuda_group_fini,
    .buffer_alloc = mm_nccl_buffer_alloc,
    .buffer_free = mm_nccl_buffer_free,
    .layer_finalize = mm_cuda_layer_finalize,
    .layer_free = mm_cuda_layer_free,
    .layer_resident_bytes = mm_cuda_layer_resident_bytes,
    .forward = mm_cuda_forward,
    .layer_check = mm_cuda_layer_check,
};
