/* Matrix products of a few tokens with 16-bit weight rows as the host store holds them: the
 * unquantized experts a GPU machine's CPU computes (expert_cache/host_experts.py), read in
 * place at memory speed.
 *
 *   y [T, R] = x [T, C] @ W^T,  W [R, C] bf16 or f16, row r at w + r * ldw (elements),
 *   f32 sums and f32 y (the caller rounds).
 *
 * Two chains, chosen per call: bf16 weights with bf16 tokens (xb) multiply pairs of
 * consecutive columns (vec.h's dot_pairs: AVX512-BF16's vdpbf16ps where the build has it, the
 * same steps as FMAs otherwise), 32 columns an instruction; any other pairing widens each 16
 * weights to f32 (bf16: a shift; f16: vcvtph2ps, or bits without AVX512F) for an fma with
 * the f32 tokens. Columns past the last whole vector go one by one. Tokens go in chunks of up
 * to TOK, each weight vector loaded once per chunk; rows in pairs (two independent chains even
 * at one token); OpenMP splits the pairs; the row two rows on is prefetched. The token loops
 * are qgemv.c's, written out: an always-inline helper shared by both compiled to other address
 * arithmetic and ran slower (the 2026-11-27 session note has the timing and its script). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp12.h"
#include "vec.h"

#define TOK 4

typedef struct {
    const uint16_t *w;
    const float *x;       /* [T, C] f32 */
    const bf16_t *xb;     /* [T, C] bf16 (the pair chain), or NULL */
    float *y;             /* [T, R] */
    int64_t T, R, C, ldw;
    int f16;              /* weights are f16 (else bf16) */
} gemv16_args;

/* An f16 value as f32 (exact; subnormals, infinities and NaN kept). */
INLINE float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    uint32_t u;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        memcpy(&u, &f, sizeof(u));
        u |= sign;
    } else {
        u = sign | (e == 31 ? 0x7f800000u : (e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Weights [c, c + 16) of a row as f32. */
INLINE vf widen16(const uint16_t *row, int64_t c, int f16) {
    if (!f16) {
        vh h;
        memcpy(&h, row + c, sizeof(h));
        return bf16v_to_f32(h);
    }
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + c)));
#else
    vf v;
    for (int l = 0; l < LANES; l++) v[l] = f16_to_f32(row[c + l]);
    return v;
#endif
}

INLINE float widen1(const uint16_t *row, int64_t c, int f16) {
    return f16 ? f16_to_f32(row[c]) : bf16_to_f32(row[c]);
}

/* Rows [r0, r0 + NR) x tokens [t0, t0 + NT), row r0's weights at w0 (the next at w0 + ldw);
 * NR, NT and PAIRS (the bf16 pair chain) constant in each instantiation. */
INLINE void rows_tokens(const gemv16_args *a, const uint16_t *w0, int NR, int NT, int PAIRS,
                        int64_t r0, int64_t t0) {
    vf acc[2][TOK];
    float tail[2][TOK] = {{0}};
    const uint16_t *rows[2] = {w0, w0 + (NR - 1) * a->ldw};
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++) acc[i][t] = splat(0.0f);
    int64_t c = 0;
    if (PAIRS) {
        for (; c + 2 * LANES <= a->C; c += 2 * LANES) {
            wpair w[2];
            for (int i = 0; i < NR; i++) {
                w[i] = load_pair(rows[i] + c);
                if ((c & 31) == 0) __builtin_prefetch(rows[i] + 2 * a->ldw + c, 0, 0);
            }
            for (int t = 0; t < NT; t++) {
                const wpair xv = load_pair(a->xb + (t0 + t) * a->C + c);
                for (int i = 0; i < NR; i++) acc[i][t] = dot_pairs(acc[i][t], xv, w[i]);
            }
        }
    }
    for (; c + LANES <= a->C; c += LANES) {
        vf w[2];
        for (int i = 0; i < NR; i++) {
            w[i] = widen16(rows[i], c, a->f16);
            if ((c & 31) == 0) __builtin_prefetch(rows[i] + 2 * a->ldw + c, 0, 0);
        }
        for (int t = 0; t < NT; t++) {
            vf xv;
            memcpy(&xv, a->x + (t0 + t) * a->C + c, sizeof(xv));
            for (int i = 0; i < NR; i++) acc[i][t] = vfma(w[i], xv, acc[i][t]);
        }
    }
    for (; c < a->C; c++)
        for (int i = 0; i < NR; i++) {
            const float q = widen1(rows[i], c, a->f16);
            for (int t = 0; t < NT; t++)
                tail[i][t] = sfma(q, a->x[(t0 + t) * a->C + c], tail[i][t]);
        }
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++)
            a->y[(t0 + t) * a->R + r0 + i] = lane_sum(acc[i][t]) + tail[i][t];
}

