/*
 * names.c -- the expert weight names of SPEC §6, the one table the layer's messages, the checkpoint
 * loader and the converter share.
 */
#include <stdio.h>

#include "../internal.h"

const char *const mm_proj_names[2][3] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};

const char *const mm_field_names[2][4] = {
    {"weight", "weight_scale", "weight_scale_2", "input_scale"},
    {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}};

void mm_join_name(char *out, size_t n, const char *prefix, const char *rest) {
    snprintf(out, n, "%s%s%s", prefix, prefix[0] ? "." : "", rest);
}
