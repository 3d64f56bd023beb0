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
#include <stdlib.h>

#include "vec.h"

/* dot(a, b) with a f32 and b in the cache dtype: lane-wise partial sums, fixed reduction. */
INLINE float dot(const float *a, const void *b, int bf16, int64_t n) {
    vf acc = (vf){0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += *(const vf *)(a + i) * loadv(b, bf16, i);
    float s = lane_sum(acc);
    for (; i < n; i++) s += a[i] * load1(b, bf16, i);
    return s;
}

/* Blocks are scattered over the cache, which the hardware prefetcher cannot follow: while one
 * block is computed, ask for the next block's keys and values (all kv heads: one block of one
 * layer is a contiguous bs * Hkv * D run in each). */
INLINE void prefetch_block(const void *keys, const void *values, const int64_t *table, int64_t blk,
                           int64_t L, int64_t bs, int64_t row_bytes) {
    if (blk * bs >= L) return;
    const int64_t n = L - blk * bs < bs ? L - blk * bs : bs;
    const int64_t off = table[blk] * bs * row_bytes;
    for (int64_t b = 0; b < n * row_bytes; b += 64) {
        __builtin_prefetch((const char *)keys + off + b);
        __builtin_prefetch((const char *)values + off + b);
    }
}

/* One sequence, all its heads: scratch holds Hq*(L + 2D) floats. Inlined with a constant bf16
 * so each dtype gets its own vectorised loops. Positions are walked block by block, each
 * position's row (all kv heads) read once and in order. */
INLINE void attend(const void *q, const void *keys, const void *values, const int64_t *table,
                   int64_t L, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
                   int bf16, float *scratch, void *out) {
    const int64_t G = Hq / Hkv, esz = bf16 ? 2 : 4, nblk = (L + bs - 1) / bs, row = Hkv * D;
    float *qf = scratch, *acc = qf + Hq * D, *p = acc + Hq * D;   /* p [Hq, L] */
    for (int64_t i = 0; i < Hq * D; i++) qf[i] = load1(q, bf16, i);
    for (int64_t blk = 0; blk < nblk; blk++) {
        prefetch_block(keys, values, table, blk + 1, L, bs, row * esz);
        const int64_t l0 = blk * bs, n = L - l0 < bs ? L - l0 : bs;
        const char *kb = (const char *)keys + table[blk] * bs * row * esz;
        for (int64_t o = 0; o < n; o++)
            for (int64_t h = 0; h < Hq; h++)
                p[h * L + l0 + o] =
                    scale * dot(qf + h * D, kb + (o * row + (h / G) * D) * esz, bf16, D);
    }
    for (int64_t h = 0; h < Hq; h++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t l = 0; l < L; l++) mx = p[h * L + l] > mx ? p[h * L + l] : mx;
        exp_shifted(p + h * L, L, -mx);
        for (int64_t l = 0; l < L; l++) sum += p[h * L + l];
        const float inv = 1.0f / sum;
        for (int64_t l = 0; l < L; l++) p[h * L + l] *= inv;
    }
    memset(acc, 0, sizeof(float) * Hq * D);
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t l0 = blk * bs, n = L - l0 < bs ? L - l0 : bs;
        const char *vb = (const char *)values + table[blk] * bs * row * esz;
        for (int64_t o = 0; o < n; o++)
            for (int64_t h = 0; h < Hq; h++) {
                const float ph = p[h * L + l0 + o];
                const void *v = vb + (o * row + (h / G) * D) * esz;
                for (int64_t d = 0; d < D; d++) acc[h * D + d] += ph * load1(v, bf16, d);
            }
    }
    for (int64_t i = 0; i < Hq * D; i++) store1(out, bf16, i, acc[i]);
}

/* Returns 0; -1 if scratch could not be allocated; -2 if a sequence's length or block ids fall
 * outside the cache or its block table (nothing is read out of bounds). */
int paged_decode_attention(const void *q, const void *cache, const int64_t *block_tables,
                           int64_t bt_stride, const int64_t *seq_lens, void *out, int64_t B,
                           int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                           int64_t num_blocks, float scale, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_lens[b];
        if (L < 1 || L > bt_stride * block_size) return -2;
        for (int64_t i = 0; i < (L + block_size - 1) / block_size; i++) {
            const int64_t blk = block_tables[b * bt_stride + i];
            if (blk < 0 || blk >= num_blocks) return -2;
        }
        max_len = L > max_len ? L : max_len;
    }
    const void *values = (const char *)cache + num_blocks * block_size * Hkv * D * esz;
    int failed = 0;
    #pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(Hq * (max_len + 2 * D)));
        if (!scratch) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            if (!scratch) continue;
            const void *qb = (const char *)q + b * Hq * D * esz;
            void *ob = (char *)out + b * Hq * D * esz;
            if (bf16)
                attend(qb, cache, values, block_tables + b * bt_stride, seq_lens[b], Hq, Hkv, D,
                       block_size, scale, 1, scratch, ob);
            else
                attend(qb, cache, values, block_tables + b * bt_stride, seq_lens[b], Hq, Hkv, D,
                       block_size, scale, 0, scratch, ob);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* cache[0][slots[t]] = k[t], cache[1][slots[t]] = v[t] for t < T: rows of row_bytes bytes (the
 * caller passes k, v already in the cache dtype). Returns -2 if a slot is outside the cache. */
int write_kv_cache(const void *k, const void *v, const int64_t *slots, void *cache, int64_t T,
                   int64_t num_slots, int64_t row_bytes) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -2;
    char *values = (char *)cache + num_slots * row_bytes;
    for (int64_t t = 0; t < T; t++) {
        memcpy((char *)cache + slots[t] * row_bytes, (const char *)k + t * row_bytes, row_bytes);
        memcpy(values + slots[t] * row_bytes, (const char *)v + t * row_bytes, row_bytes);
    }
    return 0;
}
