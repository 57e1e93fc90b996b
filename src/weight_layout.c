/*
 * weight_layout.c -- packing expert weights into the kernel layout of weight_layout.h (at the padded
 * I), and the inverse (tested as a round trip on the CPU).
 */
#include "weight_layout.h"

#include <stdlib.h>
#include <string.h>

/* Visits every (checkpoint element, kernel position) pair of a [rows, K] matrix. */
#define FOR_EACH_FRAGMENT_ELEMENT(BODY)                                                                      \
    for (int64_t q = 0; q < rows / 16; q++)                                                                  \
        for (int64_t kc = 0; kc < K / MM_FRAG_K; kc++)                                                       \
            for (int lane = 0; lane < 32; lane++)                                                            \
                for (int s = 0; s < 4; s++)                                                                  \
                    for (int j = 0; j < 4; j++)                                                              \
                        for (int e = 0; e < 2; e++) {                                                        \
                            const int g = lane >> 2, c = lane & 3;                                           \
                            const int64_t row = mm_layout_row(q, g + 8 * (j & 1), gate_up, rows / 2);        \
                            const int64_t k = MM_FRAG_K * kc + 16 * s + 2 * c + 8 * (j >> 1) + e;            \
                            const int64_t frag = mm_layout_unit(q, kc, K / MM_FRAG_K) * 32 + lane;           \
                            BODY                                                                             \
                        }

static uint8_t get_code(const uint8_t *codes, int64_t K, int64_t row, int64_t k) {
    return (uint8_t)((codes[row * (K / 2) + k / 2] >> (4 * (k & 1))) & 15);
}

static void put_code(uint8_t *bytes, int64_t index, int odd, uint8_t code) {
    bytes[index] = (uint8_t)((bytes[index] & (odd ? 0x0F : 0xF0)) | (code << (odd ? 4 : 0)));
}

/* The kernel byte of a code: A form (registers 0, 1) or B form (registers 2, 3). */
static uint8_t to_form(uint8_t code, int b_form) {
    return b_form ? (uint8_t)(((code & 8) >> 3) | ((code & 7) << 4))
                  : (uint8_t)(((code & 8) << 4) | ((code & 7) << 1));
}
static uint8_t from_form(uint8_t byte, int b_form) {
    return b_form ? (uint8_t)(((byte & 1) << 3) | ((byte >> 4) & 7))
                  : (uint8_t)(((byte >> 4) & 8) | ((byte >> 1) & 7));
}
/* Byte of the lane's 16 that holds register j's element e of k16 step s. */
static int64_t kernel_byte(int64_t frag, int s, int j, int e) { return frag * 16 + 4 * s + 2 * (j & 1) + e; }

/* Scale bytes: (group, step, g, s, which row) <-> checkpoint [row, K/16]. */
#define FOR_EACH_SCALE(BODY)                                                                                 \
    for (int64_t q = 0; q < rows / 16; q++)                                                                  \
        for (int64_t kc = 0; kc < K / MM_FRAG_K; kc++)                                                       \
            for (int g = 0; g < 8; g++)                                                                      \
                for (int s = 0; s < 4; s++)                                                                  \
                    for (int h = 0; h < 2; h++) {                                                            \
                        const int64_t row = mm_layout_row(q, g + 8 * h, gate_up, rows / 2);                  \
                        const int64_t src = row * (K / 16) + 4 * kc + s;                                     \
                        const int64_t dst = (mm_layout_unit(q, kc, K / MM_FRAG_K) * 8 + g) * 8 + 2 * s + h;  \
                        BODY                                                                                 \
                    }

void mm_layout_pack_nvfp4(const uint8_t *codes, const uint8_t *sf, int64_t rows, int64_t K, int gate_up,
                          uint8_t *out_codes, uint8_t *out_sf) {
    FOR_EACH_FRAGMENT_ELEMENT(out_codes[kernel_byte(frag, s, j, e)] =
                                  (uint8_t)((j < 2 ? out_codes[kernel_byte(frag, s, j, e)] & 0x71
                                                   : out_codes[kernel_byte(frag, s, j, e)] & 0x8E) |
                                            to_form(get_code(codes, K, row, k), j >= 2));)
    FOR_EACH_SCALE(out_sf[dst] = sf[src];)
}

