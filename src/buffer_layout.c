/*
 * buffer_layout.c -- the byte layout of one rank's communication buffer (SPEC §7), defined once:
 * every backend, kernel and size query reads its offsets from mm_buffer_layout_compute.
 */
#include <string.h>

#include "internal.h"
#include "weight_layout.h"

#define MM_BUFFER_ALIGN 256 /* every region starts on a 256-byte boundary */

static uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* Places a region of `bytes` at *off and returns its start; *off moves to the next boundary. */
static uint64_t region(uint64_t *off, uint64_t bytes) {
    const uint64_t start = *off;
    *off = align_up(start + bytes, MM_BUFFER_ALIGN);
    return start;
}

void mm_buffer_layout_compute(int max_tokens, int top_k, int hidden_size, int device, int gather,
                              int num_ranks, int experts_per_rank, int intermediate_size,
                              mm_buffer_layout *l) {
    const uint64_t T = (uint64_t)max_tokens, K = (uint64_t)top_k, H = (uint64_t)hidden_size;
    /* The x region holds a token row in either format: the BF16 view [T, H] bf16, or the NVFP4 view
     * (codes, then block scales, then per-token scales, each on a boundary), whichever is larger. */
    const uint64_t x_codes = align_up(T * H / 2, MM_BUFFER_ALIGN),
                   x_sfs = align_up(T * H / 16, MM_BUFFER_ALIGN);
    const uint64_t x_nvfp4 = x_codes + x_sfs + T * 4, x_bf16 = T * H * 2;
    uint64_t off = 0;
    memset(l, 0, sizeof *l);
    l->num_tokens = region(&off, 4);                          /* i32 T of this forward */
    l->topk_ids = region(&off, T * K * 4);                    /* [T, K] i32 global expert ids */
    l->topk_weights = region(&off, T * K * 4);                /* [T, K] f32 */
    l->token_state = region(&off, T);                         /* [T] u8 MM_TOKEN_* */
    l->x = region(&off, x_nvfp4 > x_bf16 ? x_nvfp4 : x_bf16); /* [T, H] bf16, or [T, H/2] e2m1 ... */
    l->x_sf = l->x + x_codes;                                 /* ... then [T, H/16] e4m3 ... */
    l->x_scale = l->x_sf + x_sfs;                             /* ... then [T] f32 s */
    l->p = region(&off, T * K * H * 4);                       /* [T, K, H] f32 expert outputs */
    if (device) {
        const uint64_t R = (uint64_t)num_ranks, Er = (uint64_t)experts_per_rank;
        /* The device kernels' I (weight_layout.h): their act rows are I_padded wide. */
        const uint64_t I = (uint64_t)mm_layout_intermediate_padded(intermediate_size), slots = R * T * K;
        l->max_tiles = (int)(Er + (slots + MM_TILE_TOKENS - 1) / MM_TILE_TOKENS);
        const uint64_t tiles = (uint64_t)l->max_tiles;
        const int chunked = Er <= MM_ROUTE_CHUNK_EXPERTS;
        if (gather) l->xg_rows = (int)((R < MM_GATHER_CAP ? R : MM_GATHER_CAP) * T * K);
        if (chunked) l->route_chunks_per_src = (int)((T * K + MM_ROUTE_CHUNK - 1) / MM_ROUTE_CHUNK);
        const uint64_t chunks = R * (uint64_t)l->route_chunks_per_src;
        const uint64_t splitk = MM_SPLITK_ENTRIES, splitk_block = 128 * 64 * 4;
        l->slots = region(&off, slots * 4);                             /* [R*T*K] i32 slot codes */
        l->slot_scale = region(&off, slots * 4);                        /* [R*T*K] f32 NVFP4 scale s */
        l->expert_count = region(&off, Er * 4);                         /* [E_r] i32 */
        l->expert_offset = region(&off, (Er + 1) * 4);                  /* [E_r+1] i32 */
        l->num_tiles = region(&off, 4);                                 /* i32 */
        l->tile_expert = region(&off, tiles * 4);                       /* [max_tiles] i32 */
        l->tile_start = region(&off, tiles * 4);                        /* [max_tiles] i32 */
        l->tile_rows = region(&off, tiles * 8);                         /* [max_tiles] i32 x 2 */
        l->tile_order = region(&off, tiles * 4);                        /* [max_tiles] i32 */
        l->x_f16 = region(&off, T * H * 2);                             /* [T, H] f16 (NVFP4) */
        l->act = region(&off, slots * I * 2);                           /* [R*T*K, I] f16 or bf16 */
        if (gather) l->xg = region(&off, (uint64_t)l->xg_rows * H * 2); /* [xg_rows, H] 16-bit */
        if (chunked) l->route_chunks = region(&off, chunks * Er * 4);   /* [R*chunks, E_r] i32 */
        l->error = region(&off, 16);                        /* first bad id u64, count u32, late rank u32 */
        l->splitk_ws = region(&off, splitk * splitk_block); /* [entries] 32 KB f32 partial sums */
        l->splitk_counters = region(&off, (splitk + 2) * 4); /* [entries] i32 arrivals, ws walk's 2 */
        l->barrier = region(&off, (R + 1) * 8);             /* u64 epoch, [R] u64 arrival flags */
    }
    l->total = off;
}
