/*
 * cmd_run.c -- `megamoe run`: a checkpoint's layer on an inputs file.
 */
#include <getopt.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char k_run_help[] =
    "usage: megamoe run --checkpoint PATH --input IN --output OUT [options]\n"
    "\n"
    "Runs one MoE experts layer of a checkpoint on the tokens of IN and writes OUT.\n"
    "\n"
    "  --checkpoint PATH     a .safetensors file, or a folder with model.safetensors.index.json\n"
    "  --prefix P            the layer's tensor-name prefix, e.g. model.layers.3.mlp\n"
    "                        (needed only when the checkpoint holds several MoE layers)\n"
    "  --input IN            safetensors with hidden_states [T,H] BF16, topk_ids [T,K] I32,\n"
    "                        topk_weights [T,K] F32 and optionally is_padding [T] BOOL\n"
    "  --output OUT          safetensors that gets y [T,H] BF16\n"
    "  --ranks R             expert-parallel ranks (default 1); tokens are split over them in\n"
    "                        contiguous chunks; y does not depend on R\n"
    "  --backend cpu|cuda    where to run (default cpu)\n"
    "  --gpus N              run on N GPUs of this machine, one NCCL rank each (tokens split in\n"
    "                        contiguous chunks; implies the NCCL backend)\n"
    "  --threads N           CPU worker threads (default: one per core)\n"
    "  --max-tokens N        T_max per rank (default: the tokens of the largest chunk)\n"
    "  --norm-eps X          post-expert RMSNorm epsilon (default 1e-6)\n"
    "  --norm-zero-centered  the norm weight is stored zero-centered: gamma = weight + center\n"
    "  --norm-gain-center C  that center (default 1.0)\n"
    "  --clamp C             clamp gate and up to C before SwiGLU (default off)\n"
    "  --activations bf16|nvfp4\n"
    "                        an NVFP4 layer's activations: bf16 (default; W4A16) keeps them\n"
    "                        unquantized, nvfp4 quantizes them per token (SPEC §3b); a BF16\n"
    "                        layer takes bf16 only\n"
    "\n"
    "E, H, I and the weight format come from the checkpoint, K from topk_ids. A token whose\n"
    "hidden state holds NaN or Inf gets a NaN row; a token with no valid slot a zero row.\n";

typedef struct inputs {
    megamoe_checkpoint *file;
    megamoe_tensor x, ids, weights, padding;
    int has_padding, T, K, H;
} inputs;

static int open_inputs(const char *path, inputs *in) {
    memset(in, 0, sizeof *in);
    megamoe_status st = megamoe_checkpoint_open(path, &in->file);
    if (st) return cli_fail("%s", megamoe_checkpoint_last_error(in->file));
    if (megamoe_checkpoint_find(in->file, "hidden_states", &in->x) ||
        megamoe_checkpoint_find(in->file, "topk_ids", &in->ids) ||
        megamoe_checkpoint_find(in->file, "topk_weights", &in->weights))
        return cli_fail("%s: needs tensors hidden_states, topk_ids and topk_weights", path);
    in->has_padding = megamoe_checkpoint_find(in->file, "is_padding", &in->padding) == MEGAMOE_OK;
    /* Every dimension fits an int before it is narrowed (a [0, 2^32 + 2] tensor holds no data). */
    const megamoe_tensor *all[4] = {&in->x, &in->ids, &in->weights, &in->padding};
    const char *names[4] = {"hidden_states", "topk_ids", "topk_weights", "is_padding"};
    for (int i = 0; i < (in->has_padding ? 4 : 3); i++)
        for (int d = 0; d < all[i]->ndim; d++)
            if (all[i]->shape[d] > 2147483647)
                return cli_fail("%s: %s has %lld in dimension %d, more than the 2^31 - 1 a size can be", path,
                                names[i], (long long)all[i]->shape[d], d);
    if (in->x.ndim != 2 || in->x.dtype != MEGAMOE_DTYPE_BF16)
        return cli_fail("%s: hidden_states must be [T, H] BF16, got %s with %d dims", path,
                        megamoe_dtype_name(in->x.dtype), in->x.ndim);
    in->T = (int)in->x.shape[0];
    in->H = (int)in->x.shape[1];
    if (in->ids.ndim != 2 || in->ids.dtype != MEGAMOE_DTYPE_I32 || in->ids.shape[0] != in->T)
        return cli_fail("%s: topk_ids must be [T=%d, K] I32", path, in->T);
    in->K = (int)in->ids.shape[1];
    if (in->weights.ndim != 2 || in->weights.dtype != MEGAMOE_DTYPE_F32 || in->weights.shape[0] != in->T ||
        in->weights.shape[1] != in->K)
        return cli_fail("%s: topk_weights must be [T=%d, K=%d] F32", path, in->T, in->K);
    if (in->has_padding &&
        (in->padding.ndim != 1 || in->padding.shape[0] != in->T ||
         (in->padding.dtype != MEGAMOE_DTYPE_BOOL && in->padding.dtype != MEGAMOE_DTYPE_U8)))
        return cli_fail("%s: is_padding must be [T=%d] BOOL", path, in->T);
    return 0;
}

