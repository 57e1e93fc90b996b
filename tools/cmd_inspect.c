/*
 * cmd_inspect.c -- `megamoe inspect`: what a checkpoint holds.
 */
#include <getopt.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char *format_name(megamoe_weight_format f) {
    return f == MEGAMOE_FORMAT_NVFP4 ? "NVFP4" : "BF16";
}

static const char *naming_name(megamoe_naming n) {
    switch (n) {
    case MEGAMOE_NAMING_STACKED: return "stacked";
    case MEGAMOE_NAMING_PER_EXPERT: return "per-expert";
    case MEGAMOE_NAMING_COMPRESSED_TENSORS: return "compressed-tensors";
    }
    return "?";
}

static const char k_inspect_help[] =
    "usage: megamoe inspect PATH [--tensors]\n"
    "\n"
    "Shows what a checkpoint holds: its files, its MoE layers (naming style, format, E, H, I,\n"
    "post-expert norm, bytes) and, with --tensors, every tensor's dtype and shape.\n";

int cmd_inspect(int argc, char **argv) {
    static const struct option opts[] = {
        {"tensors", no_argument, 0, 't'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int list = 0, c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (c == 't')
            list = 1;
        else if (c == 'h')
            return fputs(k_inspect_help, stdout), 0;
        else
            return fputs(k_inspect_help, stderr), 2;
    }
    if (argc - optind > 1) return cli_unexpected("inspect", argv[optind + 1], k_inspect_help);
    if (argc - optind != 1) return fputs(k_inspect_help, stderr), 2;
    megamoe_checkpoint *ck = NULL;
    megamoe_status st = megamoe_checkpoint_open(argv[optind], &ck);
    if (st) {
        cli_fail("%s", megamoe_checkpoint_last_error(ck));
        megamoe_checkpoint_close(ck);
        return 1;
    }
    uint64_t total = 0;
    for (int i = 0; i < megamoe_checkpoint_num_tensors(ck); i++) {
        megamoe_tensor t;
        megamoe_checkpoint_tensor(ck, i, NULL, &t);
        total += (uint64_t)megamoe_tensor_numel(&t) * megamoe_dtype_size(t.dtype);
    }
    printf("%s: %d file%s, %d tensors, %.3f MB\n", argv[optind], megamoe_checkpoint_num_files(ck),
           megamoe_checkpoint_num_files(ck) == 1 ? "" : "s", megamoe_checkpoint_num_tensors(ck),
           (double)total / 1e6);
    int found = 0;
    st = megamoe_checkpoint_find_layers(ck, NULL, 0, &found);
    megamoe_layer_info *infos = found > 0 ? calloc((size_t)found, sizeof *infos) : NULL;
    if (st == MEGAMOE_OK && found > 0)
        st = infos ? megamoe_checkpoint_find_layers(ck, infos, found, &found) : MEGAMOE_ERR_OUT_OF_MEMORY;
    if (st) {
        cli_fail("%s", megamoe_checkpoint_last_error(ck));
        free(infos);
        megamoe_checkpoint_close(ck);
        return 1;
    }
    printf("%d MoE layer%s\n", found, found == 1 ? "" : "s");
    for (int i = 0; i < found; i++) {
        const megamoe_layer_info *li = &infos[i];
        printf("  %-40s %-5s %-18s E=%d H=%d I=%d norm=%s %.3f MB\n",
               li->prefix[0] ? li->prefix : "(no prefix)", format_name(li->format), naming_name(li->naming),
               li->num_experts, li->hidden_size, li->intermediate_size, li->has_norm ? "yes" : "no",
               (double)li->bytes / 1e6);
    }
    if (list) {
        for (int i = 0; i < megamoe_checkpoint_num_tensors(ck); i++) {
            const char *name;
            megamoe_tensor t;
            megamoe_checkpoint_tensor(ck, i, &name, &t);
            printf("  %-60s %-8s [", name, megamoe_dtype_name(t.dtype));
            for (int d = 0; d < t.ndim; d++)
                printf(d ? ", %lld" : "%lld", (long long)t.shape[d]);
            printf("]\n");
        }
    }
    free(infos);
    megamoe_checkpoint_close(ck);
    return 0;
}
