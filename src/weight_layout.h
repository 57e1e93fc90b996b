/*
 * weight_layout.h -- the kernel layout of expert weights, defined once for the finalize step (host)
 * and the GEMM kernels (device).
 *
 * A weight matrix [rows, K] is cut into 16-row groups and 64-wide K steps. For each (group, step)
 * the 32 lanes of a warp each own 16 contiguous bytes of E2M1 codes (NVFP4) or 16 bytes of bf16 per
 * k16 step (BF16): exactly the A fragments of four mma.sync m16n8k16 (k16 steps s = 0..3). Lane
 * l = 4g + c: register j of step s holds the pair (row, k), (row, k+1) with
 *   row = g + 8 * (j & 1),  k = 64 * step + 16 * s + 2c + 8 * (j >> 1);
 *   BF16:  a slab's K step (8 units, 16 KB) is in the K-major core-matrix order of the warpgroup MMA:
 *          [k16 step s][k half h][8-row block, 16][row, 8][8 elements], the groups' 8-row blocks in
 *          the order of groups 0, 2, 4, 6, 1, 3, 5, 7 (mm_layout_bf16_piece), so shared memory holding
 *          it is an SS-wgmma A operand (m64 block q = groups 2w + q, LBO 2 KB, SBO 128 B); register
 *          j of lane 4g + c is element 8g + 2c of the piece (s, j >> 1, j & 1).
 *   NVFP4: word s of the lane's 16 bytes holds the 8 codes of step s in two bit positions per byte,
 *   chosen so the kernel's decode is ~1 integer op per weight (KERNEL_NOTES §2.2b):
 *     "A form" bits 7 (sign) and 3..1 (e1 e0 m): registers 0 and 1, byte 2(j&1) + (k odd);
 *     "B form" bits 0 (sign) and 6..4:           registers 2 and 3, likewise.
 *   A form is an f16 high byte whose value is code * 2^-14; (w << 7 | w >> 3) turns B into A.
 * Block scales (NVFP4) per (group, step): 8 bytes per g: byte 2s = row g, 2s+1 = row g+8 of block
 * 4 * step + s; the 4 lanes of a quad read the same 8 bytes.
 * Gate/up (w13, 2I rows) are interleaved by 8: group q holds gate rows 8q..8q+7 then up rows
 * 8q..8q+7, so a thread's accumulator rows g and g+8 are the gate and up of one intermediate index.
 * Order in memory: units of (group, step) by mm_layout_unit: slabs of 8 groups (the 128 rows of one
 * GEMM block), a slab's steps in order, and within a step its 8 groups side by side, so each K step
 * of a block reads one contiguous run (4 KB of codes and 512 B of scales for NVFP4) instead of 8
 * runs of 512 B; the many small runs cost DRAM row switches when every SM streams its own rows.
 * Padded I: the layout holds every expert at I_padded = mm_layout_intermediate_padded(I) (SPEC §1
 * allows any multiple of 64): gate and up rows [I, I_padded) and down columns [I, I_padded) are zero
 * -- E2M1 code 0 with block scale 0 (NVFP4), so they decode to exactly 0. That changes no output: a
 * padded gate/up row gives g = u = 0, a = silu(0) * 0 = 0, whose 16-blocks quantize to scale 0 and
 * codes 0 (SPEC §3), and meets zero down columns.
 */
#ifndef MEGAMOE_WEIGHT_LAYOUT_H
#define MEGAMOE_WEIGHT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define MM_FRAG_K 64
#define MM_SLAB_GROUPS 8 /* rows % 128 == 0 (H and the padded I are multiples of 256) */

/* NOTE: the device GEMMs are built and tested for I % 256 == 0: their 256-row gate/up blocks (2I rows),
 * the warp-specialized kernels' K loop over I in pairs of 64-wide steps, the streaming kernel's
 * 4-step unroll. So the device backends compute at I rounded up to this tile; H needs no padding
 * (SPEC §1 asks a multiple of 256). */
#define MM_LAYOUT_I_TILE 256

