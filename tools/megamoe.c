/*
 * megamoe.c -- the `megamoe` command: demo, run, bench, inspect, quantize.
 */
#include <string.h>

#include "cli.h"

static const char k_help[] =
    "usage: megamoe COMMAND [options]     (megamoe COMMAND --help for each)\n"
    "\n"
    "Runs the experts of a Mixture-of-Experts layer, expert-parallel, NVFP4 or BF16.\n"
    "\n"
    "commands:\n"
    "  demo       run an embedded model on the GPU if there is one, else the CPU, and check it\n"
    "  run        run a checkpoint's layer on an inputs file, write the outputs file\n"
    "  bench      time the forward of a layer of a given shape\n"
    "  inspect    show what a checkpoint holds\n"
    "  quantize   convert a checkpoint's BF16 expert weights to NVFP4\n"
    "  version    print the version\n";

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        fputs(k_help, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    static const struct {
        const char *name;
        int (*fn)(int, char **);
    } cmds[] = {{"demo", cmd_demo},
                {"run", cmd_run},
                {"bench", cmd_bench},
                {"inspect", cmd_inspect},
                {"quantize", cmd_quantize}};
    if (strcmp(argv[1], "version") == 0 || strcmp(argv[1], "--version") == 0) {
        static const char usage[] = "usage: megamoe version\n\nPrints the version.\n";
        if (argc > 2 && (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0))
            return fputs(usage, stdout), 0;
        if (argc > 2 && argv[2][0] == '-') {
            cli_fail("version: unrecognized option '%s'", argv[2]);
            return fputs(usage, stderr), 2;
        }
        if (argc > 2) return cli_unexpected("version", argv[2], usage);
        printf("megamoe %s\n", megamoe_version_string());
        return 0;
    }
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (strcmp(argv[1], cmds[i].name) == 0) return cmds[i].fn(argc - 1, argv + 1);
    cli_fail("unknown command '%s'", argv[1]);
    fputs(k_help, stderr);
    return 2;
}
