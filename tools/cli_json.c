/*
 * cli_json.c -- the benchmark records of `megamoe bench --json` (JSON Lines, one object per point).
 */
#include <jansson.h>
#include <stdlib.h>
#include <time.h>

#include "cli.h"
#include "megamoe_commit.h" /* MEGAMOE_COMMIT, generated at build time */

const char *cli_activations_name(const megamoe_layer_config *cfg) {
    /* An NVFP4 layer's activation mode (SPEC §3b); a BF16 layer has no such setting (null in the
     * record, as bench/records.py has it). */
    if (cfg->format != MEGAMOE_FORMAT_NVFP4) return NULL;
    return cfg->activations == MEGAMOE_ACTIVATIONS_NVFP4 ? "nvfp4" : "bf16";
}

int cli_bench_json_record(FILE *f, const char *shape, const char *format, const char *activations, int T,
                          double median_ms, double min_ms, double max_ms, double tflops, double weight_gbps,
                          double pct_copy, const char *gpu) {
    char date[32];
    const time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *o =
        json_pack("{s:s, s:s, s:o, s:i, s:f, s:f, s:f, s:f, s:f, s:o, s:s, s:s, s:s, s:s}", "shape", shape,
                  "format", format, "activations", activations ? json_string(activations) : json_null(), "T",
                  T, "median_ms", median_ms, "min_ms", min_ms, "max_ms", max_ms, "tflops", tflops,
                  "weight_gbps", weight_gbps, "pct_copy", pct_copy >= 0 ? json_real(pct_copy) : json_null(),
                  "commit", MEGAMOE_COMMIT, "gpu", gpu, "date", date, "source", "megamoe");
    if (!o) return 1;
    char *line = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!line) return 1;
    const int bad = fprintf(f, "%s\n", line) < 0 || fflush(f) != 0;
    free(line);
    return bad;
}
