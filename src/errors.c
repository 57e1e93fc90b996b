/*
 * errors.c -- the header's Status section (a string per status, the version string) and the
 * messages the library records on its handles. Every other source file may call these; they call
 * nothing of the library's.
 */
#include <stdio.h>

#include "internal.h"

void mm_set_errorv(char *dst, const char *fmt, va_list ap) { vsnprintf(dst, MM_ERR_LEN, fmt, ap); }

void mm_set_error(char *dst, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mm_set_errorv(dst, fmt, ap);
    va_end(ap);
}

megamoe_status mm_layer_fail(megamoe_layer *layer, megamoe_status status, const char *fmt, ...) {
    char detail[MM_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    mm_set_errorv(detail, fmt, ap);
    va_end(ap);
    mm_set_error(layer->error, "layer '%s': %s", layer->name, detail);
    return status;
}

const char *megamoe_status_string(megamoe_status status) {
    switch (status) {
    case MEGAMOE_OK: return "ok";
    case MEGAMOE_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MEGAMOE_ERR_OUT_OF_MEMORY: return "out of memory";
    case MEGAMOE_ERR_BAD_WEIGHT: return "bad weight";
    case MEGAMOE_ERR_NOT_FINALIZED: return "layer not finalized";
    case MEGAMOE_ERR_BAD_INPUT: return "bad input";
    case MEGAMOE_ERR_IO: return "i/o error";
    case MEGAMOE_ERR_FORMAT: return "malformed file";
    case MEGAMOE_ERR_UNSUPPORTED: return "unsupported";
    case MEGAMOE_ERR_TIMEOUT: return "timeout";
    case MEGAMOE_ERR_CUDA: return "CUDA error";
    case MEGAMOE_ERR_NCCL: return "NCCL error";
    case MEGAMOE_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

#define MM_STR2(x) #x
#define MM_STR(x) MM_STR2(x)
const char *megamoe_version_string(void) {
    return MM_STR(MEGAMOE_VERSION_MAJOR) "." MM_STR(MEGAMOE_VERSION_MINOR) "." MM_STR(MEGAMOE_VERSION_PATCH);
}
