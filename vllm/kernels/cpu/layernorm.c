/* RMSNorm with Hugging Face semantics, one row at a time:
 *   out[r] = weight * to_dtype(x[r] * 1/sqrt(mean(x[r]^2) + eps))
 * x, weight and out share one dtype (f32 or bf16); the statistics are f32. */
#include <math.h>
#include <stdint.h>

#include "vec.h"

INLINE void norm_rows(const void *x, const void *weight, void *out, int64_t rows, int64_t n,
                      float eps, int bf16) {
    #pragma omp parallel for schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; r++) {
        vf acc = (vf){0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            const vf v = loadv(x, bf16, r * n + i);
            acc += v * v;
        }
        float ss = lane_sum(acc);
        for (; i < n; i++) ss += load1(x, bf16, r * n + i) * load1(x, bf16, r * n + i);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t j = 0; j < n; j++) {
            const float y = load1(x, bf16, r * n + j) * inv;
            /* HF rounds the normalised value to the model dtype, then scales */
            const float yd = bf16 ? bf16_to_f32(f32_to_bf16(y)) : y;
            store1(out, bf16, r * n + j, load1(weight, bf16, j) * yd);
        }
    }
}

int rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps,
             int bf16) {
    if (bf16) norm_rows(x, weight, out, rows, n, eps, 1);
    else norm_rows(x, weight, out, rows, n, eps, 0);
    return 0;
}
