/*
 * decode_sass_check.c -- an experiment, not part of the library: the proof that the streaming
 * kernel's fewer consumer instructions per K step (DECISIONS 52)
 * leave every bit of the A fragments and every shared address as they were.
 * 1. decode_a (NVFP4, gemm/fragments.cuh) before and after, emulated bit for bit: the scale's 16 bits
 *    reached cvt.rn.f16x2.e4m3x2 as (w >> 16 (s & 1)) & 0xFFFF and now as half s & 1 of
 *    `mov.b32 {lo, hi}, w` (e4m3x2_to_half2, read in place by F2FP's .H1 operand); every code byte
 *    in every position of the code word x every pair of scale bytes in the half step s reads (the
 *    other 48 bits arbitrary) x every k16 step s, the four A registers compared (2^28 cases, ~2 min).
 * 2. The consumer's shared offsets before and after (st_slot_step's per-slot sums against the
 *    per-chunk st_addr plus the slot's offset), every warp, lane, slot, step, group, n-tile and
 *    ldmatrix of the three layouts (per-slot 2 steps x 4 slots, grouped 2 x 4, 5-block 1 x 6).
 * Build and run (any x86-64 gcc with _Float16): gcc -O2 -o /tmp/dsc dev/decode_sass_check.c && /tmp/dsc
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uint16_t e4m3_to_f16(uint8_t b) { /* exact; NaN (S.1111.111) -> 0x7FFF */
    const uint16_t sign = (uint16_t)(b & 0x80) << 8;
    const int e = (b >> 3) & 15, m = b & 7;
    if ((b & 0x7F) == 0x7F) return 0x7FFF;
    if (e == 0) {
        if (m == 0) return sign;
        _Float16 v = (_Float16)((float)m / 8.0f / 64.0f); /* m/8 * 2^-6, exact in f16 */
        uint16_t r;
        memcpy(&r, &v, 2);
        return sign | r;
    }
    return sign | (uint16_t)((e - 7 + 15) << 10) | (uint16_t)(m << 7);
}
static uint32_t cvt_e4m3x2(uint16_t x) { return e4m3_to_f16(x & 0xFF) | (uint32_t)e4m3_to_f16(x >> 8) << 16; }
static uint16_t hmul(uint16_t a, uint16_t b) {
    _Float16 x, y, z;
    memcpy(&x, &a, 2);
    memcpy(&y, &b, 2);
    z = x * y;
    uint16_t r;
    memcpy(&r, &z, 2);
    return r;
}
static uint32_t hmul2(uint32_t a, uint16_t s) {
    return hmul(a & 0xFFFF, s) | (uint32_t)hmul(a >> 16, s) << 16;
}
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel) {
    const uint64_t v = (uint64_t)y << 32 | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++)
        r |= (uint32_t)((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
static void decode(uint32_t word, uint32_t sfx, uint32_t sfy, int s, int after, uint32_t *a) {
    const uint32_t a_form = word & 0x8E8E8E8Eu;
    const uint32_t b_form = ((word << 7) & 0x80808080u) | ((word >> 3) & 0x0E0E0E0Eu);
    uint16_t in16;
    if (!after) {
        const uint32_t sfw = (s < 2 ? sfx : sfy) >> (16 * (s & 1));
        in16 = (uint16_t)(sfw & 0xFFFFu);
    } else {
        const uint32_t w = s < 2 ? sfx : sfy;
        in16 = (s & 1) ? (uint16_t)(w >> 16) : (uint16_t)(w & 0xFFFFu); /* mov.b32 {lo, hi} */
    }
    const uint32_t s2 = cvt_e4m3x2(in16);
    const uint16_t s_g = s2 & 0xFFFF, s_g8 = s2 >> 16;
    a[0] = hmul2(byte_perm(a_form, 0u, 0x1404), s_g);
    a[1] = hmul2(byte_perm(a_form, 0u, 0x3424), s_g8);
    a[2] = hmul2(byte_perm(b_form, 0u, 0x1404), s_g);
    a[3] = hmul2(byte_perm(b_form, 0u, 0x3424), s_g8);
}
static uint32_t hash(uint32_t x) {
    x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
    return x;
}
static int check_decode(void) {
    uint64_t checks = 0, bad = 0;
    for (uint32_t c = 0; c < 256; c++)
        for (int pos = 0; pos < 4; pos++) {
            const uint32_t other = hash(c * 4 + pos);
            const uint32_t word = (other & ~(0xFFu << (8 * pos))) | c << (8 * pos);
            for (uint32_t pair = 0; pair < 65536; pair++)
                for (int s = 0; s < 4; s++) {
                    const uint32_t fill = hash(pair ^ (c << 16) ^ (uint32_t)s << 30);
                    /* the pair in the half step s reads, the other 48 bits arbitrary */
                    uint32_t sfx = fill, sfy = hash(fill);
                    uint32_t *t = s < 2 ? &sfx : &sfy;
                    *t = (s & 1) ? (*t & 0xFFFFu) | pair << 16 : (*t & 0xFFFF0000u) | pair;
                    uint32_t a0[4], a1[4];
                    decode(word, sfx, sfy, s, 0, a0);
                    decode(word, sfx, sfy, s, 1, a1);
                    checks++;
                    bad += memcmp(a0, a1, sizeof a0) != 0;
                }
        }
    printf("decode_a: %llu (code byte, position, scale pair, step) cases, %llu mismatches\n",
           (unsigned long long)checks, (unsigned long long)bad);
    return bad != 0;
}

/* 2. Constants and formulas of st_lay (sm90_expert_stream.cu) and of the old and new st_slot_step. */
enum { ST_CODES = 4096, ST_SCALES = 512, ST_COLS = 16 };
static int check_addresses(void) {
    static const int lays[3][3] = {{0, 2, 4}, {1, 2, 4}, {0, 1, 6}}; /* grouped, steps, stages */
    long checks = 0, bad = 0;
    for (int l = 0; l < 3; l++) {
        const int xg = lays[l][0], steps = lays[l][1], stages = lays[l][2];
        const int wbytes = steps * (ST_CODES + ST_SCALES), gxrow = stages * steps * 128 + 16,
                  pxrow = steps * 128 + 16;
        const int slotb = wbytes + (xg ? ST_COLS * 8 : ST_COLS * pxrow), xrow = xg ? gxrow : pxrow;
#define SF(j) (steps * ST_CODES + (j) * ST_SCALES)
#define X(s) (xg ? stages * slotb + (s) * steps * 128 : (s) * slotb + wbytes)
        for (int warp = 0; warp < 4; warp++)
            for (int lane = 0; lane < 32; lane++) {
                const int g = lane >> 2;
                const int codes = 2 * warp * 512 + lane * 16, scales = SF(0) + 2 * warp * 64 + g * 8,
                          rows = X(0) + (lane & 7) * xrow + 16 * (lane >> 3); /* st_thread_addr */
                for (int slot = 0; slot < stages; slot++)
                    for (int j = 0; j < steps; j++)
                        for (int q = 0; q < 2; q++)
                            for (int nt = 0; nt < 2; nt++)
                                for (int hh = 0; hh < 2; hh++) {
                                    const int wo = slot * slotb;
                                    const int c0 =
                                        slot * slotb + j * ST_CODES + (2 * warp + q) * 512 + lane * 16;
                                    const int c1 = codes + wo + j * ST_CODES + q * 512;
                                    const int s0 = slot * slotb + SF(j) + (2 * warp + q) * 64 + g * 8;
                                    const int s1 = scales + wo + (SF(j) - SF(0)) + q * 64;
                                    const int r0 = X(slot) + (nt * 8 + (lane & 7)) * xrow + j * 128 +
                                                   16 * ((lane >> 3) + 4 * hh);
                                    const int r1 =
                                        rows + (xg ? slot * steps * 128 : wo) + nt * 8 * xrow + j * 128 + 64 * hh;
                                    checks++;
                                    bad += c0 != c1 || s0 != s1 || r0 != r1;
                                }
            }
#undef SF
#undef X
    }
    printf("consumer addresses: %ld cases, %ld mismatches\n", checks, bad);
    return bad != 0;
}

int main(void) {
    const int a = check_addresses();
    return check_decode() | a;
}
