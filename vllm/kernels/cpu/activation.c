/* Gated activations outside the expert kernel, with the roundings of the model's torch forward
 * (each torch op rounds its result to the model dtype; r() below, the identity in f32):
 *
 *   silu_and_mul:      out[t, j] = r(r(silu(gate[t, j])) * up[t, j])       (GatedMLP)
 *   sigmoid_gate_add:  out[t, j] = r(x[t, j] + r(r(sigmoid(g[t])) * y[t, j]))
 *                      (Qwen2-MoE: routed output x, shared expert y, gate logit g [T, 1])
 *
 * silu(v) = v / (1 + exp(-v)) and sigmoid(v) = 1 / (1 + exp(-v)) use vec.h's vexp (about 1 ulp),
 * so they can differ from torch's in the last bits. A row's tail runs through a padded vector,
 * so every element gets the same arithmetic wherever it sits. All arrays share one dtype, f32 or
 * bf16, and are contiguous. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Elements [i, i + w) of an f32/bf16 array as a vector, lanes from w on zero. */
INLINE vf load_part(const void *p, int bf16, int64_t i, int64_t w) {
    if (w == LANES) return loadv(p, bf16, i);
    float t[LANES] = {0};
    for (int64_t j = 0; j < w; j++) t[j] = load1(p, bf16, i + j);
    vf v;
    memcpy(&v, t, sizeof(v));
    return v;
}

INLINE void store_part(void *p, int bf16, int64_t i, int64_t w, vf v) {
    if (w == LANES) {
        storev(p, bf16, i, v);
        return;
    }
    for (int64_t j = 0; j < w; j++) store1(p, bf16, i + j, v[j]);
}

INLINE void silu_row(const void *gate, const void *up, void *out, int64_t N, int64_t t,
                     int bf16) {
    for (int64_t j = 0; j < N; j += LANES) {
        const int64_t w = N - j < LANES ? N - j : LANES, i = t * N + j;
        const vf g = load_part(gate, bf16, i, w);
        const vf act = round_to(g / (1.0f + vexp(-g)), bf16);
        store_part(out, bf16, i, w, act * load_part(up, bf16, i, w));
    }
}

/* gate, up, out [T, N]. Returns 0. */
int silu_and_mul(const void *gate, const void *up, void *out, int64_t T, int64_t N, int bf16) {
    FOR_ROWS_BY_DTYPE(bf16, T, T * N, silu_row, gate, up, out, N);
    return 0;
}

INLINE void gate_row(const void *x, const void *g, const void *y, void *out, int64_t H,
                     int64_t t, int bf16) {
    const vf gv = (vf){0} + load1(g, bf16, t);
    const float s = round_to(1.0f / (1.0f + vexp(-gv)), bf16)[0];
    for (int64_t j = 0; j < H; j += LANES) {
        const int64_t w = H - j < LANES ? H - j : LANES, i = t * H + j;
        const vf shared = round_to(load_part(y, bf16, i, w) * s, bf16);
        store_part(out, bf16, i, w, load_part(x, bf16, i, w) + shared);
    }
}

/* x, y, out [T, H], g [T] (the [T, 1] gate logits). Returns 0. */
int sigmoid_gate_add(const void *x, const void *g, const void *y, void *out, int64_t T,
                     int64_t H, int bf16) {
    FOR_ROWS_BY_DTYPE(bf16, T, T * H, gate_row, x, g, y, out, H);
    return 0;
}
