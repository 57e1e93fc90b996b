/*
 * safetensors.c -- reading (mmap, every byte of the header validated) and writing safetensors
 * files, and opening a checkpoint: one file, or the shards named by model.safetensors.index.json.
 *
 * Format: 8-byte little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {"key": "value"}}
 * then the data section; offsets are relative to its start. The JSON is parsed by jansson.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"

#define MM_MAX_HEADER (100u * 1000u * 1000u) /* the limit the reference implementation uses */

/* ---- Parsing one image ---------------------------------------------------------------------- */

void mm_st_entries_free(mm_st_entry *entries, int n) {
    if (!entries) return;
    for (int i = 0; i < n; i++)
        free(entries[i].name);
    free(entries);
}

static int cmp_entry_name(const void *a, const void *b) {
    return strcmp(((const mm_st_entry *)a)->name, ((const mm_st_entry *)b)->name);
}

static int cmp_entry_begin(const void *a, const void *b) {
    const mm_st_entry *x = *(const mm_st_entry *const *)a, *y = *(const mm_st_entry *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

/* Reads a JSON integer >= 0 (jansson keeps integers as long long). */
static int json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return 0;
    *out = (uint64_t)json_integer_value(v);
    return 1;
}

static megamoe_status parse_entry(const char *file, const char *name, json_t *v, uint64_t data_size,
                                  mm_st_entry *e, char *err) {
    if (!json_is_object(v)) {
        mm_set_error(err, "%s: tensor '%s': header entry is not a JSON object", file, name);
        return MEGAMOE_ERR_FORMAT;
    }
    json_t *dtype = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
    json_t *offs = json_object_get(v, "data_offsets");
    if (!json_is_string(dtype) || !json_is_array(shape) || !json_is_array(offs) ||
        json_array_size(offs) != 2) {
        mm_set_error(err,
                     "%s: tensor '%s': needs \"dtype\" (string), \"shape\" (array) and "
                     "\"data_offsets\" ([begin, end])",
                     file, name);
        return MEGAMOE_ERR_FORMAT;
    }
    e->dtype = megamoe_dtype_from_name(json_string_value(dtype));
    if (e->dtype == MEGAMOE_DTYPE_INVALID) {
        mm_set_error(err, "%s: tensor '%s': unknown dtype \"%s\"", file, name, json_string_value(dtype));
        return MEGAMOE_ERR_FORMAT;
    }
    if (json_array_size(shape) > MEGAMOE_MAX_DIMS) {
        mm_set_error(err, "%s: tensor '%s': %zu dimensions, at most %d are supported", file, name,
                     json_array_size(shape), MEGAMOE_MAX_DIMS);
        return MEGAMOE_ERR_FORMAT;
    }
    e->ndim = (int)json_array_size(shape);
    uint64_t bytes = megamoe_dtype_size(e->dtype);
    for (int d = 0; d < e->ndim; d++) {
        uint64_t dim;
        if (!json_u64(json_array_get(shape, (size_t)d), &dim) || dim > INT64_MAX ||
            mm_mul_overflows_u64(bytes, dim, &bytes)) {
            mm_set_error(err,
                         "%s: tensor '%s': shape entry %d is not a non-negative integer or the "
                         "size overflows",
                         file, name, d);
            return MEGAMOE_ERR_FORMAT;
        }
        e->shape[d] = (int64_t)dim;
    }
    if (!json_u64(json_array_get(offs, 0), &e->begin) || !json_u64(json_array_get(offs, 1), &e->end) ||
        e->begin > e->end) {
        mm_set_error(err, "%s: tensor '%s': data_offsets must be two integers 0 <= begin <= end", file, name);
        return MEGAMOE_ERR_FORMAT;
    }
    if (e->end > data_size) {
        mm_set_error(err,
                     "%s: tensor '%s': data_offsets [%llu, %llu] run past the end of the data "
                     "(%llu bytes)",
                     file, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                     (unsigned long long)data_size);
        return MEGAMOE_ERR_FORMAT;
    }
    if (e->end - e->begin != bytes) {
        mm_set_error(err, "%s: tensor '%s': %s shape needs %llu bytes but data_offsets span %llu", file, name,
                     megamoe_dtype_name(e->dtype), (unsigned long long)bytes,
                     (unsigned long long)(e->end - e->begin));
        return MEGAMOE_ERR_FORMAT;
    }
    return MEGAMOE_OK;
}

megamoe_status mm_safetensors_parse(const uint8_t *image, uint64_t size, const char *file,
                                    mm_st_entry **entries_out, int *num_out, uint64_t *data_offset,
                                    char *err) {
    *entries_out = NULL;
    *num_out = 0;
    if (size < 8) {
        mm_set_error(err,
                     "%s: %llu bytes is too short; a safetensors file starts with an 8-byte header "
                     "length",
                     file, (unsigned long long)size);
        return MEGAMOE_ERR_FORMAT;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | image[i];
    if (n > size - 8) {
        mm_set_error(err, "%s: header length %llu runs past the end of the file (%llu bytes)", file,
                     (unsigned long long)n, (unsigned long long)size);
        return MEGAMOE_ERR_FORMAT;
    }
    if (n > MM_MAX_HEADER) {
        mm_set_error(err, "%s: header length %llu is over the %u-byte limit", file, (unsigned long long)n,
                     MM_MAX_HEADER);
        return MEGAMOE_ERR_FORMAT;
    }
    json_error_t jerr;
    json_t *root = json_loadb((const char *)image + 8, (size_t)n, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        mm_set_error(err, "%s: header is not valid JSON: %s (line %d, column %d)", file, jerr.text, jerr.line,
                     jerr.column);
        return MEGAMOE_ERR_FORMAT;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        mm_set_error(err, "%s: header is not a JSON object", file);
        return MEGAMOE_ERR_FORMAT;
    }
    const uint64_t data_size = size - 8 - n;
    size_t cap = json_object_size(root);
    mm_st_entry *entries = calloc(cap ? cap : 1, sizeof *entries);
    if (!entries) {
        json_decref(root);
        mm_set_error(err, "%s: out of memory reading the header", file);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    int count = 0;
    megamoe_status st = MEGAMOE_OK;
    const char *key;
    json_t *value;
    json_object_foreach(root, key, value) {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(value)) {
                mm_set_error(err, "%s: __metadata__ is not a JSON object", file);
                st = MEGAMOE_ERR_FORMAT;
                break;
            }
            continue;
        }
        mm_st_entry *e = &entries[count];
        st = parse_entry(file, key, value, data_size, e, err);
        if (st) break;
        e->name = strdup(key);
        if (!e->name) {
            mm_set_error(err, "%s: out of memory", file);
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
            break;
        }
        count++;
    }
    json_decref(root);
    if (st == MEGAMOE_OK && count > 0) {
        /* No two tensors may share bytes. */
        const mm_st_entry **by_begin = malloc((size_t)count * sizeof *by_begin);
        if (!by_begin) {
            mm_set_error(err, "%s: out of memory", file);
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
        } else {
            for (int i = 0; i < count; i++)
                by_begin[i] = &entries[i];
            qsort(by_begin, (size_t)count, sizeof *by_begin, cmp_entry_begin);
            const mm_st_entry *prev = NULL;
            for (int i = 0; i < count && st == MEGAMOE_OK; i++) {
                const mm_st_entry *e = by_begin[i];
                if (e->begin == e->end) continue;
                if (prev && e->begin < prev->end) {
                    mm_set_error(
                        err, "%s: tensors '%s' and '%s' overlap (bytes [%llu, %llu) and [%llu, %llu))", file,
                        prev->name, e->name, (unsigned long long)prev->begin, (unsigned long long)prev->end,
                        (unsigned long long)e->begin, (unsigned long long)e->end);
                    st = MEGAMOE_ERR_FORMAT;
                }
                prev = e;
            }
            free(by_begin);
        }
    }
    if (st != MEGAMOE_OK) {
        mm_st_entries_free(entries, count);
        return st;
    }
    qsort(entries, (size_t)count, sizeof *entries, cmp_entry_name);
    *entries_out = entries;
    *num_out = count;
    *data_offset = 8 + n;
    return MEGAMOE_OK;
}

/* ---- Files and checkpoints ------------------------------------------------------------------ */

/* Opens a regular file for reading; anything else (a FIFO, a device, a folder) is refused without
 * blocking: O_NONBLOCK makes opening a FIFO return at once, and the type is checked on the opened file
 * so nothing can swap it in between. Returns the descriptor, or -1 with err set. */
static int open_regular(const char *path, struct stat *sb, char *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        mm_set_error(err, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    if (fstat(fd, sb) != 0 || !S_ISREG(sb->st_mode)) {
        close(fd);
        mm_set_error(err, "%s: not a regular file", path);
        return -1;
    }
    return fd;
}

static megamoe_status map_file(const char *path, mm_ck_file *f, char *err) {
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return MEGAMOE_ERR_OUT_OF_MEMORY;
    struct stat sb;
    const int fd = open_regular(path, &sb, err);
    if (fd < 0) return MEGAMOE_ERR_IO;
    f->size = (uint64_t)sb.st_size;
    if (f->size < 8) {
        close(fd);
        mm_set_error(err,
                     "%s: %llu bytes is too short; a safetensors file starts with an 8-byte header "
                     "length",
                     path, (unsigned long long)f->size);
        return MEGAMOE_ERR_FORMAT;
    }
    void *m = mmap(NULL, (size_t)f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        mm_set_error(err, "%s: cannot map: %s", path, strerror(errno));
        return MEGAMOE_ERR_IO;
    }
    f->map = m;
    return mm_safetensors_parse(f->map, f->size, path, &f->entries, &f->num_entries, &f->data_offset, err);
}

static void unmap_file(mm_ck_file *f) {
    if (f->map) munmap((void *)f->map, (size_t)f->size);
    mm_st_entries_free(f->entries, f->num_entries);
    free(f->path);
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const mm_ck_tensor *)a)->name, ((const mm_ck_tensor *)b)->name);
}

