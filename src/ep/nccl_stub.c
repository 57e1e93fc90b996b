/*
 * nccl_stub.c -- the NCCL backend's entry points in a build without NCCL's device API (NCCL >= 2.28
 * headers) or without CUDA: every call says so.
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
