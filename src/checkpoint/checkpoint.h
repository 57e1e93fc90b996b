/*
 * checkpoint.h -- the checkpoint handle: safetensors files mapped into memory and the tensors they
 * hold, merged over the shards of an index. Shared by safetensors.c (reading, writing) and
 * loader.c (naming styles, layer loading, quantization).
 */
#ifndef MEGAMOE_CHECKPOINT_H
#define MEGAMOE_CHECKPOINT_H

#include "../internal.h"

typedef struct mm_ck_file {
    char *path;               /* as opened, for messages                    */
    const uint8_t *map;       /* the whole file, read-only                  */
    uint64_t size;
    uint64_t data_offset;     /* 8 + header length                          */
    mm_st_entry *entries;     /* sorted by name                             */
    int num_entries;
} mm_ck_file;

typedef struct mm_ck_tensor {
    const char *name;         /* points into the file's entry               */
    int file;                 /* index into files                           */
    const mm_st_entry *entry;
} mm_ck_tensor;

struct megamoe_checkpoint {
    mm_ck_file *files;
    int num_files;
    mm_ck_tensor *tensors;    /* all files' tensors, sorted by name         */
    int num_tensors;
    char error[MM_ERR_LEN];
};

/* Index of the tensor of that name, or -1. */
int mm_ck_lookup(const megamoe_checkpoint *ck, const char *name);
/* The view of tensor i (data into the mapping). */
void mm_ck_view(const megamoe_checkpoint *ck, int i, megamoe_tensor *view);

#endif /* MEGAMOE_CHECKPOINT_H */