int mm_ck_lookup(const megamoe_checkpoint *ck, const char *name) {
    int lo = 0, hi = ck->num_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(ck->tensors[mid].name, name);
        if (c == 0) return mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

void mm_ck_view(const megamoe_checkpoint *ck, int i, megamoe_tensor *view) {
    const mm_ck_tensor *t = &ck->tensors[i];
    const mm_ck_file *f = &ck->files[t->file];
    memset(view, 0, sizeof *view);
    view->dtype = t->entry->dtype;
    view->ndim = t->entry->ndim;
    memcpy(view->shape, t->entry->shape, sizeof view->shape);
    view->data = f->map + f->data_offset + t->entry->begin;
}

/* Merges every file's tensors into one sorted table; a name in two files is an error. */
static megamoe_status build_table(megamoe_checkpoint *ck) {
    int total = 0;
    for (int f = 0; f < ck->num_files; f++)
        total += ck->files[f].num_entries;
    ck->tensors = calloc(total ? (size_t)total : 1, sizeof *ck->tensors);
    if (!ck->tensors) return MEGAMOE_ERR_OUT_OF_MEMORY;
    for (int f = 0; f < ck->num_files; f++)
        for (int i = 0; i < ck->files[f].num_entries; i++)
            ck->tensors[ck->num_tensors++] =
                (mm_ck_tensor){ck->files[f].entries[i].name, f, &ck->files[f].entries[i]};
    qsort(ck->tensors, (size_t)ck->num_tensors, sizeof *ck->tensors, cmp_tensor_name);
    for (int i = 1; i < ck->num_tensors; i++) {
        if (strcmp(ck->tensors[i - 1].name, ck->tensors[i].name) == 0) {
            mm_set_error(ck->error, "tensor '%s' appears in both %s and %s", ck->tensors[i].name,
                         ck->files[ck->tensors[i - 1].file].path, ck->files[ck->tensors[i].file].path);
            return MEGAMOE_ERR_FORMAT;
        }
    }
    return MEGAMOE_OK;
}

static megamoe_status add_file(megamoe_checkpoint *ck, const char *path) {
    mm_ck_file *files = realloc(ck->files, (size_t)(ck->num_files + 1) * sizeof *files);
    if (!files) return MEGAMOE_ERR_OUT_OF_MEMORY;
    ck->files = files;
    megamoe_status st = map_file(path, &ck->files[ck->num_files], ck->error);
    ck->num_files++; /* counted even on failure so close() unmaps it */
    return st;
}

static char *path_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static char *read_small_file(const char *path, size_t *len, char *err) {
    struct stat sb;
    const int fd = open_regular(path, &sb, err);
    if (fd < 0) return NULL;
    FILE *fp = fdopen(fd, "rb");
    if (!fp) {
        close(fd);
        mm_set_error(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 65536;
            char *nb = cap > MM_MAX_HEADER ? NULL : realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(fp);
                mm_set_error(err, "%s: too large or out of memory", path);
                return NULL;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n, fp);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(fp);
    fclose(fp);
    if (bad) {
        free(buf);
        mm_set_error(err, "%s: read error", path);
        return NULL;
    }
    *len = n;
    return buf;
}

/* Opens every shard an index names and checks each tensor is in the shard the index says. */
static megamoe_status open_index(megamoe_checkpoint *ck, const char *index_path) {
    size_t len = 0;
    char *text = read_small_file(index_path, &len, ck->error);
    if (!text) return MEGAMOE_ERR_IO;
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!root) {
        mm_set_error(ck->error, "%s: not valid JSON: %s (line %d, column %d)", index_path, jerr.text,
                     jerr.line, jerr.column);
        return MEGAMOE_ERR_FORMAT;
    }
    megamoe_status st = MEGAMOE_OK;
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map)) {
        mm_set_error(ck->error, "%s: no \"weight_map\" object", index_path);
        json_decref(root);
        return MEGAMOE_ERR_FORMAT;
    }
    char *dir = strdup(index_path);
    if (!dir) {
        json_decref(root);
        return MEGAMOE_ERR_OUT_OF_MEMORY;
    }
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        strcpy(dir, ".");
    const char *key;
    json_t *value;
    /* Pass 1: open each distinct shard once. */
    json_object_foreach(map, key, value) {
        if (!json_is_string(value) || strstr(json_string_value(value), "..") ||
            json_string_value(value)[0] == '/') {
            mm_set_error(ck->error, "%s: weight_map[\"%s\"] must be a file name inside the folder",
                         index_path, key);
            st = MEGAMOE_ERR_FORMAT;
            break;
        }
        char *path = path_join(dir, json_string_value(value));
        if (!path) {
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
            break;
        }
        int seen = 0;
        for (int f = 0; f < ck->num_files && !seen; f++)
            seen = strcmp(ck->files[f].path, path) == 0;
        if (!seen) st = add_file(ck, path);
        free(path);
        if (st) break;
    }
    if (st == MEGAMOE_OK) st = build_table(ck);
    /* Pass 2: every tensor the index names is in its shard. */
    if (st == MEGAMOE_OK) {
        json_object_foreach(map, key, value) {
            int i = mm_ck_lookup(ck, key);
            char *path = path_join(dir, json_string_value(value));
            if (!path) {
                st = MEGAMOE_ERR_OUT_OF_MEMORY;
                break;
            }
            if (i < 0 || strcmp(ck->files[ck->tensors[i].file].path, path) != 0) {
                mm_set_error(ck->error, "%s: tensor '%s' is listed in %s but that file does not hold it",
                             index_path, key, path);
                st = MEGAMOE_ERR_FORMAT;
            }
            free(path);
            if (st) break;
        }
    }
    free(dir);
    json_decref(root);
    return st;
}

