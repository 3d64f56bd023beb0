/* Greedy choice per row with torch.argmax's semantics: the first index of the maximum, and a
 * NaN counts as the maximum (the first NaN wins). x [rows, n] f32 -> out [rows] int64. */
#include <stdint.h>

#include "vec.h"

static int64_t argmax_row(const float *x, int64_t n) {
    vf mv = (vf){0} + x[0];
    vi nan = (vi){0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf v = *(const vf *)(x + i);
        nan |= (v != v);
        mv = vselect(v > mv, v, mv);
    }
    float m = x[0];
    int any_nan = 0;
    for (int l = 0; l < LANES; l++) {
        any_nan |= nan[l] != 0;
        m = mv[l] > m ? mv[l] : m;
    }
    for (; i < n; i++) {
        any_nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    for (int64_t j = 0; j < n; j++)
        if (any_nan ? x[j] != x[j] : x[j] == m) return j;
    return 0;
}

int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = n ? argmax_row(x + r * n, n) : 0;
    return 0;
}
