/* Dense linear layer over a packed weight (gemm.h): y [M, cols] = x [M, n] @ W^T (+ bias).
 * x, w, bias and y share one dtype, f32 or bf16 (bf16 is widened; accumulation is f32).
 * Threads split the output column blocks; each row's values do not depend on M (gemm.h). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "vec.h"

INLINE void linear_blocks(const float *xs, const void *w, int bf16, int64_t M, int64_t n,
                          int64_t cols, float *ys) {
    const int64_t nblocks = (cols + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; b++) matmul_block(xs, M, w, bf16, n, cols, b * BLOCK, ys);
}

/* Returns 0, or -1 when scratch could not be allocated. bias may be NULL. */
int dense_linear(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t n,
                 int64_t cols, int bf16) {
    float *xs = (float *)x, *ys = (float *)y;
    if (!bf16) {
        linear_blocks(xs, w, 0, M, n, cols, ys);
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t c = 0; c < cols; c++) ys[m * cols + c] += ((const float *)bias)[c];
        return 0;
    }
    xs = malloc(sizeof(float) * (size_t)(M * n + M * cols) + 1);
    if (!xs) return -1;
    ys = xs + M * n;
    for (int64_t i = 0; i < M * n; i++) xs[i] = bf16_to_f32(((const bf16_t *)x)[i]);
    linear_blocks(xs, w, 1, M, n, cols, ys);
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < cols; c++) {
            const float b = bias ? bf16_to_f32(((const bf16_t *)bias)[c]) : 0.0f;
            ((bf16_t *)y)[m * cols + c] = f32_to_bf16(ys[m * cols + c] + b);
        }
    free(xs);
    return 0;
}

/* Column-block width of the packed weight layout (ops.prepack reads it from here). */
int pack_block_width(void) { return BLOCK; }