void mm_layout_unpack_nvfp4(const uint8_t *codes, const uint8_t *sf, int64_t rows, int64_t K, int gate_up,
                            uint8_t *out_codes, uint8_t *out_sf) {
    FOR_EACH_FRAGMENT_ELEMENT(put_code(out_codes, row * (K / 2) + k / 2, (int)(k & 1),
                                       from_form(codes[kernel_byte(frag, s, j, e)], j >= 2));)
    FOR_EACH_SCALE(out_sf[src] = sf[dst];)
}

/* Element of register j's element e of lane (4g + c), k16 step s, group q's K step kc (weight_layout.h). */
static int64_t bf16_index(int64_t q, int64_t kc, int64_t nkc, int lane, int s, int j, int e) {
    return mm_layout_bf16_piece(q, kc, nkc, s, j >> 1, j & 1) + 8 * (lane >> 2) + 2 * (lane & 3) + e;
}

void mm_layout_pack_bf16(const uint16_t *w, int64_t rows, int64_t K, int gate_up, uint16_t *out) {
    FOR_EACH_FRAGMENT_ELEMENT((void)frag; out[bf16_index(q, kc, K / MM_FRAG_K, lane, s, j, e)] = w[row * K + k];)
}

void mm_layout_unpack_bf16(const uint16_t *w, int64_t rows, int64_t K, int gate_up, uint16_t *out) {
    FOR_EACH_FRAGMENT_ELEMENT((void)frag; out[row * K + k] = w[bf16_index(q, kc, K / MM_FRAG_K, lane, s, j, e)];)
}

/* Gate/up [2I rows, row_bytes] of the checkpoint -> [2 I_padded rows, row_bytes]: the gate rows, zero
 * rows up to I_padded, the up rows, zero rows (the same bytes where I_padded == I). */
static void pad_gate_up(const uint8_t *src, int64_t I, int64_t I_padded, size_t row_bytes, uint8_t *dst) {
    const size_t real = (size_t)I * row_bytes, pad = (size_t)(I_padded - I) * row_bytes;
    memcpy(dst, src, real);
    memset(dst + real, 0, pad);
    memcpy(dst + real + pad, src + real, real);
    memset(dst + 2 * real + pad, 0, pad);
}

/* Down [rows, row_bytes] -> [rows, row_bytes_padded]: each row, then zero bytes (its columns past I). */
static void pad_columns(const uint8_t *src, int64_t rows, size_t row_bytes, size_t row_bytes_padded,
                        uint8_t *dst) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(dst + (size_t)r * row_bytes_padded, src + (size_t)r * row_bytes, row_bytes);
        memset(dst + (size_t)r * row_bytes_padded + row_bytes, 0, row_bytes_padded - row_bytes);
    }
}

