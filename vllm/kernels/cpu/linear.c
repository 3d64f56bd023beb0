/* Dense linear layer over a packed weight (gemm.h): y [M, cols] = x [M, n] @ W^T (+ bias).
 * x, w, bias and y share one dtype, f32 or bf16 (bf16: the products run in pairs as gemm.h
 * says, accumulation is f32, the bias is added in f32 and y rounded once).
 * Threads split the output column blocks; each row's values do not depend on M (gemm.h). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "vec.h"

#define ROWS 128   /* rows of one bf16 output tile: its f32 scratch (32 KB) stays in cache */

/* Rows [m0, m0 + rows) of block c0 in bf16: f32 tile in s, then bias and rounding into y. */
INLINE void bf16_tile(const bf16_t *x, const void *w, const bf16_t *bias, bf16_t *y, int64_t m0,
                      int64_t rows, int64_t n, int64_t cols, int64_t c0, float *s) {
    const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;
    matmul_block(x + m0 * n, rows, w, 1, n, cols, c0, s, BLOCK);
    for (int64_t m = 0; m < rows; m++) {
        const float *sm = s + m * BLOCK;
        int64_t c = 0;
        for (; c + LANES <= bw; c += LANES) {
            vf v;
            memcpy(&v, sm + c, sizeof(v));
            if (bias) v += loadv(bias, 1, c0 + c);
            storev(y, 1, (m0 + m) * cols + c0 + c, v);
        }
        for (; c < bw; c++)
            store1(y, 1, (m0 + m) * cols + c0 + c, sm[c] + (bias ? bf16_to_f32(bias[c0 + c]) : 0.0f));
    }
}

/* Returns 0, or -1 when scratch could not be allocated. bias may be NULL. */
int dense_linear(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t n,
                 int64_t cols, int bf16) {
    const int64_t nblocks = (cols + BLOCK - 1) / BLOCK;
    if (!bf16) {
        float *ys = y;
        #pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nblocks; b++)
            matmul_block(x, M, w, 0, n, cols, b * BLOCK, ys + b * BLOCK, cols);
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t c = 0; c < cols; c++) ys[m * cols + c] += ((const float *)bias)[c];
        return 0;
    }
    int failed = 0;
    #pragma omp parallel
    {
        float *s = malloc(sizeof(float) * ROWS * BLOCK);
        if (!s) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++)
            for (int64_t m0 = 0; s && m0 < M; m0 += ROWS)
                bf16_tile(x, w, bias, y, m0, M - m0 < ROWS ? M - m0 : ROWS, n, cols, b * BLOCK, s);
        free(s);
    }
    return failed ? -1 : 0;
}

/* Column-block width of the packed weight layout (ops.prepack reads it from here). */
int pack_block_width(void) { return BLOCK; }
