/*
 * tensor.c -- the header's Tensors section: the dtypes (safetensors names and element sizes) and
 * the element count of a tensor.
 */
#include <string.h>

#include "internal.h"

static const struct {
    megamoe_dtype dtype;
    const char *name;
    size_t size;
} k_dtypes[] = {
    {MEGAMOE_DTYPE_BOOL, "BOOL", 1},       {MEGAMOE_DTYPE_U8, "U8", 1},
    {MEGAMOE_DTYPE_I8, "I8", 1},           {MEGAMOE_DTYPE_I16, "I16", 2},
    {MEGAMOE_DTYPE_U16, "U16", 2},         {MEGAMOE_DTYPE_F16, "F16", 2},
    {MEGAMOE_DTYPE_BF16, "BF16", 2},       {MEGAMOE_DTYPE_I32, "I32", 4},
    {MEGAMOE_DTYPE_U32, "U32", 4},         {MEGAMOE_DTYPE_F32, "F32", 4},
    {MEGAMOE_DTYPE_F64, "F64", 8},         {MEGAMOE_DTYPE_I64, "I64", 8},
    {MEGAMOE_DTYPE_U64, "U64", 8},         {MEGAMOE_DTYPE_F8_E4M3, "F8_E4M3", 1},
    {MEGAMOE_DTYPE_F8_E5M2, "F8_E5M2", 1},
};

const char *megamoe_dtype_name(megamoe_dtype dtype) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (k_dtypes[i].dtype == dtype) return k_dtypes[i].name;
    return "INVALID";
}

size_t megamoe_dtype_size(megamoe_dtype dtype) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (k_dtypes[i].dtype == dtype) return k_dtypes[i].size;
    return 0;
}

megamoe_dtype megamoe_dtype_from_name(const char *name) {
    if (!name) return MEGAMOE_DTYPE_INVALID;
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (strcmp(k_dtypes[i].name, name) == 0) return k_dtypes[i].dtype;
    return MEGAMOE_DTYPE_INVALID;
}

int64_t megamoe_tensor_numel(const megamoe_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}
