/* Rotary position embedding, rotate-half (GPT-NeoX / HF Llama) style, out of place:
 *   for each head and i < rd/2, with a = pos * inv_freq[i] (f32, as HF computes it):
 *   out[i]        = x[i] * c - x[i + rd/2] * s
 *   out[i + rd/2] = x[i + rd/2] * c + x[i] * s,   c = cos(a) * scaling, s = sin(a) * scaling
 * each as one fma over the other product: fma(x[i], c, -(x[i + rd/2] * s)) and
 * fma(x[i + rd/2], c, x[i] * s), vector and scalar columns alike.
 * Dims past rd are copied. q [T, Hq*D], k [T, Hkv*D]; q, k and outputs share one dtype.
 * rope_cos_sin makes the [T, rd] (c then s) rows once per step; every layer's rotary_embedding
 * reads them. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

/* cs[t] = (c[0 .. h-1], s[0 .. h-1]) for positions[t], h = rd / 2. */
int rope_cos_sin(const int64_t *positions, const float *inv_freq, float scaling, int64_t T,
                 int64_t h, float *cs) {
    #pragma omp parallel for schedule(static) if (T > 64)
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < h; i++) {
            float sn, cn;
            sincosf((float)positions[t] * inv_freq[i], &sn, &cn);
            cs[t * 2 * h + i] = cn * scaling;
            cs[t * 2 * h + h + i] = sn * scaling;
        }
    return 0;
}

INLINE void rotate_heads(const void *x, void *out, int64_t heads, int64_t D, int64_t rd,
                         const float *c, const float *s, int bf16) {
    const int64_t h = rd / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        const int64_t b = hd * D;
        int64_t i = 0;
        for (; i + LANES <= h; i += LANES) {
            const vf x1 = loadv(x, bf16, b + i), x2 = loadv(x, bf16, b + i + h);
            const vf cv = *(const vf *)(c + i), sv = *(const vf *)(s + i);
            storev(out, bf16, b + i, vfma(x1, cv, -(x2 * sv)));
            storev(out, bf16, b + i + h, vfma(x2, cv, x1 * sv));
        }
        for (; i < h; i++) {
            const float x1 = load1(x, bf16, b + i), x2 = load1(x, bf16, b + i + h);
            store1(out, bf16, b + i, sfma(x1, c[i], -(x2 * s[i])));
            store1(out, bf16, b + i + h, sfma(x2, c[i], x1 * s[i]));
        }
        const size_t esz = bf16 ? 2 : 4;       /* dims past rd: copied bit for bit */
        memcpy((char *)out + (b + rd) * esz, (const char *)x + (b + rd) * esz, (D - rd) * esz);
    }
}

/* cs from rope_cos_sin for the same positions. */
int rotary_embedding(const float *cs, const void *q, const void *k, void *q_out, void *k_out,
                     int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t rd, int bf16) {
    const int64_t esz = bf16 ? 2 : 4, h = rd / 2;
    #pragma omp parallel for schedule(static) if (T > 64)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cs + t * 2 * h, *s = c + h;
        const int64_t qo = t * Hq * D * esz, ko = t * Hkv * D * esz;
        if (bf16) {
            rotate_heads((const char *)q + qo, (char *)q_out + qo, Hq, D, rd, c, s, 1);
            rotate_heads((const char *)k + ko, (char *)k_out + ko, Hkv, D, rd, c, s, 1);
        } else {
            rotate_heads((const char *)q + qo, (char *)q_out + qo, Hq, D, rd, c, s, 0);
            rotate_heads((const char *)k + ko, (char *)k_out + ko, Hkv, D, rd, c, s, 0);
        }
    }
    return 0;
}
