/*
 * cuda_error.cu -- the CUDA backend's failure message: a launcher or host call that fails records
 * what failed here (per host thread), and the boundary copies it into the handle's message. Its own
 * file, so the launchers and backend.cu both depend on it and not on each other.
 */
#include <stdarg.h>
#include <stdio.h>

#include "common.cuh"

static thread_local char t_message[512];

megamoe_status mm_cuda_error(cudaError_t err, const char *what, const char *file, int line) {
    snprintf(t_message, sizeof t_message, "%s failed: %s (%s:%d)", what, cudaGetErrorString(err), file, line);
    return err == cudaErrorMemoryAllocation ? MEGAMOE_ERR_OUT_OF_MEMORY : MEGAMOE_ERR_CUDA;
}

megamoe_status mm_cuda_fail(megamoe_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_message, sizeof t_message, fmt, ap);
    va_end(ap);
    return st;
}

const char *mm_cuda_last_message(void) { return t_message; }

void mm_cuda_clear_message(void) { t_message[0] = '\0'; }
