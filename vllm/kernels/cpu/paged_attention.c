/* Attention of query tokens over the paged KV cache (decodes and prefills alike: each query token
 * attends the first lens[b] tokens of its sequence, its own included, so causality is lens).
 *
 *   out[b, h] = sum_l exp(x_l - m) v[s, l, h / G] / (exp(sink_h - m) + sum_l exp(x_l - m)),
 *   x_l = scale * q[b, h] . k[s, l, h / G],  first <= l < lens[b],  m = max(sink_h, max_l x_l)
 *   s = rows[b] (the query's sequence: its block-table row; b when rows is NULL)
 *   first = max(0, lens[b] - window) with a sliding window (window > 0), else 0: the query at
 *           position lens[b] - 1 sees keys in (position - window, position] (HF's mask)
 *   the sink term only with sinks (sinks[h], one logit per query head, no value), else a plain
 *           softmax
 *
 * q, out [B, Hq, D]; cache [2, num_blocks, block_size, Hkv, D] (0 = keys, 1 = values), or with
 * shared_kv [1, ...]: the values are the keys (MLA). Token l of sequence s at block
 * block_tables[s, l / block_size], offset l % block_size; G = Hq / Hkv
 * (query head h reads kv head h / G, HF's repeat_kv order). q, cache and out share one dtype,
 * f32 or bf16; sinks are f32; scores, softmax and the weighted sum are f32 (in bf16 with D a
 * multiple of 32, q . k is summed by bf16 pairs, vec.h's dot_pairs).
 * Reads the cache in place (no gather into a padded copy, no mask) and in one pass: keys and
 * values chunk by chunk, with an online softmax (seeded with the sink: max = sink, sum = 1).
 * A query's result depends only on its q, its lens and the cache, so a prompt prefilled in
 * chunks gives the bits of one prefilled whole.
 */
#include <math.h>
#include <stdlib.h>

#include "vec.h"

/* Up to 16 consecutive tokens of one block are scored as one vector (lane o = token o): each
 * token's q . k is first a vector of partial products, and 16 such vectors are summed lane-wise
 * by a transpose tree (reduce16), not one horizontal sum per token. */
#define CHUNK LANES

/* Level s of the tree: x and y hold groups of 2s lanes, each group one token's partial sums;
 * the result holds groups of s lanes, x's and y's alternating. */
#define HALVES(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31

/* The tree leaves its results in bit-reversed token order, so token o's partials go in at
 * BITREV[o] and the sums come out in natural order. */
static const int BITREV[CHUNK] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* r[o] = sum of the lanes of part[BITREV[o]], in a fixed order. */
INLINE vf reduce16(const vf *part) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = HALVES(part[2 * i], part[2 * i + 1], LO8) + HALVES(part[2 * i], part[2 * i + 1], HI8);
    for (int i = 0; i < 4; i++)
        b[i] = HALVES(a[2 * i], a[2 * i + 1], LO4) + HALVES(a[2 * i], a[2 * i + 1], HI4);
    for (int i = 0; i < 2; i++)
        c[i] = HALVES(b[2 * i], b[2 * i + 1], LO2) + HALVES(b[2 * i], b[2 * i + 1], HI2);
    return HALVES(c[0], c[1], LO1) + HALVES(c[0], c[1], HI1);
}