static int has_suffix(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static megamoe_status open_folder(megamoe_checkpoint *ck, const char *dir) {
    char *index = path_join(dir, "model.safetensors.index.json");
    if (!index) return MEGAMOE_ERR_OUT_OF_MEMORY;
    struct stat sb;
    if (stat(index, &sb) == 0) {
        megamoe_status st = open_index(ck, index);
        free(index);
        return st;
    }
    free(index);
    DIR *d = opendir(dir);
    if (!d) {
        mm_set_error(ck->error, "%s: cannot open folder: %s", dir, strerror(errno));
        return MEGAMOE_ERR_IO;
    }
    char *single = NULL, *other_index = NULL;
    int count = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (has_suffix(de->d_name, ".safetensors")) {
            count++;
            if (!single) single = path_join(dir, de->d_name);
        } else if (has_suffix(de->d_name, ".safetensors.index.json") && !other_index) {
            other_index = path_join(dir, de->d_name);
        }
    }
    closedir(d);
    megamoe_status st;
    if (other_index) {
        st = open_index(ck, other_index);
    } else if (count == 1 && single) {
        st = add_file(ck, single);
        if (st == MEGAMOE_OK) st = build_table(ck);
    } else {
        mm_set_error(ck->error, "%s: folder holds %d .safetensors files and no model.safetensors.index.json",
                     dir, count);
        st = MEGAMOE_ERR_FORMAT;
    }
    free(single);
    free(other_index);
    return st;
}

