/*
 * stub.c -- the CUDA backend in a build without a CUDA compiler: not available, and every call that
 * could reach it says so.
 */
#include "../internal.h"

int mm_cuda_available(void) { return 0; }

megamoe_status mm_cuda_group_init(megamoe_group *g) {
    mm_set_error(g->error, "this build of megamoe has no CUDA backend (no CUDA compiler was found)");
    return MEGAMOE_ERR_UNSUPPORTED;
}

void mm_cuda_group_fini(megamoe_group *g) { (void)g; }
megamoe_status mm_cuda_buffer_alloc(megamoe_group *g, mm_buffer *b) {
    (void)g, (void)b;
    return MEGAMOE_ERR_UNSUPPORTED;
}
void mm_cuda_buffer_free(megamoe_group *g, mm_buffer *b) { (void)g, (void)b; }
megamoe_status mm_cuda_layer_finalize(megamoe_layer *l) {
    mm_set_error(l->error, "layer '%s': this build has no CUDA backend", l->name);
    return MEGAMOE_ERR_UNSUPPORTED;
}
void mm_cuda_layer_free(megamoe_layer *l) { (void)l; }
uint64_t mm_cuda_layer_resident_bytes(const megamoe_layer *l) {
    (void)l;
    return 0;
}
megamoe_status mm_cuda_forward(megamoe_layer *l, const megamoe_forward_args *a, void *s) {
    (void)a, (void)s;
    mm_set_error(l->error, "layer '%s': this build has no CUDA backend", l->name);
    return MEGAMOE_ERR_UNSUPPORTED;
}
megamoe_status mm_cuda_layer_check(megamoe_layer *l) {
    (void)l;
    return MEGAMOE_OK;
}
megamoe_status mm_test_hold_rank(megamoe_layer *l, int rank) {
    (void)rank;
    if (l) mm_set_error(l->error, "layer '%s': this build has no CUDA backend", l->name);
    return MEGAMOE_ERR_UNSUPPORTED;
}


const mm_backend_ops mm_cuda_backend = {
    .name = "CUDA",
    .device_memory = 1,
    .one_rank_per_process = 0,
    .available = mm_cuda_available,
    .group_init = mm_cuda_group_init,
    .group_fini = mm_cuda_group_fini,
    .buffer_alloc = mm_cuda_buffer_alloc,
    .buffer_free = mm_cuda_buffer_free,
    .layer_finalize = mm_cuda_layer_finalize,
    .layer_free = mm_cuda_layer_free,
    .layer_resident_bytes = mm_cuda_layer_resident_bytes,
    .forward = mm_cuda_forward,
    .layer_check = mm_cuda_layer_check,
};