INLINE float lane_max(vf v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* Where a later chunk's rows of one kv head are (keys k, values v; n of them, 0 past the end):
 * group_chunk asks for one of its rows per token it computes. */
typedef struct {
    const char *k, *v;
    int64_t n;
} Ahead;

/* The G query heads of one kv head over nc <= CHUNK tokens (keys kb, values vb: rows of `row`
 * elements, the kv head's column offset applied): q, acc [G, D] f32; m, l [G]. Inlined with
 * constant G and D where the caller knows them, so q and the partial sums stay in registers. */
INLINE void group_chunk(const float *q, const void *qraw, float *acc, float *m, float *l,
                        const void *kb, const void *vb, int64_t nc, int64_t row, int64_t G,
                        int64_t D, float scale, int bf16, Ahead ahead) {
    const int64_t esz = bf16 ? 2 : 4;
    const int64_t dv = D - D % LANES;
    /* bf16 with D a multiple of 32: q . k by bf16 pairs (vec.h's dot_pairs, 32 products per
     * instruction where the build has AVX512-BF16), from the raw bf16 q. */
    const int pairs = bf16 && D % (2 * LANES) == 0;
    wpair qp[G][pairs ? D / (2 * LANES) : 1];
    if (pairs)
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d += 2 * LANES)
                qp[g][d / (2 * LANES)] = load_pair((const bf16_t *)qraw + g * D + d);
    vf part[G][CHUNK];
    float tail[G][CHUNK];
    memset(tail, 0, sizeof(tail));
    for (int64_t o = 0; o < CHUNK; o++) {
        vf s[G];
        for (int64_t g = 0; g < G; g++) s[g] = (vf){0};
        if (o < ahead.n)
            for (int64_t b = 0; b < D * esz; b += 64) {
                __builtin_prefetch(ahead.k + o * row * esz + b);
                __builtin_prefetch(ahead.v + o * row * esz + b);
            }
        if (o < nc && pairs) {
            for (int64_t d = 0; d < D; d += 2 * LANES) {
                const wpair k = load_pair((const bf16_t *)kb + o * row + d);
                for (int64_t g = 0; g < G; g++) s[g] = dot_pairs(s[g], qp[g][d / (2 * LANES)], k);
            }
        } else if (o < nc) {
            for (int64_t d = 0; d < dv; d += LANES) {
                const vf k = loadv(kb, bf16, o * row + d);
                for (int64_t g = 0; g < G; g++) s[g] = vfma(*(const vf *)(q + g * D + d), k, s[g]);
            }
            for (int64_t d = dv; d < D; d++) {
                const float k = load1(kb, bf16, o * row + d);
                for (int64_t g = 0; g < G; g++) tail[g][o] = sfma(q[g * D + d], k, tail[g][o]);
            }
        }
        for (int64_t g = 0; g < G; g++) part[g][BITREV[o]] = s[g];
    }
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    float p[G][CHUNK], alpha[G];
    for (int64_t g = 0; g < G; g++) {
        vf sc = (reduce16(part[g]) + *(vf *)tail[g]) * scale;
        sc = vselect(lane < (int32_t)nc, sc, (vf){0} - INFINITY);
        const float mx = lane_max(sc), m_new = mx > m[g] ? mx : m[g];
        const vf e = vselect(lane < (int32_t)nc, vexp(sc - m_new), (vf){0});
        alpha[g] = vexp((vf){0} + (m[g] - m_new))[0];         /* 0-ish: 1st chunk, no sink */
        m[g] = m_new;
        l[g] = sfma(l[g], alpha[g], lane_sum(e));
        memcpy(p[g], &e, sizeof(e));
    }
    for (int64_t d = 0; d < dv; d += LANES) {
        vf a[G];
        for (int64_t g = 0; g < G; g++) a[g] = *(vf *)(acc + g * D + d) * alpha[g];
        for (int64_t o = 0; o < nc; o++) {
            const vf v = loadv(vb, bf16, o * row + d);
            for (int64_t g = 0; g < G; g++) a[g] = vfma(splat(p[g][o]), v, a[g]);
        }
        for (int64_t g = 0; g < G; g++) memcpy(acc + g * D + d, &a[g], sizeof(vf));
    }
    for (int64_t d = dv; d < D; d++)
        for (int64_t g = 0; g < G; g++) {
            float a = acc[g * D + d] * alpha[g];
            for (int64_t o = 0; o < nc; o++) a = sfma(p[g][o], load1(vb, bf16, o * row + d), a);
            acc[g * D + d] = a;
        }
}

/* Tokens of block blk of an L-token sequence (bs, or fewer in the last block). */
INLINE int64_t block_rows(int64_t L, int64_t blk, int64_t bs) {
    return L - blk * bs < bs ? L - blk * bs : bs;
}

/* Blocks are scattered over the cache, which the hardware prefetcher cannot follow, so the
 * rows of the chunk PF_CHUNKS ahead are prefetched a row at a time while this one is computed
 * (a whole block at once overflows the outstanding-miss queues; measured: 2 ahead is best,
 * 15% faster than prefetching the next block at its start, on 300-token contexts). Chunks never
 * straddle blocks: chunk c is block c / cpb, rows from (c % cpb) * CHUNK, cpb chunks per block. */
#define PF_CHUNKS 2
INLINE Ahead chunk_ahead(const void *keys, const void *values, const int64_t *table, int64_t c,
                         int64_t L, int64_t bs, int64_t row_bytes, int64_t col_bytes) {
    const int64_t cpb = (bs + CHUNK - 1) / CHUNK, blk = c / cpb, o0 = (c % cpb) * CHUNK;
    Ahead a = {0, 0, 0};
    if (blk * bs + o0 >= L) return a;
    const int64_t end = block_rows(L, blk, bs);
    const int64_t off = (table[blk] * bs + o0) * row_bytes + col_bytes;
    a.k = (const char *)keys + off;
    a.v = (const char *)values + off;
    a.n = end - o0 < CHUNK ? end - o0 : CHUNK;
    return a;
}

/* One sequence, all its heads, in one pass over its blocks from token `first` (the window's
 * start; its block's chunks start there, later blocks' at their row 0). Per query head it keeps
 * the running max m, the running sum l of exp(score - m) and acc = sum exp(score - m) * v,
 * seeded with the sink when there is one (m = sink, l = exp(sink - m) = 1, acc = 0: a logit
 * without a value); each chunk rescales them once to its new max (online softmax). scratch holds
 * 2 * Hq * (D + 1) floats. */