int mm_layout_pack_experts(uint8_t **w13, uint8_t **w13_sf, uint8_t **w2, uint8_t **w2_sf,
                           uint16_t **w13_bf16, uint16_t **w2_bf16, int E, int64_t H, int64_t I,
                           int threads) {
    const int64_t Ip = mm_layout_intermediate_padded(I);
    const int nvfp4 = *w13 != NULL, in_place = Ip == I;
    /* Elements of one expert's w13 [2I, H] and w2 [H, I], in the checkpoint (at I) and packed (at Ip). */
    const size_t n13 = (size_t)(2 * I * H), n2 = (size_t)(H * I);
    const size_t p13 = (size_t)(2 * Ip * H), p2 = (size_t)(H * Ip);
    /* The packed arrays: the checkpoint ones (in place), or new ones of the padded size. A cast on
     * malloc: dev/ compiles this file as C++. */
    uint8_t *d13 = NULL, *d13_sf = NULL, *d2 = NULL, *d2_sf = NULL;
    uint16_t *d13_bf16 = NULL, *d2_bf16 = NULL;
    if (in_place) {
        d13 = *w13, d13_sf = *w13_sf, d2 = *w2, d2_sf = *w2_sf, d13_bf16 = *w13_bf16, d2_bf16 = *w2_bf16;
    } else if (nvfp4) {
        d13 = (uint8_t *)malloc((size_t)E * p13 / 2), d13_sf = (uint8_t *)malloc((size_t)E * p13 / 16);
        d2 = (uint8_t *)malloc((size_t)E * p2 / 2), d2_sf = (uint8_t *)malloc((size_t)E * p2 / 16);
    } else {
        d13_bf16 = (uint16_t *)malloc((size_t)E * p13 * 2), d2_bf16 = (uint16_t *)malloc((size_t)E * p2 * 2);
    }
    int ok = in_place || (nvfp4 ? d13 && d13_sf && d2 && d2_sf : d13_bf16 && d2_bf16);
    if (!ok) { /* a new array could not be allocated */
        free(d13), free(d13_sf), free(d2), free(d2_sf), free(d13_bf16), free(d2_bf16);
        return 0;
    }
    /* The scratch holds one matrix in the checkpoint layout at Ip (padded; a copy where in place), which
     * is packed into the expert's place: one expert's w13 is the larger. */
    const size_t scratch_bytes = nvfp4 ? p13 / 2 + p13 / 16 : p13 * 2;
    if (threads > E) threads = E;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *scratch = (uint8_t *)malloc(scratch_bytes);
        if (!scratch) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp for schedule(dynamic, 1)
        for (int e = 0; e < E; e++) {
            if (!scratch) continue;
            const size_t x = (size_t)e;
            if (nvfp4) {
                uint8_t *codes = scratch, *sf = scratch + p13 / 2;
                pad_gate_up(*w13 + x * n13 / 2, I, Ip, (size_t)H / 2, codes);
                pad_gate_up(*w13_sf + x * n13 / 16, I, Ip, (size_t)H / 16, sf);
                mm_layout_pack_nvfp4(codes, sf, 2 * Ip, H, 1, d13 + x * p13 / 2, d13_sf + x * p13 / 16);
                sf = scratch + p2 / 2;
                pad_columns(*w2 + x * n2 / 2, H, (size_t)I / 2, (size_t)Ip / 2, codes);
                pad_columns(*w2_sf + x * n2 / 16, H, (size_t)I / 16, (size_t)Ip / 16, sf);
                mm_layout_pack_nvfp4(codes, sf, H, Ip, 0, d2 + x * p2 / 2, d2_sf + x * p2 / 16);
            } else {
                pad_gate_up((const uint8_t *)(*w13_bf16 + x * n13), I, Ip, (size_t)H * 2, scratch);
                mm_layout_pack_bf16((const uint16_t *)scratch, 2 * Ip, H, 1, d13_bf16 + x * p13);
                pad_columns((const uint8_t *)(*w2_bf16 + x * n2), H, (size_t)I * 2, (size_t)Ip * 2, scratch);
                mm_layout_pack_bf16((const uint16_t *)scratch, H, Ip, 0, d2_bf16 + x * p2);
            }
        }
        free(scratch);
    }
    if (in_place) return ok;
    if (!ok) { /* the checkpoint arrays are untouched */
        free(d13), free(d13_sf), free(d2), free(d2_sf), free(d13_bf16), free(d2_bf16);
        return 0;
    }
    if (nvfp4) {
        free(*w13), free(*w13_sf), free(*w2), free(*w2_sf);
        *w13 = d13, *w13_sf = d13_sf, *w2 = d2, *w2_sf = d2_sf;
    } else {
        free(*w13_bf16), free(*w2_bf16);
        *w13_bf16 = d13_bf16, *w2_bf16 = d2_bf16;
    }
    return 1;
}
