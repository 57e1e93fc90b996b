/*
 * cmd_quantize.c -- `megamoe quantize`: BF16 expert weights of a checkpoint to NVFP4.
 */
#include <getopt.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

static const char k_quantize_help[] =
    "usage: megamoe quantize IN OUT [--calib-tokens N] [--seed S] [--clamp C]\n"
    "\n"
    "Converts the BF16 expert weights of a checkpoint (stacked or per expert) to NVFP4 in the\n"
    "per-expert naming, ModelOpt-style: global scale amax/(6*448) per tensor, E4M3 block scales\n"
    "per 16, E2M1 codes rounded to nearest even. Every other tensor is copied unchanged.\n"
    "IN is a file (OUT becomes a file) or a folder (OUT becomes a folder with an index).\n"
    "\n"
    "The static input scales (input_scale) need activation statistics a weight file does not\n"
    "hold: they are estimated from N seeded random N(0,1) tokens run through each BF16 expert\n"
    "(default N=64). For production, calibrate on real data with your quantization toolkit.\n";

int cmd_quantize(int argc, char **argv) {
    static const struct option opts[] = {{"calib-tokens", required_argument, 0, 'n'},
                                         {"seed", required_argument, 0, 's'},
                                         {"clamp", required_argument, 0, 'C'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    megamoe_quantize_options o;
    megamoe_quantize_options_init(&o);
    o.progress = cli_progress;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int ok = 1;
        const char *want = "";
        switch (c) {
        case 'n': want = "an integer >= 1", ok = cli_parse_int(optarg, &o.calib_tokens) && o.calib_tokens > 0; break;
        case 's': want = "an integer in 0..2^64-1", ok = cli_parse_u64(optarg, &o.calib_seed); break;
        case 'C': want = "a number >= 0", ok = cli_parse_float(optarg, &o.activation_clamp); break;
        case 'h': fputs(k_quantize_help, stdout); return 0;
        default: fputs(k_quantize_help, stderr); return 2;
        }
        if (!ok) return cli_bad_value("quantize", opts, c, optarg, want);
    }
    if (argc - optind > 2) return cli_unexpected("quantize", argv[optind + 2], k_quantize_help);
    if (argc - optind != 2) return fputs(k_quantize_help, stderr), 2;
    char err[1024];
    megamoe_status st = megamoe_quantize_checkpoint(argv[optind], argv[optind + 1], &o, err, sizeof err);
    if (st) return cli_fail("quantize: %s: %s", megamoe_status_string(st), err);
    struct stat sb;
    if (stat(argv[optind + 1], &sb) != 0)
        return cli_fail("quantize: %s is missing after the write", argv[optind + 1]);
    fprintf(stderr, "wrote %s\n", argv[optind + 1]);
    return 0;
}