megamoe_status megamoe_checkpoint_open(const char *path, megamoe_checkpoint **out) {
    if (!out) return MEGAMOE_ERR_INVALID_ARGUMENT;
    megamoe_checkpoint *ck = calloc(1, sizeof *ck);
    *out = ck;
    if (!ck) return MEGAMOE_ERR_OUT_OF_MEMORY;
    if (!path) {
        mm_set_error(ck->error, "checkpoint path is NULL");
        return MEGAMOE_ERR_INVALID_ARGUMENT;
    }
    struct stat sb;
    if (stat(path, &sb) != 0) {
        mm_set_error(ck->error, "%s: %s", path, strerror(errno));
        return MEGAMOE_ERR_IO;
    }
    if (S_ISDIR(sb.st_mode)) return open_folder(ck, path);
    if (has_suffix(path, ".json")) return open_index(ck, path);
    megamoe_status st = add_file(ck, path);
    if (st == MEGAMOE_OK) st = build_table(ck);
    return st;
}

void megamoe_checkpoint_close(megamoe_checkpoint *ck) {
    if (!ck) return;
    for (int f = 0; f < ck->num_files; f++)
        unmap_file(&ck->files[f]);
    free(ck->files);
    free(ck->tensors);
    free(ck);
}

const char *megamoe_checkpoint_last_error(const megamoe_checkpoint *ck) {
    return ck ? ck->error : "checkpoint is NULL";
}

