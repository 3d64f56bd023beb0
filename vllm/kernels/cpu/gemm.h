/* Register-tiled GEMMs over packed weights, shared by the expert and dense linear kernels.
 *
 *   f32:  y = a @ W, a and W f32: every output is one sequential f32 FMA chain over the input
 *         dim (i = 0 .. n-1).
 *   bf16: y = a @ W, a and W bf16, y f32: every output is the chain the AVX512-BF16 instruction
 *         vdpbf16ps computes, one pair of inputs at a time (p = 0 .. n/2-1):
 *             acc = fma(a[2p+1], w[2p+1], acc);  acc = fma(a[2p], w[2p], acc)
 *         then acc = fma(a[n-1], w[n-1], acc) when n is odd. A product of two bf16 values is
 *         exact in f32, so each step rounds once. With the instruction (this machine's
 *         -march has avx512bf16) the pairs run through it, 32 products per instruction, 2.7x
 *         the f32 FMA rate on Zen 4; elsewhere the same chain is computed with FMAs (equal bits
 *         except that the instruction flushes denormals to zero).
 *
 * Invariant: whichever register tile computes an output, it runs the same chain, so a row's
 * result never depends on how many rows are in the call. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define TM_MAX 4      /* tokens per register tile */
#define CV_MAX 4      /* 16-column vectors per register tile */
#define PREFETCH 8    /* weight rows (f32) or row pairs (bf16) prefetched ahead */

/* Packed weight layout (prepack in vllm/kernels/cpu/ops.py): a linear weight [cols, n] (out, in)
 * is stored in column blocks: block b holds output columns [b * BLOCK, b * BLOCK + bw),
 * bw = BLOCK except for the last block, as one contiguous stream that stays in L2 while every
 * token passes over it. Element (input i, block column c):
 *   f32:  i * bw + c                                  ([n, bw] row-major)
 *   bf16: (i / 2) * 2 * bw + 2 * c + i % 2           for i < n - n % 2 (row pairs interleaved,
 *         (n - 1) * bw + c                            [n/2, bw, 2]) and the last row when n is odd.
 * Either way a block has n * bw elements. */
#define BLOCK (CV_MAX * LANES)

/* y[m * ldy + v * LANES + l] for m < TM, v < CV: a tile of TM tokens x CV vectors of the f32
 * block wt (row stride ldw) starting at its column c. */