#define NT_CASES(NR, PAIRS)                                                                  \
    switch (nt) {                                                                            \
    case 1: rows_tokens(a, w0, NR, 1, PAIRS, r0, t0); break;                                 \
    case 2: rows_tokens(a, w0, NR, 2, PAIRS, r0, t0); break;                                 \
    case 3: rows_tokens(a, w0, NR, 3, PAIRS, r0, t0); break;                                 \
    default: rows_tokens(a, w0, NR, 4, PAIRS, r0, t0); break;                                \
    }

static void block_widen(const gemv16_args *a, const uint16_t *w0, int nr, int nt, int64_t r0,
                        int64_t t0) {
    if (nr == 2) { NT_CASES(2, 0) } else { NT_CASES(1, 0) }
}

static void block_pairs(const gemv16_args *a, const uint16_t *w0, int nr, int nt, int64_t r0,
                        int64_t t0) {
    if (nr == 2) { NT_CASES(2, 1) } else { NT_CASES(1, 1) }
}

/* Every token chunk of rows [r0, r0 + nr) (nr 1 or 2), row r0 at w0. */
static void pairs_all_tokens(const gemv16_args *a, int pairs_chain, const uint16_t *w0, int nr,
                             int64_t r0) {
    for (int64_t t0 = 0; t0 < a->T; t0 += TOK) {
        const int nt = a->T - t0 < TOK ? (int)(a->T - t0) : TOK;
        if (pairs_chain) block_pairs(a, w0, nr, nt, r0, t0);
        else block_widen(a, w0, nr, nt, r0, t0);
    }
}

/* Returns 0, or -1 for an unknown weight type. wtype: 0 bf16, 1 f16. x: [T, C] f32 (always:
 * the column tail and the widening chain read it); xb: NULL, or x's values as bf16 (bf16
 * weights then take the pair chain). Shapes checked by the wrapper (kernels/cpu/gemv16.py). */
int gemv16(int wtype, const void *w, int64_t ldw, const float *x, const bf16_t *xb, float *y,
           int64_t T, int64_t R, int64_t C) {
    if (wtype < 0 || wtype > 1) return -1;
    const gemv16_args a = {w, x, xb, y, T, R, C, ldw, wtype == 1};
    const int pairs_chain = wtype == 0 && xb != NULL;
    const int64_t pairs = (R + 1) / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        pairs_all_tokens(&a, pairs_chain, a.w + 2 * p * ldw, 2 * p + 1 < R ? 2 : 1, 2 * p);
    return 0;
}

/* gemv16 on a bf16 W [R, C] held as one expert's exp12 planes (exp12.h; nesc escapes), read
 * once: each thread decodes an even number of rows, about EXP12_WEIGHTS weights and at least
 * two rows (rounded out to whole blocks of 128), into a buffer that stays in its L1 cache, then
 * runs gemv16's row pairs on it, so y has gemv16's bits on the decoded W. 4096 read the probe's
 * experts from RAM 1.13-1.17x faster than 16384 (docs/benchmarks.md). Returns 0, or -2 out of
 * memory. */
#define EXP12_WEIGHTS 4096                        /* weights decoded at a time: 8 KB of bf16 */
int gemv16_exp12(const uint8_t *lo, const uint8_t *codes, const uint8_t *base,
                 const int32_t *esc_idx, const uint16_t *esc_bits, int64_t nesc,
                 const float *x, const bf16_t *xb, float *y, int64_t T, int64_t R, int64_t C) {
    const exp12_planes p = {lo, codes, base, esc_idx, esc_bits, nesc};
    const gemv16_args a = {NULL, x, xb, y, T, R, C, C, 0};
    int64_t rows = EXP12_WEIGHTS / (C > 0 ? C : 1);
    rows = rows < 2 ? 2 : rows & ~(int64_t)1;          /* even: gemv16's pairs */
    const int64_t chunks = (R + rows - 1) / rows, cap = rows * C + 2 * EXP12_BLK;
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        uint16_t *buf = malloc((size_t)cap * sizeof(uint16_t));
        failed = buf == NULL;
        #pragma omp for schedule(static)
        for (int64_t k = 0; k < chunks; k++) {
            if (!buf) continue;
            const int64_t r0 = k * rows, r1 = r0 + rows < R ? r0 + rows : R;
            const int64_t b0 = r0 * C / EXP12_BLK, b1 = (r1 * C + EXP12_BLK - 1) / EXP12_BLK;
            exp12_decode_blocks(&p, b0, b1, buf);
            const uint16_t *w = buf + (r0 * C - b0 * EXP12_BLK);
            for (int64_t r = r0; r < r1; r += 2)
                pairs_all_tokens(&a, xb != NULL, w + (r - r0) * C, r + 1 < r1 ? 2 : 1, r);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}
