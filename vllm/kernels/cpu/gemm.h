/* Register-tiled f32 GEMM over packed weights, shared by the expert and dense linear kernels.
 *
 * Invariant: every output element is one sequential f32 FMA chain over the input dim, whatever
 * tile computes it, so a row's result never depends on how many rows are in the call. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* y[m * ldy + c] = sum_i a[m * n + i] * wt[i * ldw + c] for m < TM, c < CV * LANES: a register
 * tile of TM tokens x CV vectors of columns. Every output is one sequential FMA chain over
 * i = 0..n-1 (a lane of a vector accumulator), the same chain ``column_tail`` runs, so its
 * bits do not depend on the tile it was computed in. */
#define TM_MAX 4
#define PREFETCH 8
#define CV_MAX 4
INLINE void tile(const float *a, int TM, const void *wt, int bf16, int CV, int64_t n, int64_t ldw,
                 float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = (vf){0};
    for (int64_t i = 0; i < n; i++) {
        vf wv[CV_MAX];
        for (int v = 0; v < CV; v++) {
            /* Cold weights stream from DRAM: ask for rows PREFETCH ahead (harmless past the
             * end: a prefetch never faults). */
            const int64_t ahead = (i + PREFETCH) * ldw + v * LANES;
            __builtin_prefetch((const char *)wt + ahead * (bf16 ? 2 : 4));
            wv[v] = loadv(wt, bf16, i * ldw + v * LANES);
        }
        for (int m = 0; m < TM; m++) {
            const vf av = (vf){0} + a[m * n + i];
            for (int v = 0; v < CV; v++) acc[m][v] += av * wv[v];
        }
    }
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

INLINE void column_tail(const float *a, int64_t M, const void *wt, int bf16, int64_t n,
                        int64_t ldw, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += a[m * n + i] * load1(wt, bf16, i * ldw);
        y[m * ldy] = s;
    }
}

/* CV * LANES columns of y for every token. */
INLINE void columns(const float *a, int64_t M, const void *wt, int bf16, int CV, int64_t n,
                    int64_t ldw, float *y, int64_t ldy) {
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX)
        tile(a + m * n, TM_MAX, wt, bf16, CV, n, ldw, y + m * ldy, ldy);
    switch (M - m) { /* the last 1-3 tokens in one tile: one more pass over the weights, not 3 */
    case 3: tile(a + m * n, 3, wt, bf16, CV, n, ldw, y + m * ldy, ldy); break;
    case 2: tile(a + m * n, 2, wt, bf16, CV, n, ldw, y + m * ldy, ldy); break;
    case 1: tile(a + m * n, 1, wt, bf16, CV, n, ldw, y + m * ldy, ldy); break;
    default: break;
    }
}

/* Packed weight layout (prepack in vllm/kernels/cpu/ops.py): a linear weight [cols, n] (out, in)
 * is stored in column blocks: block b holds output columns [b * BLOCK, b * BLOCK + bw) as a
 * contiguous [n, bw] row-major matrix, bw = BLOCK except for the last block. So every block is
 * one sequential stream from memory, and it stays in L2 while every token passes over it. */
#define BLOCK (CV_MAX * LANES)

/* Columns of block c0 (c0 a multiple of BLOCK) of y [M, cols] = a [M, n] (f32) @ packed w. */
INLINE void matmul_block(const float *a, int64_t M, const void *w, int bf16, int64_t n,
                         int64_t cols, int64_t c0, float *y) {
    const size_t esz = bf16 ? 2 : 4;
    const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;
    const char *blk = (const char *)w + (size_t)c0 * n * esz;
    if (bw == BLOCK) {
        columns(a, M, blk, bf16, CV_MAX, n, bw, y + c0, cols);
        return;
    }
    int64_t v = 0;
    for (; v + LANES <= bw; v += LANES)
        columns(a, M, blk + v * esz, bf16, 1, n, bw, y + c0 + v, cols);
    for (; v < bw; v++) column_tail(a, M, blk + v * esz, bf16, n, bw, y + c0 + v, cols);
}

/* y [M, cols] = a [M, n] (f32) @ packed w, all blocks in order. */
INLINE void matmul(const float *a, int64_t M, const void *w, int bf16, int64_t n, int64_t cols,
                   float *y) {
    for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) matmul_block(a, M, w, bf16, n, cols, c0, y);
}
