/* RMSNorm with Hugging Face semantics, one row at a time:
 *   out[r] = weight * to_dtype(x[r] * 1/sqrt(mean(x[r]^2) + eps))
 * x, weight and out share one dtype (f32 or bf16); the statistics are f32. */
#include <math.h>
#include <stdint.h>

#include "vec.h"

/* One output element: HF rounds the normalised value to the model dtype, then scales. */
INLINE float norm1(float x, float inv, float w, int bf16) {
    const float y = x * inv;
    return w * (bf16 ? bf16_to_f32(f32_to_bf16(y)) : y);
}

/* One row; bf16 is a constant at every call, so each dtype gets its own vectorised loop. */
INLINE void norm_row(const void *x, const void *weight, void *out, int64_t n, float eps,
                     int64_t r, int bf16) {
    vf acc = (vf){0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf v = loadv(x, bf16, r * n + i);
        acc = vfma(v, v, acc);
    }
    float ss = lane_sum(acc);
    for (; i < n; i++) ss = sfma(load1(x, bf16, r * n + i), load1(x, bf16, r * n + i), ss);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {   /* norm1, lane-wise */
        const vf y = round_to(loadv(x, bf16, r * n + j) * inv, bf16);
        storev(out, bf16, r * n + j, loadv(weight, bf16, j) * y);
    }
    for (; j < n; j++)
        store1(out, bf16, r * n + j, norm1(load1(x, bf16, r * n + j), inv,
                                          load1(weight, bf16, j), bf16));
}

int rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps,
             int bf16) {
    FOR_ROWS_BY_DTYPE(bf16, rows, rows * n, norm_row, x, weight, out, n, eps);
    return 0;
}