INLINE void attend(const void *q, const void *keys, const void *values, const int64_t *table,
                   int64_t L, int64_t first, const float *sinks, int64_t Hq, int64_t Hkv,
                   int64_t G, int64_t D, int64_t bs, float scale, int bf16, float *scratch,
                   void *out) {
    const int64_t esz = bf16 ? 2 : 4, nblk = (L + bs - 1) / bs, row = Hkv * D;
    float *qf = scratch, *acc = scratch + Hq * D, *m = acc + Hq * D, *l = m + Hq;
    for (int64_t i = 0; i < Hq * D; i++) qf[i] = load1(q, bf16, i);
    memset(acc, 0, sizeof(float) * Hq * D);
    for (int64_t h = 0; h < Hq; h++) {
        m[h] = sinks ? sinks[h] : -INFINITY;
        l[h] = sinks ? 1.0f : 0.0f;
    }
    const int64_t cpb = (bs + CHUNK - 1) / CHUNK;
    for (int64_t blk = first / bs; blk < nblk; blk++) {
        const int64_t n = block_rows(L, blk, bs);
        const int64_t base = table[blk] * bs * row * esz;
        for (int64_t o0 = blk == first / bs ? first % bs : 0; o0 < n; o0 += CHUNK)
            for (int64_t j = 0; j < Hkv; j++) {
                const int64_t off = base + (o0 * row + j * D) * esz, h = j * G;
                const Ahead ahead = chunk_ahead(keys, values, table,
                                                blk * cpb + o0 / CHUNK + PF_CHUNKS, L, bs,
                                                row * esz, j * D * esz);
                group_chunk(qf + h * D, (const char *)q + h * D * esz, acc + h * D, m + h,
                            l + h, (const char *)keys + off, (const char *)values + off,
                            n - o0 < CHUNK ? n - o0 : CHUNK, row, G, D, scale, bf16, ahead);
            }
    }
    for (int64_t h = 0; h < Hq; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < D; d++) store1(out, bf16, h * D + d, acc[h * D + d] * inv);
    }
}

/* attend() specialised on the dtype and, for common shapes, on G and D (constants let the
 * compiler keep a group's queries and partial sums in registers). */
#define ATTEND(bf, g, d) \
    attend(q, keys, values, table, L, first, sinks, Hq, Hkv, g, d, bs, scale, bf, scratch, out)
static void attend_any(const void *q, const void *keys, const void *values, const int64_t *table,
                       int64_t L, int64_t first, const float *sinks, int64_t Hq, int64_t Hkv,
                       int64_t D, int64_t bs, float scale, int bf16, float *scratch, void *out) {
    const int64_t G = Hq / Hkv;
    if (bf16) {
        if (G == 2 && D == 64) ATTEND(1, 2, 64);
        else if (G == 4 && D == 128) ATTEND(1, 4, 128);
        else ATTEND(1, G, D);
    } else {
        if (G == 2 && D == 64) ATTEND(0, 2, 64);
        else if (G == 4 && D == 128) ATTEND(0, 4, 128);
        else ATTEND(0, G, D);
    }
}

/* sinks: [Hq] f32 or NULL; window: 0 = none; shared_kv: the cache has one plane, read as keys
 * and values. Returns 0; -1 if scratch could not be allocated; -2 if a query's row, length or
 * block ids fall outside the block tables or the cache (nothing is read out of bounds). */
int paged_attention(const void *q, const void *cache, const int64_t *block_tables,
                    int64_t bt_rows, int64_t bt_stride, const int64_t *rows,
                    const int64_t *lens, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                    int64_t block_size, int64_t num_blocks, float scale, int bf16,
                    const float *sinks, int64_t window, int shared_kv) {
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = lens[b], r = rows ? rows[b] : b;
        if (r < 0 || r >= bt_rows || L < 1 || L > bt_stride * block_size) return -2;
        for (int64_t i = 0; i < (L + block_size - 1) / block_size; i++) {
            const int64_t blk = block_tables[r * bt_stride + i];
            if (blk < 0 || blk >= num_blocks) return -2;
        }
    }
    const void *values = shared_kv ? cache
                                   : (const char *)cache + num_blocks * block_size * Hkv * D * esz;
    int failed = 0;
    #pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(2 * Hq * (D + 1)));
        if (!scratch) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            if (!scratch) continue;
            const void *qb = (const char *)q + b * Hq * D * esz;
            void *ob = (char *)out + b * Hq * D * esz;
            const int64_t first = window > 0 && lens[b] > window ? lens[b] - window : 0;
            attend_any(qb, cache, values, block_tables + (rows ? rows[b] : b) * bt_stride, lens[b],
                       first, sinks, Hq, Hkv, D, block_size, scale, bf16, scratch, ob);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* cache[0][slots[t]] = k[t], cache[1][slots[t]] = v[t] for t < T: rows of row_bytes bytes (the
 * caller passes k, v already in the cache dtype). v NULL: a one-plane (shared K=V) cache, keys
 * only. A slot of -1 (PAD_SLOT_ID, a padding row of a replayed decode graph) writes nothing.
 * Returns -2 if another slot is outside the cache. */
int write_kv_cache(const void *k, const void *v, const int64_t *slots, void *cache, int64_t T,
                   int64_t num_slots, int64_t row_bytes) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -2;
    char *values = (char *)cache + num_slots * row_bytes;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)cache + slots[t] * row_bytes, (const char *)k + t * row_bytes, row_bytes);
        if (v) memcpy(values + slots[t] * row_bytes, (const char *)v + t * row_bytes, row_bytes);
    }
    return 0;
}
