/*
 * fuzz_safetensors.c -- libFuzzer target for the safetensors reader: any byte string must give
 * either a validated table of tensors whose bytes lie inside the image, or an error; never a crash,
 * a leak or an out-of-bounds read. Built and run by tests/fuzz/run.sh.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* A private copy, so reads past the end of the image hit ASan's redzone. */
    uint8_t *image = malloc(size ? size : 1);
    if (!image) return 0;
    memcpy(image, data, size);
    mm_st_entry *entries = NULL;
    int n = 0;
    uint64_t data_offset = 0;
    char err[MM_ERR_LEN];
    if (mm_safetensors_parse(image, size, "fuzz", &entries, &n, &data_offset, err) == MEGAMOE_OK) {
        volatile uint8_t sink = 0;
        for (int i = 0; i < n; i++) {
            if (data_offset + entries[i].end > size || entries[i].begin > entries[i].end) abort();
            if (entries[i].end > entries[i].begin) {
                sink ^= image[data_offset + entries[i].begin];
                sink ^= image[data_offset + entries[i].end - 1];
            }
            if (i > 0 && strcmp(entries[i - 1].name, entries[i].name) >= 0) abort(); /* sorted, unique */
        }
        (void)sink;
    }
    mm_st_entries_free(entries, n);
    free(image);
    return 0;
}
