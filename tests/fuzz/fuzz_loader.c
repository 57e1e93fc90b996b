/*
 * fuzz_loader.c -- libFuzzer target for the checkpoint side behind `megamoe inspect`, `run` and
 * `quantize`: the index reader, the naming styles, the weight loader with its validation, and the
 * converter. Any input must give a loaded layer or an error; never a crash, a leak or an out-of-bounds
 * access. Built and run by tests/fuzz/run.sh; tests/fuzz/make_seeds.py writes the seed corpus.
 *
 * An input is a checkpoint in a compact form, expanded into files of a private temporary folder:
 *   byte 0        flags: bit 0 a folder with model.safetensors.index.json (else one file), bit 1 two
 *                 ranks (else one), bit 2 also quantize it, bit 3 the prefix "model.layers.0.mlp"
 *   bytes 1..4    data bytes D per shard (little endian, modulo 256 KiB)
 *   then three length-prefixed (u16, little endian) sections: the index JSON, shard a's header JSON,
 *   shard b's header JSON; the remaining bytes are the pattern the data regions are filled with.
 * Shard x.safetensors is u64 header length, the header, then D bytes of the pattern repeated.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "megamoe.h"

static char g_dir[256];

/* Writes a then b as the whole content of the folder's file `name`. The file is rewritten in place and
 * cut to length rather than removed and created again: on tmpfs that reuses its pages, which makes the
 * next input's write a copy instead of page allocations. */
static int write_file(const char *name, const uint8_t *a, size_t na, const uint8_t *b, size_t nb) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    const int fd = open(path, O_WRONLY | O_CREAT, 0600);
    if (fd < 0) return 0;
    int ok = 1;
    const uint8_t *part[2] = {a, b};
    const size_t len[2] = {na, nb};
    off_t at = 0;
    for (int i = 0; i < 2 && ok; i++)
        for (size_t done = 0; done < len[i] && ok;) {
            const ssize_t n = pwrite(fd, part[i] + done, len[i] - done, at);
            ok = n > 0;
            done += ok ? (size_t)n : 0, at += ok ? n : 0;
        }
    ok = ok && ftruncate(fd, at) == 0;
    return close(fd) == 0 && ok;
}

/* data[0..D) = the pattern repeated (bytes 0, 1, 2, ... when it is empty): one copy of it, then
 * doubling memcpy, so that a large region costs a few copies, not one loop step per byte. */
static void fill_pattern(uint8_t *data, size_t D, const uint8_t *fill, size_t nf) {
    if (D == 0) return;
    size_t have = 0;
    if (nf == 0)
        for (; have < D && have < 256; have++)
            data[have] = (uint8_t)have;
    else {
        have = nf < D ? nf : D;
        memcpy(data, fill, have);
    }
    while (have < D) {
        const size_t n = have < D - have ? have : D - have;
        memcpy(data + have, data, n);
        have += n;
    }
}

/* Writes shard `name`: the u64 header length, the header, then the data region data[0..D). */
static int write_shard(const char *name, const uint8_t *hdr, size_t nh, const uint8_t *data, size_t D) {
    uint8_t head[8 + 65536]; /* a header is at most 65535 bytes (a u16 length) */
    for (int i = 0; i < 8; i++)
        head[i] = (uint8_t)((uint64_t)nh >> (8 * i));
    if (nh) memcpy(head + 8, hdr, nh);
    return write_file(name, head, 8 + nh, data, D);
}

/* Removes the folder's files: the quantizer's output after every input (the next input starts without
 * it), the inputs' files too at exit (in between they are rewritten in place; one-file inputs read only
 * a.safetensors, and a folder input writes all three). */
static void remove_files(int all) {
    static const char *const names[] = {"q.safetensors", "q.safetensors.tmp", "a.safetensors",
                                        "b.safetensors", "model.safetensors.index.json"};
    char path[512];
    for (size_t i = 0; i < (all ? 5u : 2u); i++) {
        snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
        unlink(path);
    }
}

