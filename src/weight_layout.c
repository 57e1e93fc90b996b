/*
 * weight_layout.c -- packing expert weights into the kernel layout of weight_layout.h, and the
 * inverse (tested as a round trip on the CPU).
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

int mm_layout_pack_experts(uint8_t *w13, uint8_t *w13_sf, uint8_t *w2, uint8_t *w2_sf, uint16_t *w13_bf16,
                           uint16_t *w2_bf16, int E, int64_t H, int64_t I, int threads) {
    const size_t n13 = (size_t)(2 * I * H), n2 = (size_t)(H * I);
    const int nvfp4 = w13 != NULL;
    /* One expert's w13 is the larger matrix: codes and scales, or bf16. */
    const size_t scratch_bytes = nvfp4 ? n13 / 2 + n13 / 16 : n13 * 2;
    int ok = 1;
    if (threads > E) threads = E;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *scratch = (uint8_t *)malloc(scratch_bytes); /* (a cast: dev/ compiles this file as C++) */
        if (!scratch) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp for schedule(dynamic, 1)
        for (int e = 0; e < E; e++) {
            if (!scratch) continue;
            if (nvfp4) {
                uint8_t *codes = scratch, *sf = scratch + n13 / 2;
                mm_layout_pack_nvfp4(w13 + e * n13 / 2, w13_sf + e * n13 / 16, 2 * I, H, 1, codes, sf);
                memcpy(w13 + e * n13 / 2, codes, n13 / 2);
                memcpy(w13_sf + e * n13 / 16, sf, n13 / 16);
                mm_layout_pack_nvfp4(w2 + e * n2 / 2, w2_sf + e * n2 / 16, H, I, 0, codes, sf);
                memcpy(w2 + e * n2 / 2, codes, n2 / 2);
                memcpy(w2_sf + e * n2 / 16, sf, n2 / 16);
            } else {
                uint16_t *tmp = (uint16_t *)scratch;
                mm_layout_pack_bf16(w13_bf16 + e * n13, 2 * I, H, 1, tmp);
                memcpy(w13_bf16 + e * n13, tmp, n13 * 2);
                mm_layout_pack_bf16(w2_bf16 + e * n2, H, I, 0, tmp);
                memcpy(w2_bf16 + e * n2, tmp, n2 * 2);
            }
        }
        free(scratch);
    }
    return ok;
}
