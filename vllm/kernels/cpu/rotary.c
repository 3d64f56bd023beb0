/* Rotary position embedding, rotate-half (GPT-NeoX / HF Llama) style, out of place:
 *   for each head and i < rd/2, with a = pos * inv_freq[i] (f32, as HF computes it):
 *   out[i]        = x[i] * c - x[i + rd/2] * s
 *   out[i + rd/2] = x[i + rd/2] * c + x[i] * s,   c = cos(a) * scaling, s = sin(a) * scaling
 * Dims past rd are copied. q [T, Hq*D], k [T, Hkv*D]; q, k and outputs share one dtype. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

INLINE void rotate_heads(const void *x, void *out, int64_t heads, int64_t D, int64_t rd,
                         const float *c, const float *s, int bf16) {
    const int64_t h = rd / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        const int64_t b = hd * D;
        for (int64_t i = 0; i < h; i++) {
            const float x1 = load1(x, bf16, b + i), x2 = load1(x, bf16, b + i + h);
            const float o1 = x1 * c[i] - x2 * s[i], o2 = x2 * c[i] + x1 * s[i];
            store1(out, bf16, b + i, o1);
            store1(out, bf16, b + i + h, o2);
        }
        const size_t esz = bf16 ? 2 : 4;       /* dims past rd: copied bit for bit */
        memcpy((char *)out + (b + rd) * esz, (const char *)x + (b + rd) * esz, (D - rd) * esz);
    }
}

/* Returns 0, or -1 when scratch could not be allocated. */
int rotary_embedding(const int64_t *positions, const void *q, const void *k, void *q_out,
                     void *k_out, const float *inv_freq, float scaling, int64_t T, int64_t Hq,
                     int64_t Hkv, int64_t D, int64_t rd, int bf16) {
    const int64_t esz = bf16 ? 2 : 4, h = rd / 2;
    int failed = 0;
    #pragma omp parallel if (T > 64)
    {
        float *cs = malloc(sizeof(float) * (size_t)(2 * h + 1));
        if (!cs) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!cs) continue;
            for (int64_t i = 0; i < h; i++) {
                float sn, cn;
                sincosf((float)positions[t] * inv_freq[i], &sn, &cn);
                cs[i] = cn * scaling;
                cs[h + i] = sn * scaling;
            }
            const int64_t qo = t * Hq * D * esz, ko = t * Hkv * D * esz;
            if (bf16) {
                rotate_heads((const char *)q + qo, (char *)q_out + qo, Hq, D, rd, cs, cs + h, 1);
                rotate_heads((const char *)k + ko, (char *)k_out + ko, Hkv, D, rd, cs, cs + h, 1);
            } else {
                rotate_heads((const char *)q + qo, (char *)q_out + qo, Hq, D, rd, cs, cs + h, 0);
                rotate_heads((const char *)k + ko, (char *)k_out + ko, Hkv, D, rd, cs, cs + h, 0);
            }
        }
        free(cs);
    }
    return failed ? -1 : 0;
}