/* Copies a mapped tensor into aligned memory (mapped data need not be aligned). */
static void *aligned_copy(const megamoe_tensor *t) {
    size_t n = (size_t)megamoe_tensor_numel(t) * megamoe_dtype_size(t->dtype);
    void *p = malloc(n ? n : 1);
    if (p && n) memcpy(p, t->data, n);
    return p;
}

int cmd_run(int argc, char **argv) {
    static const struct option opts[] = {{"checkpoint", required_argument, 0, 'c'},
                                         {"prefix", required_argument, 0, 'p'},
                                         {"input", required_argument, 0, 'i'},
                                         {"output", required_argument, 0, 'o'},
                                         {"ranks", required_argument, 0, 'r'},
                                         {"gpus", required_argument, 0, 'G'},
                                         {"backend", required_argument, 0, 'b'},
                                         {"threads", required_argument, 0, 't'},
                                         {"max-tokens", required_argument, 0, 'm'},
                                         {"norm-eps", required_argument, 0, 'e'},
                                         {"norm-zero-centered", no_argument, 0, 'z'},
                                         {"norm-gain-center", required_argument, 0, 'g'},
                                         {"clamp", required_argument, 0, 'C'},
                                         {"activations", required_argument, 0, 'a'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *ckpt = NULL, *prefix = "", *in_path = NULL, *out_path = NULL;
    int ranks = 1, threads = 0, max_tokens = 0, gpus = 0, activations = MEGAMOE_ACTIVATIONS_BF16;
    megamoe_backend backend = MEGAMOE_BACKEND_CPU;
    megamoe_layer_config cfg;
    megamoe_layer_config_init(&cfg);
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int ok = 1;
        const char *want = "";
        switch (c) {
        case 'c': ckpt = optarg; break;
        case 'p': prefix = optarg; break;
        case 'i': in_path = optarg; break;
        case 'o': out_path = optarg; break;
        case 'r': want = "an integer in 1..72", ok = cli_parse_int(optarg, &ranks); break;
        case 'G': want = "an integer >= 1", ok = cli_parse_int(optarg, &gpus) && gpus >= 1; break;
        case 't': want = "an integer in 0..1024", ok = cli_parse_int(optarg, &threads); break;
        case 'm': want = "an integer in 1..2147483647", ok = cli_parse_int(optarg, &max_tokens) && max_tokens >= 1; break;
        case 'e': want = "a number > 0", ok = cli_parse_float(optarg, &cfg.norm_eps); break;
        case 'z': cfg.norm_zero_centered = 1; break;
        case 'g': want = "a number", ok = cli_parse_float(optarg, &cfg.norm_gain_center); break;
        case 'C': want = "a number >= 0", ok = cli_parse_float(optarg, &cfg.activation_clamp); break;
        case 'a': want = "bf16 or nvfp4", ok = cli_parse_activations(optarg, &activations); break;
        case 'b': want = "cpu or cuda", ok = cli_parse_backend(optarg, 0, &backend); break;
        case 'h': fputs(k_run_help, stdout); return 0;
        default: fputs(k_run_help, stderr); return 2;
        }
        if (!ok) return cli_bad_value("run", opts, c, optarg, want);
    }
    if (optind < argc) return cli_unexpected("run", argv[optind], k_run_help);
    if (!ckpt || !in_path || !out_path) {
        fputs(k_run_help, stderr);
        return 2;
    }
    if (cli_check_threads("run", threads) || (gpus == 0 && cli_check_ranks("run", ranks))) return 1;
    /* The output never replaces an input: not the inputs file, not a file of the checkpoint. */
    if (cli_same_file(out_path, in_path) || cli_same_file(out_path, ckpt))
        return cli_fail("run: --output %s would replace the input %s", out_path,
                        cli_same_file(out_path, in_path) ? in_path : ckpt);
    if (backend == MEGAMOE_BACKEND_CUDA && !megamoe_backend_available(MEGAMOE_BACKEND_CUDA))
        return cli_fail("run: --backend cuda: no usable CUDA device (sm_90) or this build has no CUDA "
                        "backend; use --backend cpu");

    megamoe_checkpoint *ck = NULL;
    inputs in;
    memset(&in, 0, sizeof in);
    cli_layer L = {0};
    void *x = NULL, *ids = NULL, *w = NULL, *pad = NULL;
    uint16_t *y = NULL;
    int rc = 1;
    megamoe_status st = megamoe_checkpoint_open(ckpt, &ck);
    if (st) {
        cli_fail("%s", megamoe_checkpoint_last_error(ck));
        goto done;
    }
    for (int f = 0; f < megamoe_checkpoint_num_files(ck); f++)
        if (cli_same_file(out_path, megamoe_checkpoint_file(ck, f))) {
            cli_fail("run: --output %s would replace the checkpoint file %s", out_path,
                     megamoe_checkpoint_file(ck, f));
            goto done;
        }
    megamoe_layer_info info;
    st = megamoe_checkpoint_describe_layer(ck, prefix, &info);
    if (st) {
        cli_fail("%s: %s", ckpt, megamoe_checkpoint_last_error(ck));
        goto done;
    }
    if (open_inputs(in_path, &in)) goto done;
    if (in.H != info.hidden_size) {
        cli_fail("%s: hidden_states has H=%d but the layer '%s' has H=%d", in_path, in.H, info.prefix,
                 info.hidden_size);
        goto done;
    }
    if (gpus > 0) ranks = gpus; /* one rank per GPU */
    const int chunk = (int)(((int64_t)in.T + ranks - 1) / ranks);
    cfg.name = info.prefix[0] ? info.prefix : "moe";
    cfg.num_experts = info.num_experts;
    cfg.top_k = in.K;
    cfg.hidden_size = info.hidden_size;
    cfg.intermediate_size = info.intermediate_size;
    cfg.format = info.format;
    cfg.activations = (megamoe_activations)activations;
    cfg.max_tokens = max_tokens > 0 ? max_tokens : (chunk > 0 ? chunk : 1);
    x = aligned_copy(&in.x);
    ids = aligned_copy(&in.ids);
    w = aligned_copy(&in.weights);
    pad = in.has_padding ? aligned_copy(&in.padding) : NULL;
    y = malloc((size_t)in.T * (size_t)in.H * 2 + 2);
    if (!x || !ids || !w || !y || (in.has_padding && !pad)) {
        cli_fail("out of memory");
        goto done;
    }
    /* Bad routing is refused before any forward, so no partial y is ever written. Device backends read
     * the weights on the device, where the library does not check them: checked here too. */
    if (cli_check_routing(in_path, in.T, in.K, info.num_experts, ids, w, pad,
                          gpus > 0 || backend != MEGAMOE_BACKEND_CPU)) {
        fprintf(stderr, "megamoe: %s not written\n", out_path);
        goto done;
    }
    if (gpus > 0) {
        if (cli_run_gpus(gpus, &cfg, ck, info.prefix, in.T, in.K, in.H, x, ids, w, pad, y)) goto done;
        goto write;
    }
    if (cli_layer_create(backend, ranks, threads, &cfg, &L)) goto done;
    st = megamoe_layer_load_checkpoint(L.layer, ck, info.prefix, cli_progress, NULL);
    if (st == MEGAMOE_OK) st = megamoe_layer_finalize(L.layer);
    if (st) {
        cli_fail("%s: %s", megamoe_status_string(st), megamoe_layer_last_error(L.layer));
        goto done;
    }
    st = backend == MEGAMOE_BACKEND_CPU
             ? cli_forward_split(&L, in.T, in.K, in.H, x, ids, w, pad, y)
             : cli_forward_split_device(&L, in.T, in.K, in.H, x, ids, w, pad, y, 0, NULL);
    if (st) {
        cli_fail("%s: %s (%s not written)", megamoe_status_string(st), megamoe_layer_last_error(L.layer),
                 out_path);
        goto done;
    }
write:
    cli_warn_nonfinite_y(in.T, in.H, x, pad, y);
    megamoe_named_tensor out = {"y", {MEGAMOE_DTYPE_BF16, 2, {in.T, in.H}, y}};
    char err[1024];
    st = megamoe_safetensors_write(out_path, &out, 1, err, sizeof err);
    if (st) {
        cli_fail("%s", err);
        goto done;
    }
    fprintf(stderr, "wrote y [%d, %d] to %s\n", in.T, in.H, out_path);
    rc = 0;
done:
    free(x), free(ids), free(w), free(pad), free(y);
    cli_layer_destroy(&L);
    megamoe_checkpoint_close(in.file);
    megamoe_checkpoint_close(ck);
    return rc;
}