int megamoe_checkpoint_num_tensors(const megamoe_checkpoint *ck) { return ck ? ck->num_tensors : 0; }

megamoe_status megamoe_checkpoint_tensor(const megamoe_checkpoint *ck, int i, const char **name,
                                         megamoe_tensor *view) {
    if (!ck || i < 0 || i >= ck->num_tensors) return MEGAMOE_ERR_INVALID_ARGUMENT;
    if (name) *name = ck->tensors[i].name;
    if (view) mm_ck_view(ck, i, view);
    return MEGAMOE_OK;
}

megamoe_status megamoe_checkpoint_find(const megamoe_checkpoint *ck, const char *name, megamoe_tensor *view) {
    if (!ck || !name) return MEGAMOE_ERR_INVALID_ARGUMENT;
    int i = mm_ck_lookup(ck, name);
    if (i < 0) return MEGAMOE_ERR_BAD_WEIGHT;
    if (view) mm_ck_view(ck, i, view);
    return MEGAMOE_OK;
}

int megamoe_checkpoint_num_files(const megamoe_checkpoint *ck) { return ck ? ck->num_files : 0; }

const char *megamoe_checkpoint_file(const megamoe_checkpoint *ck, int i) {
    return ck && i >= 0 && i < ck->num_files ? ck->files[i].path : NULL;
}

/* ---- Writing --------------------------------------------------------------------------------- */

static int cmp_named(const void *a, const void *b) {
    return strcmp((*(const megamoe_named_tensor *const *)a)->name,
                  (*(const megamoe_named_tensor *const *)b)->name);
}