/* Loads the described layer into a CPU group when it is small enough to be quick. */
static void load_layer(megamoe_checkpoint *ck, const char *prefix, int ranks) {
    megamoe_layer_info info;
    if (megamoe_checkpoint_describe_layer(ck, prefix, &info) != MEGAMOE_OK) return;
    if ((int64_t)info.num_experts * info.hidden_size * info.intermediate_size > 4 * 256 * 512)
        return; /* quick to load */
    megamoe_group_config gc;
    megamoe_group_config_init(&gc);
    gc.num_ranks = ranks;
    gc.num_threads = 1;
    megamoe_group *g = NULL;
    megamoe_layer *l = NULL;
    if (megamoe_group_create(&gc, &g) == MEGAMOE_OK) {
        megamoe_layer_config c;
        megamoe_layer_config_init(&c);
        c.num_experts = info.num_experts, c.top_k = 1, c.hidden_size = info.hidden_size;
        c.intermediate_size = info.intermediate_size, c.format = info.format, c.max_tokens = 1;
        if (megamoe_layer_create(g, &c, &l) == MEGAMOE_OK &&
            megamoe_layer_load_checkpoint(l, ck, info.prefix, NULL, NULL) == MEGAMOE_OK)
            megamoe_layer_finalize(l);
    }
    megamoe_layer_destroy(l);
    megamoe_group_destroy(g);
}

static void remove_dir(void) {
    remove_files(1);
    rmdir(g_dir);
}

int LLVMFuzzerTestOneInput(const uint8_t *in, size_t size) {
    if (!g_dir[0]) { /* a private folder for the process's files, in memory where there is /dev/shm */
        const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(g_dir, sizeof g_dir, "%s/megamoe-fuzz-loader-XXXXXX", base);
        if (!mkdtemp(g_dir)) abort();
        atexit(remove_dir);
    }
    if (size < 5) return 0;
    const int flags = in[0];
    const size_t D =
        ((size_t)in[1] | (size_t)in[2] << 8 | (size_t)in[3] << 16 | (size_t)in[4] << 24) % (1u << 18);
    const uint8_t *p = in + 5, *end = in + size, *sec[3];
    size_t len[3];
    for (int i = 0; i < 3; i++) {
        if (end - p < 2) return 0;
        len[i] = (size_t)p[0] | (size_t)p[1] << 8;
        p += 2;
        if ((size_t)(end - p) < len[i]) return 0;
        sec[i] = p;
        p += len[i];
    }
    /* One data buffer for the process (fresh allocations of this size cost page faults per input). */
    static uint8_t data[1u << 18];
    fill_pattern(data, D, p, (size_t)(end - p));
    const int folder = flags & 1;
    int ok = write_shard("a.safetensors", sec[1], len[1], data, D);
    if (folder)
        ok = ok && write_shard("b.safetensors", sec[2], len[2], data, D) &&
             write_file("model.safetensors.index.json", sec[0], len[0], NULL, 0);
    if (!ok) abort(); /* the temporary folder must be writable */
    char path[512];
    snprintf(path, sizeof path, folder ? "%s" : "%s/a.safetensors", g_dir);
    megamoe_checkpoint *ck = NULL;
    if (megamoe_checkpoint_open(path, &ck) == MEGAMOE_OK) {
        for (int i = 0; i < megamoe_checkpoint_num_tensors(ck); i++) { /* what inspect prints */
            const char *name;
            megamoe_tensor t;
            if (megamoe_checkpoint_tensor(ck, i, &name, &t) != MEGAMOE_OK || !name) abort();
        }
        megamoe_layer_info infos[4];
        int found = 0;
        if (megamoe_checkpoint_find_layers(ck, infos, 4, &found) == MEGAMOE_OK)
            for (int i = 0; i < found && i < 4; i++)
                load_layer(ck, infos[i].prefix, (flags & 2) ? 2 : 1);
        load_layer(ck, (flags & 8) ? "model.layers.0.mlp" : "", (flags & 2) ? 2 : 1);
    }
    megamoe_checkpoint_close(ck);
    if (flags & 4) {
        megamoe_quantize_options o;
        megamoe_quantize_options_init(&o);
        o.calib_tokens = 1;
        char out[512], err[256];
        snprintf(out, sizeof out, "%s/q.safetensors", g_dir);
        if (!folder) megamoe_quantize_checkpoint(path, out, &o, err, sizeof err);
    }
    remove_files(0);
    return 0;
}