INLINE void tile_f32(const float *a, int TM, const float *wt, int CV, int64_t n, int64_t ldw,
                     int64_t c, float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = (vf){0};
    for (int64_t i = 0; i < n; i++) {
        vf wv[CV_MAX];
        for (int v = 0; v < CV; v++) {
            /* Cold weights stream from DRAM: ask for rows PREFETCH ahead (harmless past the
             * end: a prefetch never faults). */
            __builtin_prefetch(wt + (i + PREFETCH) * ldw + c + v * LANES);
            wv[v] = *(const vf *)(wt + i * ldw + c + v * LANES);
        }
        for (int m = 0; m < TM; m++) {
            const vf av = splat(a[m * n + i]);
            for (int v = 0; v < CV; v++) acc[m][v] = vfma(av, wv[v], acc[m][v]);
        }
    }
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

/* tile_f32 for bf16 activations and a pair-packed bf16 block (the chain in the header). */
INLINE void tile_bf16(const bf16_t *a, int TM, const bf16_t *wt, int CV, int64_t n, int64_t ldw,
                      int64_t c, float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = (vf){0};
    const int64_t pairs = n / 2;
    for (int64_t p = 0; p < pairs; p++) {
        wpair wv[CV_MAX];
        for (int v = 0; v < CV; v++) {
            const bf16_t *w = wt + p * 2 * ldw + 2 * (c + v * LANES);
            __builtin_prefetch(w + PREFETCH * 2 * ldw);
            wv[v] = load_pair(w);
        }
        for (int m = 0; m < TM; m++) {
            uint32_t ap;
            memcpy(&ap, a + m * n + 2 * p, sizeof(ap));
            for (int v = 0; v < CV; v++) acc[m][v] = dot_pair(acc[m][v], ap, wv[v]);
        }
    }
    if (n & 1)
        for (int v = 0; v < CV; v++) {
            const vf wl = loadv(wt, 1, (n - 1) * ldw + c + v * LANES);
            for (int m = 0; m < TM; m++)
                acc[m][v] = vfma(splat(bf16_to_f32(a[m * n + n - 1])), wl, acc[m][v]);
        }
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

/* Block column c alone (the columns of a ragged block outside any vector), same chains. */
INLINE void column_tail(const void *a, int64_t M, const void *wt, int bf16, int64_t n,
                        int64_t ldw, int64_t c, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        float s = 0.0f;
        if (!bf16) {
            for (int64_t i = 0; i < n; i++)
                s = sfma(((const float *)a)[m * n + i], ((const float *)wt)[i * ldw + c], s);
        } else {
            const bf16_t *ab = (const bf16_t *)a + m * n, *w = wt;
            for (int64_t p = 0; p < n / 2; p++) {
                const bf16_t *wp = w + p * 2 * ldw + 2 * c;
                s = sfma(bf16_to_f32(ab[2 * p + 1]), bf16_to_f32(wp[1]), s);
                s = sfma(bf16_to_f32(ab[2 * p]), bf16_to_f32(wp[0]), s);
            }
            if (n & 1) s = sfma(bf16_to_f32(ab[n - 1]), bf16_to_f32(w[(n - 1) * ldw + c]), s);
        }
        y[m * ldy] = s;
    }
}

INLINE void tile(const void *a, int TM, const void *wt, int bf16, int CV, int64_t n, int64_t ldw,
                 int64_t c, float *y, int64_t ldy) {
    if (bf16) tile_bf16(a, TM, wt, CV, n, ldw, c, y, ldy);
    else tile_f32(a, TM, wt, CV, n, ldw, c, y, ldy);
}

/* CV * LANES columns (from block column c) of y for every token. */
INLINE void columns(const void *a, int64_t M, const void *wt, int bf16, int CV, int64_t n,
                    int64_t ldw, int64_t c, float *y, int64_t ldy) {
    const size_t asz = bf16 ? 2 : 4;
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX)
        tile((const char *)a + m * n * asz, TM_MAX, wt, bf16, CV, n, ldw, c, y + m * ldy, ldy);
    const void *am = (const char *)a + m * n * asz;
    switch (M - m) { /* the last 1-3 tokens in one tile: one more pass over the weights, not 3 */
    case 3: tile(am, 3, wt, bf16, CV, n, ldw, c, y + m * ldy, ldy); break;
    case 2: tile(am, 2, wt, bf16, CV, n, ldw, c, y + m * ldy, ldy); break;
    case 1: tile(am, 1, wt, bf16, CV, n, ldw, c, y + m * ldy, ldy); break;
    default: break;
    }
}

/* The columns of block c0 (c0 a multiple of BLOCK) of a [M, n] @ packed w ([cols, n]) into
 * y[m * ldy + c] for c < the block's width; a and w are both f32 or both bf16, y is f32. */
INLINE void matmul_block(const void *a, int64_t M, const void *w, int bf16, int64_t n,
                         int64_t cols, int64_t c0, float *y, int64_t ldy) {
    const size_t esz = bf16 ? 2 : 4;
    const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;
    const char *blk = (const char *)w + (size_t)c0 * n * esz;
    if (bw == BLOCK) {
        columns(a, M, blk, bf16, CV_MAX, n, bw, 0, y, ldy);
        return;
    }
    int64_t v = 0;
    for (; v + LANES <= bw; v += LANES) columns(a, M, blk, bf16, 1, n, bw, v, y + v, ldy);
    for (; v < bw; v++) column_tail(a, M, blk, bf16, n, bw, v, y + v, ldy);
}

/* y [M, cols] = a [M, n] @ packed w, all blocks in order. */
INLINE void matmul(const void *a, int64_t M, const void *w, int bf16, int64_t n, int64_t cols,
                   float *y) {
    for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) matmul_block(a, M, w, bf16, n, cols, c0, y + c0, cols);
}
