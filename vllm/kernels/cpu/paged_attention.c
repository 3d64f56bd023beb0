/* Decode attention over the paged KV cache: one query token per sequence.
 *
 *   out[b, h] = softmax_l(scale * q[b, h] . k[b, l, h / G]) @ v[b, :, h / G],  l < seq_lens[b]
 *
 * q, out [B, Hq, D]; cache [2, num_blocks, block_size, Hkv, D] (0 = keys, 1 = values), token l
 * of sequence b at block block_tables[b, l / block_size], offset l % block_size; G = Hq / Hkv
 * (query head h reads kv head h / G, HF's repeat_kv order). q, cache and out share one dtype,
 * f32 or bf16; scores, softmax and the weighted sum are f32.
 * Reads the cache in place: no gather into a padded copy, no mask.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

#define INLINE static inline __attribute__((always_inline))

INLINE float to_f32(const void *p, int bf16, int64_t i) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));      /* unaligned ok */
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

INLINE vf load(const void *p, int bf16, int64_t i) {
    if (!bf16) return *(const vf *)((const float *)p + i);
    vu u = __builtin_convertvector(*(const vh *)((const uint16_t *)p + i), vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Sum of the 16 lanes in a fixed tree (halves, then quarters, ...), in registers. */
INLINE float lane_sum(vf v) {
    vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* dot(a, b) with a f32 and b in the cache dtype: lane-wise partial sums, fixed reduction. */
INLINE float dot(const float *a, const void *b, int bf16, int64_t n) {
    vf acc = (vf){0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += *(const vf *)(a + i) * load(b, bf16, i);
    float s = lane_sum(acc);
    for (; i < n; i++) s += a[i] * to_f32(b, bf16, i);
    return s;
}

/* Rows of consecutive positions sit in different blocks scattered over the cache, which the
 * hardware prefetcher cannot follow: ask for position l's row a few positions ahead. */
#define PREFETCH 8
INLINE void prefetch_row(const void *base, const int64_t *table, int64_t l, int64_t L, int64_t bs,
                         int64_t Hkv, int64_t g, int64_t D, int64_t esz) {
    if (l >= L) return;
    const char *p = (const char *)base + ((table[l / bs] * bs + l % bs) * Hkv + g) * D * esz;
    for (int64_t off = 0; off < D * esz; off += 64) __builtin_prefetch(p + off);
}

/* One (sequence, kv head): its G query heads against its context. scratch: G*(L + 2D) floats.
 * Inlined with a constant bf16 so each dtype gets its own vectorised loops. */
INLINE void attend(const void *q, const void *keys, const void *values, const int64_t *table,
                   int64_t L, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t g,
                   float scale, int bf16, float *scratch, void *out) {
    const int64_t G = Hq / Hkv, esz = bf16 ? 2 : 4;
    float *qf = scratch, *acc = qf + G * D, *p = acc + G * D;
    for (int64_t j = 0; j < G; j++)
        for (int64_t d = 0; d < D; d++) qf[j * D + d] = to_f32(q, bf16, (g * G + j) * D + d);
    for (int64_t l = 0; l < L; l++) {
        const int64_t row = ((table[l / bs] * bs + l % bs) * Hkv + g) * D;
        const void *k = (const char *)keys + row * esz;
        prefetch_row(keys, table, l + PREFETCH, L, bs, Hkv, g, D, esz);
        prefetch_row(values, table, l + PREFETCH, L, bs, Hkv, g, D, esz);  /* read just after */
        for (int64_t j = 0; j < G; j++) p[j * L + l] = scale * dot(qf + j * D, k, bf16, D);
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t j = 0; j < G; j++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t l = 0; l < L; l++) mx = p[j * L + l] > mx ? p[j * L + l] : mx;
        for (int64_t l = 0; l < L; l++) sum += (p[j * L + l] = expf(p[j * L + l] - mx));
        const float inv = 1.0f / sum;
        for (int64_t l = 0; l < L; l++) p[j * L + l] *= inv;
    }
    for (int64_t l = 0; l < L; l++) {
        const int64_t row = ((table[l / bs] * bs + l % bs) * Hkv + g) * D;
        const void *v = (const char *)values + row * esz;
        for (int64_t j = 0; j < G; j++) {
            const float pj = p[j * L + l];
            for (int64_t d = 0; d < D; d++) acc[j * D + d] += pj * to_f32(v, bf16, d);
        }
    }
    for (int64_t i = 0; i < G * D; i++) {
        if (bf16) ((uint16_t *)out)[g * G * D + i] = to_bf16(acc[i]);
        else ((float *)out)[g * G * D + i] = acc[i];
    }
}

/* Returns 0; -1 if scratch could not be allocated; -2 if a sequence's length or block ids fall
 * outside the cache or its block table (nothing is read out of bounds). */
int paged_decode_attention(const void *q, const void *cache, const int64_t *block_tables,
                           int64_t bt_stride, const int64_t *seq_lens, void *out, int64_t B,
                           int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                           int64_t num_blocks, float scale, int bf16) {
    const int64_t esz = bf16 ? 2 : 4, G = Hq / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_lens[b];
        if (L < 1 || L > bt_stride * block_size) return -2;
        for (int64_t i = 0; i < (L + block_size - 1) / block_size; i++)
            if (block_tables[b * bt_stride + i] < 0 || block_tables[b * bt_stride + i] >= num_blocks)
                return -2;
        max_len = L > max_len ? L : max_len;
    }
    const void *values = (const char *)cache + num_blocks * block_size * Hkv * D * esz;
    int failed = 0;
    #pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(G * (max_len + 2 * D)));
        if (!scratch) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < B * Hkv; i++) {
            if (!scratch) continue;
            const int64_t b = i / Hkv, g = i % Hkv;
            const void *qb = (const char *)q + b * Hq * D * esz;
            void *ob = (char *)out + b * Hq * D * esz;
            if (bf16)
                attend(qb, cache, values, block_tables + b * bt_stride, seq_lens[b], Hq, Hkv, D,
                       block_size, g, scale, 1, scratch, ob);
            else
                attend(qb, cache, values, block_tables + b * bt_stride, seq_lens[b], Hq, Hkv, D,
                       block_size, g, scale, 0, scratch, ob);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