megamoe_status megamoe_safetensors_write(const char *path, const megamoe_named_tensor *tensors, int n,
                                         char *err, size_t err_size) {
    char msg[MM_ERR_LEN] = "";
    megamoe_status st = MEGAMOE_OK;
    const megamoe_named_tensor **order = NULL;
    json_t *root = NULL;
    char *header = NULL, *tmp = NULL;
    FILE *fp = NULL;
    if (!path || n < 0 || (n > 0 && !tensors)) {
        mm_set_error(msg, "megamoe_safetensors_write: bad arguments");
        st = MEGAMOE_ERR_INVALID_ARGUMENT;
        goto done;
    }
    order = malloc((size_t)(n ? n : 1) * sizeof *order);
    root = json_object();
    if (!order || !root) {
        st = MEGAMOE_ERR_OUT_OF_MEMORY;
        goto done;
    }
    for (int i = 0; i < n; i++)
        order[i] = &tensors[i];
    qsort(order, (size_t)n, sizeof *order, cmp_named);
    uint64_t offset = 0;
    for (int i = 0; i < n; i++) {
        const megamoe_tensor *t = &order[i]->tensor;
        if (!order[i]->name || (i > 0 && strcmp(order[i - 1]->name, order[i]->name) == 0) ||
            megamoe_dtype_size(t->dtype) == 0 || t->ndim < 0 || t->ndim > MEGAMOE_MAX_DIMS) {
            mm_set_error(msg, "%s: tensor '%s' has no name, a duplicate name, or a bad dtype/shape", path,
                         order[i]->name ? order[i]->name : "(null)");
            st = MEGAMOE_ERR_INVALID_ARGUMENT;
            goto done;
        }
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->shape[d]));
        const uint64_t bytes = (uint64_t)megamoe_tensor_numel(t) * megamoe_dtype_size(t->dtype);
        json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype", megamoe_dtype_name(t->dtype), "shape", shape,
                              "data_offsets", (json_int_t)offset, (json_int_t)(offset + bytes));
        if (!e || json_object_set_new(root, order[i]->name, e) != 0) {
            st = MEGAMOE_ERR_OUT_OF_MEMORY;
            goto done;
        }
        offset += bytes;
    }
    json_object_set_new(root, "__metadata__", json_pack("{s:s}", "format", "pt"));
    header = json_dumps(root, JSON_COMPACT | JSON_SORT_KEYS);
    if (!header) {
        st = MEGAMOE_ERR_OUT_OF_MEMORY;
        goto done;
    }
    size_t hlen = strlen(header);
    const size_t padded = (hlen + 7) / 8 * 8; /* data starts 8-byte aligned */
    size_t tlen = strlen(path) + 8;
    tmp = malloc(tlen);
    if (!tmp) {
        st = MEGAMOE_ERR_OUT_OF_MEMORY;
        goto done;
    }
    snprintf(tmp, tlen, "%s.tmp", path);
    fp = fopen(tmp, "wb");
    if (!fp) {
        mm_set_error(msg, "%s: cannot create: %s", tmp, strerror(errno));
        st = MEGAMOE_ERR_IO;
        goto done;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    int ok = fwrite(len8, 1, 8, fp) == 8 && fwrite(header, 1, hlen, fp) == hlen;
    for (size_t i = hlen; ok && i < padded; i++)
        ok = fputc(' ', fp) != EOF;
    for (int i = 0; ok && i < n; i++) {
        const megamoe_tensor *t = &order[i]->tensor;
        const size_t bytes = (size_t)megamoe_tensor_numel(t) * megamoe_dtype_size(t->dtype);
        ok = bytes == 0 || fwrite(t->data, 1, bytes, fp) == bytes;
    }
    if (fclose(fp) != 0) ok = 0;
    fp = NULL;
    if (!ok || rename(tmp, path) != 0) {
        mm_set_error(msg, "%s: write failed: %s", path, strerror(errno));
        remove(tmp);
        st = MEGAMOE_ERR_IO;
    }
done:
    if (st == MEGAMOE_ERR_OUT_OF_MEMORY && !msg[0]) mm_set_error(msg, "%s: out of memory", path ? path : "");
    if (fp) fclose(fp);
    free(tmp);
    free(header);
    json_decref(root);
    free(order);
    if (st != MEGAMOE_OK && err && err_size) snprintf(err, err_size, "%s", msg);
    return st;
}