/* The intermediate size the kernels compute at, and every I-shaped device size (the packed weights,
 * the buffer's act rows, mm_dev_shape.I) is sized with: I rounded up to MM_LAYOUT_I_TILE. */
static inline int64_t mm_layout_intermediate_padded(int64_t I) {
    return (I + MM_LAYOUT_I_TILE - 1) / MM_LAYOUT_I_TILE * MM_LAYOUT_I_TILE;
}

#ifdef __cplusplus
extern "C" {
#endif

/* Index of the (group q, K step kc) unit among the matrix's units (nkc = K / 64 steps per group):
 * 32 fragments, 512 bytes of codes and 64 of scales (NVFP4), or 2 KB of bf16. */
#ifdef __CUDACC__
__host__ __device__
#endif
static inline int64_t mm_layout_unit(int64_t q, int64_t kc, int64_t nkc) {
    return ((q / MM_SLAB_GROUPS) * nkc + kc) * MM_SLAB_GROUPS + q % MM_SLAB_GROUPS;
}

/* BF16: the element offset of the 8 rows x 8 k piece (s, h, half) of group q's K step kc: rows
 * 8 half .. 8 half + 7 of the group, k 16 s + 8 h .. + 7 of the step (64 elements, row-major). */
#ifdef __CUDACC__
__host__ __device__
#endif
static inline int64_t mm_layout_bf16_piece(int64_t q, int64_t kc, int64_t nkc, int s, int h, int half) {
    const int64_t g = q % MM_SLAB_GROUPS, pos = (g % 2) * 4 + g / 2;
    return mm_layout_unit(q - g, kc, nkc) * 1024 + ((int64_t)(s * 2 + h) * 16 + pos * 2 + half) * 64;
}

/* Checkpoint row of row r (0..15) of group q: interleaved gate/up (rows = 2I) or plain. */
static inline int64_t mm_layout_row(int64_t q, int r, int gate_up, int64_t I) {
    if (!gate_up) return 16 * q + r;
    return r < 8 ? 8 * q + r : I + 8 * q + (r - 8);
}

/* NVFP4 [rows, K/2] codes + [rows, K/16] scales -> kernel layout (same byte counts). */
void mm_layout_pack_nvfp4(const uint8_t *codes, const uint8_t *sf, int64_t rows, int64_t K, int gate_up,
                          uint8_t *out_codes, uint8_t *out_sf);
void mm_layout_unpack_nvfp4(const uint8_t *codes, const uint8_t *sf, int64_t rows, int64_t K, int gate_up,
                            uint8_t *out_codes, uint8_t *out_sf);
/* BF16 [rows, K] -> kernel layout, and back. */
void mm_layout_pack_bf16(const uint16_t *w, int64_t rows, int64_t K, int gate_up, uint16_t *out);
void mm_layout_unpack_bf16(const uint16_t *w, int64_t rows, int64_t K, int gate_up, uint16_t *out);

/* Packs E experts of one rank into the kernel layout at I_padded = mm_layout_intermediate_padded(I).
 * The malloc'd arrays hold the checkpoint layout at I on entry -- NVFP4 when *w13 is not NULL (w13
 * [E, 2I, H/2] + w13_sf [E, 2I, H/16], w2 [E, H, I/2] + w2_sf [E, H, I/16]), else BF16 (w13_bf16
 * [E, 2I, H], w2_bf16 [E, H, I]) -- and the kernel layout on return: in place where I_padded == I,
 * else in arrays of the padded size that replace them (the old ones freed), with the zero rows and
 * columns above. Experts in parallel on up to `threads` threads (OpenMP where built with it), each
 * through a scratch of one expert's padded w13. Returns 0 where memory ran out: the arrays are then
 * unchanged where I was padded, else some experts may be packed and others not. */
int mm_layout_pack_experts(uint8_t **w13, uint8_t **w13_sf, uint8_t **w2, uint8_t **w2_sf,
                           uint16_t **w13_bf16, uint16_t **w2_bf16, int E, int64_t H, int64_t I, int threads);

#ifdef __cplusplus
}
#endif

#endif /* MEGAMOE_WEIGHT_LAYOUT_H */
