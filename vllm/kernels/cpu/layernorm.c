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
        int64_t j = 0;
        for (; j + LANES <= n; j += LANES) {   /* norm1, lane-wise */
            const vf y = loadv(x, bf16, r * n + j) * inv;
            const vf yd = bf16 ? bf16v_to_f32(f32_to_bf16v(y)) : y;
            storev(out, bf16, r * n + j, loadv(weight, bf16, j) * yd);
        }
        for (; j < n; j++)
            store1(out, bf16, r * n + j, norm1(load1(x, bf16, r * n + j), inv,
                                              load1(weight, bf16, j), bf16));
    }
}

int rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps,
             int bf16) {
    if (bf16) norm_rows(x, weight, out, rows, n, eps, 1);
    else norm_rows(x, weight, out, rows, n, eps, 0);
    return 0;
}
