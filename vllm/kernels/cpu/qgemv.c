/* Quantized matrix-vector products on the schemes' own layouts: the experts a GPU machine's CPU
 * computes from the host store (expert_cache/host_compute.py), without dequantizing them first.
 *
 *   y [T, R] = x [T, C] @ W^T,  W [R, C] dequantized in registers right before the FMAs.
 *
 * kind 0, FP8: e4m3 codes [R, C], row-major (a row is an output).
 * kind 1, GPTQ INT4: int32 words [R, C / 8], column c at bits [4 (c % 8), +4) of word c / 8;
 *   zero points from the scheme's packed qzeros [ceil(R / 8), Gs] int32 (row r at bits
 *   [4 (r % 8), +4) of word r / 8) plus zero_offset (GPTQ v1 stores zero - 1); with act order
 *   the group of column c is gidx[c] of the row's part (rows_tokens_gidx), not c / group.
 * kind 2, FP4 (NVFP4, MXFP4): e2m1 codes [R, C / 2] bytes, column c in the low nibble of byte
 *   c / 2 when c is even (read as kind 1's words: the same nibble order), sign in bit 3.
 * Scales [Rs, Gs]: element (r, c) reads scales[(r / row_div) * Gs + c / group] (a tensor
 * scale per half, per-channel, 128 x 128 blocks, GPTQ groups, FP4 blocks of 16 or 32: the
 * wrapper builds the view), f32 (scale_code 0) or bytes: e4m3 (1), e8m0 2^(b - 127) (2);
 * times global[r / gdiv] when global is not NULL (NVFP4's per-half weight_scale_2).
 *
 * Per row r, token t and group g: dot = sum over the group's columns of q[r, c] x[t, c] in f32
 * (q: the code's value, exactly representable), then y[t, r] += s (dot - z sum x[t, c]), z the
 * zero point (INT4; else 0); the f32 chain decodes FP8 to value / 256 (the f16 bit trick
 * below), the 256 riding in s. x, y f32; the caller rounds. Tokens go in chunks of up to TOK,
 * each weight vector decoded once per chunk; rows in pairs (two independent FMA chains even at
 * one token); threads split the rows.
 * The wrapper (kernels/cpu/qgemv.py) checks shapes: INT4 and FP4 need group % 8 == 0.
 * An e4m3 NaN code (0x7f, 0xff) decodes to +-480, an e8m0 255 to 2^128: never in weights.
 *
 * Two chains, chosen per call: with bf16 tokens (xb, the same values as x), a build with
 * AVX512-BF16 and VBMI and groups of at least one step, the codes' exact values become bf16
 * pairs of consecutive columns (qgemm_codes.h's conversions: FP8 64 codes with two byte-table
 * lookups, INT4 and FP4 32 with one word-table lookup) that vdpbf16ps multiplies by the
 * tokens' pairs, about a third of the f32 chain's instructions per weight; otherwise every 16
 * columns decode to f32 for an fma (FP8 through f16, INT4 by shifts, FP4 by shifts and a
 * 16-entry table), and where a group is one such vector (NVFP4) the vector is scaled before
 * its FMAs (rows_tokens_vscale) instead. Columns of a group past the chain's last whole step
 * go one by one in f32. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemv_decode.h"
#include "vec.h"

#define TOK 4

/* The same bytes of the row two rows on (the next pair's), read while this pair's are decoded:
 * a miss reads its expert from RAM, and one core's hardware prefetchers alone kept about half
 * the bandwidth torch.mv reaches on bf16 rows (measured, docs/benchmarks.md). */
#define PREFETCH_NEXT_PAIR(kind, row, c)                                                     \
    __builtin_prefetch((const char *)(row) + 2 * a->row_bytes +                              \
                       ((kind) == 0 ? (c) : (c) / 2), 0, 0)

typedef struct {
    int kind, zero_offset, scale_code;
    const void *codes, *scales;
    const float *global, *x, *xsum;       /* xsum [T, Gs]: x summed per group (int4 zeros) */
    const bf16_t *xb;                     /* x as bf16 [T, C] (the bf16 chain), or NULL */
    const int32_t *zeros, *gidx;          /* gidx [R / gidx_div, C]: column -> group, or NULL */
    float *y;
    int64_t T, R, C, Gs, row_div, group, row_bytes, gdiv, gidx_div;
} qgemv_args;

/* Where row r's scales start, and its global scale (1 without): once per row. */
INLINE int64_t scale_base(const qgemv_args *a, int64_t r) { return (r / a->row_div) * a->Gs; }
INLINE float row_global(const qgemv_args *a, int64_t r) {
    return a->global ? a->global[r / a->gdiv] : 1.0f;
}

/* The scale of group g of a row (scale_base, row_global), global scale included. */
INLINE float scale_of(const qgemv_args *a, int64_t base, float glob, int64_t g) {
    const int64_t i = base + g;
    const float s = a->scale_code == 0 ? ((const float *)a->scales)[i]
                                       : scale_byte(a->scale_code, ((const uint8_t *)a->scales)[i]);
    return s * glob;
}

/* Rows r0 and r0 + NR - 1 of a call (NR = 1: the same row twice): their codes, where their
 * scales start (scale_base) and their global scales (row_global). */
typedef struct {
    const char *codes[2];
    int64_t base[2];
    float glob[2];
} row_pair;

INLINE row_pair rows_at(const qgemv_args *a, int NR, int64_t r0) {
    row_pair p;
    for (int i = 0; i < 2; i++) {
        const int64_t r = r0 + (i ? NR - 1 : 0);
        p.codes[i] = (const char *)a->codes + r * a->row_bytes;
        p.base[i] = scale_base(a, r);
        p.glob[i] = row_global(a, r);
    }
    return p;
}

/* INT4's zero point of row r, group g (with the format's offset). */
INLINE float zero_of(const qgemv_args *a, int64_t r, int64_t g) {
    return (float)((((uint32_t)a->zeros[(r >> 3) * a->Gs + g]) >> (4 * (r & 7))) & 15u) +
           (float)a->zero_offset;
}

/* Rows [r0, r0 + NR) x tokens [t0, t0 + NT): kind, NR, NT and BF16 (the bf16 chain) constant
 * in each instantiation. */
INLINE void rows_tokens(const qgemv_args *a, int kind, int NR, int NT, int BF16, int64_t r0,
                        int64_t t0) {
    vf tot[2][TOK];
    float corr[2][TOK] = {{0}};
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++) tot[i][t] = splat(0.0f);
    const row_pair pr = rows_at(a, NR, r0);
    const char *const *rows = pr.codes;
    const float unit = kind == 0 && !BF16 ? 256.0f : 1.0f;    /* the f32 chain's FP8: v / 256 */
    for (int64_t g = 0; g < a->Gs; g++) {
        const int64_t c0 = g * a->group, c1 = c0 + a->group < a->C ? c0 + a->group : a->C;
        vf acc[2][TOK];
        float tail[2][TOK] = {{0}};
        for (int i = 0; i < NR; i++)
            for (int t = 0; t < NT; t++) acc[i][t] = splat(0.0f);
        int64_t c = c0;
#if HAVE_BF16_CHAIN
        if (BF16) {
            for (; c + BSTEP(kind) <= c1; c += BSTEP(kind)) {
                __m512bh w[2][2];
                for (int i = 0; i < NR; i++) {
                    bf16_codes(kind, rows[i], c, w[i]);
                    if ((c & 63) == 0) PREFETCH_NEXT_PAIR(kind, rows[i], c);
                }
                for (int t = 0; t < NT; t++)
                    for (int h = 0; h < BSTEP(kind) / 32; h++) {
                        const __m512bh xv = (__m512bh)_mm512_loadu_si512(
                            a->xb + (t0 + t) * a->C + c + 32 * h);
                        for (int i = 0; i < NR; i++)
                            acc[i][t] = (vf)_mm512_dpbf16_ps((__m512)acc[i][t], xv, w[i][h]);
                    }
            }
        }
#endif
        for (; !BF16 && c + LANES <= c1; c += LANES) {
            vf w[2];
            for (int i = 0; i < NR; i++) {
                w[i] = code16(kind, rows[i], c);
                if ((c & 63) == 0) PREFETCH_NEXT_PAIR(kind, rows[i], c);
            }
            for (int t = 0; t < NT; t++) {
                vf xv;
                memcpy(&xv, a->x + (t0 + t) * a->C + c, sizeof(xv));
                for (int i = 0; i < NR; i++) acc[i][t] = vfma(w[i], xv, acc[i][t]);
            }
        }
        for (; c < c1; c++)
            for (int i = 0; i < NR; i++) {
                const float q = code1(kind, rows[i], c);
                for (int t = 0; t < NT; t++)
                    tail[i][t] = sfma(q, a->x[(t0 + t) * a->C + c], tail[i][t]);
            }
        for (int i = 0; i < NR; i++) {
            const float s = scale_of(a, pr.base[i], pr.glob[i], g);
            const float z = kind == 1 ? zero_of(a, r0 + i, g) : 0.0f;
            for (int t = 0; t < NT; t++) {
                tot[i][t] = vfma(splat(s * unit), acc[i][t], tot[i][t]);
                corr[i][t] += s * (tail[i][t] - z * a->xsum[(t0 + t) * a->Gs + g]);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++)
            a->y[(t0 + t) * a->R + r0 + i] = lane_sum(tot[i][t]) + corr[i][t];
}

/* The f32 chain for groups of exactly one vector (NVFP4's 16 columns, INT4 groups of 16):
 * each decoded vector is scaled, and INT4's zero point applied, (q - z) s = fma(q, s, -z s),
 * before its FMAs, instead of a per-group epilogue for every 16 columns. */
INLINE void rows_tokens_vscale(const qgemv_args *a, int kind, int NR, int NT, int64_t r0,
                               int64_t t0) {
    vf tot[2][TOK];
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++) tot[i][t] = splat(0.0f);
    const row_pair pr = rows_at(a, NR, r0);
    const char *const *rows = pr.codes;
    const float unit = kind == 0 ? 256.0f : 1.0f;
    for (int64_t g = 0; g < a->Gs; g++) {
        const int64_t c = g * LANES;
        vf w[2];
        for (int i = 0; i < NR; i++) {
            const float s = scale_of(a, pr.base[i], pr.glob[i], g);
            const float zs = kind == 1 ? -zero_of(a, r0 + i, g) * s : 0.0f;
            w[i] = vfma(code16(kind, rows[i], c), splat(s * unit), splat(zs));
            if ((c & 63) == 0) PREFETCH_NEXT_PAIR(kind, rows[i], c);
        }
        for (int t = 0; t < NT; t++) {
            vf xv;
            memcpy(&xv, a->x + (t0 + t) * a->C + c, sizeof(xv));
            for (int i = 0; i < NR; i++) tot[i][t] = vfma(w[i], xv, tot[i][t]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++) a->y[(t0 + t) * a->R + r0 + i] = lane_sum(tot[i][t]);
}

/* lanes' values of a row's [Gs] table at the groups gi (Gs <= 16 or 32: a permute of the table
 * held in t0, t1; else a gather). */
INLINE vf group_lookup(const float *tab, vi gi, int64_t Gs, vf t0, vf t1) {
#if defined(__AVX512F__)
    if (Gs <= 16) return (vf)_mm512_permutexvar_ps((__m512i)gi, (__m512)t0);
    if (Gs <= 32) return (vf)_mm512_permutex2var_ps((__m512)t0, (__m512i)gi, (__m512)t1);
    return (vf)_mm512_i32gather_ps((__m512i)gi, tab, 4);
#else
    (void)Gs, (void)t0, (void)t1;
    vf v;
    for (int l = 0; l < LANES; l++) v[l] = tab[gi[l]];
    return v;
#endif
}

/* INT4 whose columns' groups are in any order (GPTQ act order: gidx): every lane of a vector
 * takes its column's group scale s and -z s from the row's tables, (q - z) s = fma(q, s, -z s),
 * before the FMAs. NR rows share one gidx row (callers keep a pair inside one half). */
INLINE void rows_tokens_gidx(const qgemv_args *a, int NR, int NT, int64_t r0, int64_t t0) {
    const int64_t Gs = a->Gs;
    float st[2][Gs + 32], zt[2][Gs + 32];      /* padded: the permutes load 32 floats */
    vf tot[2][TOK], s0[2], s1[2], z0[2], z1[2];
    const row_pair pr = rows_at(a, NR, r0);
    const char *const *rows = pr.codes;
    const int32_t *gidx = a->gidx + (r0 / a->gidx_div) * a->C;
    for (int i = 0; i < NR; i++) {
        for (int64_t g = 0; g < Gs + 32; g++) {
            const float sg = g < Gs ? scale_of(a, pr.base[i], pr.glob[i], g) : 0.0f;
            st[i][g] = sg;
            zt[i][g] = g < Gs ? -zero_of(a, r0 + i, g) * sg : 0.0f;
        }
        memcpy(&s0[i], st[i], sizeof(vf));
        memcpy(&s1[i], st[i] + LANES, sizeof(vf));
        memcpy(&z0[i], zt[i], sizeof(vf));
        memcpy(&z1[i], zt[i] + LANES, sizeof(vf));
        for (int t = 0; t < NT; t++) tot[i][t] = splat(0.0f);
    }
    float tail[2][TOK] = {{0}};
    int64_t c = 0;
    for (; c + LANES <= a->C; c += LANES) {
        vi gi;
        memcpy(&gi, gidx + c, sizeof(gi));
        vf w[2];
        for (int i = 0; i < NR; i++) {
            const vf q = __builtin_convertvector((vi)nibbles16((const int32_t *)rows[i] + (c >> 3)),
                                                 vf);
            w[i] = vfma(q, group_lookup(st[i], gi, Gs, s0[i], s1[i]),
                        group_lookup(zt[i], gi, Gs, z0[i], z1[i]));
            if ((c & 63) == 0) PREFETCH_NEXT_PAIR(1, rows[i], c);
        }
        for (int t = 0; t < NT; t++) {
            vf xv;
            memcpy(&xv, a->x + (t0 + t) * a->C + c, sizeof(xv));
            for (int i = 0; i < NR; i++) tot[i][t] = vfma(w[i], xv, tot[i][t]);
        }
    }
    for (; c < a->C; c++)
        for (int i = 0; i < NR; i++) {
            const float wq = sfma(code1(1, rows[i], c), st[i][gidx[c]], zt[i][gidx[c]]);
            for (int t = 0; t < NT; t++) tail[i][t] = sfma(wq, a->x[(t0 + t) * a->C + c], tail[i][t]);
        }
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++)
            a->y[(t0 + t) * a->R + r0 + i] = lane_sum(tot[i][t]) + tail[i][t];
}

#define RT(KIND, NR, NTC, BF16)                                                              \
    (BF16 == -2 ? rows_tokens_gidx(a, NR, NTC, r0, t0)                                       \
     : BF16 < 0 ? rows_tokens_vscale(a, KIND, NR, NTC, r0, t0)                               \
                : rows_tokens(a, KIND, NR, NTC, BF16 > 0, r0, t0))
#define NT_CASES(KIND, NR, BF16)                                                             \
    switch (nt) {                                                                            \
    case 1: RT(KIND, NR, 1, BF16); break;                                                    \
    case 2: RT(KIND, NR, 2, BF16); break;                                                    \
    case 3: RT(KIND, NR, 3, BF16); break;                                                    \
    default: RT(KIND, NR, 4, BF16); break;                                                   \
    }

#define ROW_BLOCK(NAME, KIND, BF16)                                                              \
    static void NAME(const qgemv_args *a, int nr, int nt, int64_t r0, int64_t t0) {          \
        if (nr == 2) { NT_CASES(KIND, 2, BF16) } else { NT_CASES(KIND, 1, BF16) }           \
    }
/* BF16: 1 the bf16 chain, 0 the f32 chain, -1 the f32 chain scaling every vector, -2 INT4
 * with groups by gidx. */
ROW_BLOCK(block_fp8, 0, 0)
ROW_BLOCK(block_int4, 1, 0)
ROW_BLOCK(block_fp4, 2, 0)
ROW_BLOCK(block_fp8_vscale, 0, -1)
ROW_BLOCK(block_int4_vscale, 1, -1)
ROW_BLOCK(block_fp4_vscale, 2, -1)
ROW_BLOCK(block_int4_gidx, 1, -2)
#if HAVE_BF16_CHAIN
ROW_BLOCK(block_fp8_bf16, 0, 1)
ROW_BLOCK(block_int4_bf16, 1, 1)
ROW_BLOCK(block_fp4_bf16, 2, 1)
#endif

/* Whether calls with bf16 tokens take the bf16 chain in this build. */
int qgemv_bf16_chain(void) { return HAVE_BF16_CHAIN; }

/* Returns 0, -1 for an unknown kind or scale code, -2 when scratch could not be allocated.
 * zeros: INT4's packed zero points, else NULL; global: NULL or [R / gdiv] f32; gidx: NULL (group
 * c / group), or INT4's [R / gidx_div, C] group of each column, every value in [0, Gs); xb:
 * NULL, or x's values as bf16 (then the bf16 chain where the build has it). Shapes as the
 * file's comment says, checked by the wrapper. */
int qgemv(int kind, const void *codes, const void *scales, int scale_code, const float *global,
          int64_t gdiv, const int32_t *zeros, const int32_t *gidx, int64_t gidx_div,
          const float *x, const bf16_t *xb, float *y, int64_t T, int64_t R, int64_t C,
          int64_t Gs, int64_t row_div, int64_t group, int zero_offset) {
    if (kind < 0 || kind > 2 || scale_code < 0 || scale_code > 2 || (gidx && kind != 1))
        return -1;
    float *xsum = calloc((size_t)(T * Gs > 0 ? T * Gs : 1), sizeof(float));
    if (!xsum) return -2;
    if (kind == 1 && !gidx)                /* the zero points' term: sum x over each group */
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < Gs; g++) {
                const int64_t c1 = (g + 1) * group < C ? (g + 1) * group : C;
                for (int64_t c = g * group; c < c1; c++) xsum[t * Gs + g] += x[t * C + c];
            }
    const qgemv_args a = {kind, zero_offset, scale_code, codes, scales, global, x, xsum, xb,
                          zeros, gidx, y, T, R, C, Gs, row_div, group,
                          kind == 0 ? C : kind == 1 ? (C / 8) * 4 : C / 2, gdiv, gidx_div};
    /* A group of one vector scales each vector; the bf16 chain needs groups of whole steps. */
    const int vscale = !gidx && group == LANES && C % LANES == 0;
    const int bf16 = HAVE_BF16_CHAIN && xb != NULL && !gidx && !vscale &&
                     group >= (kind == 0 ? 64 : 32);
    const int64_t pairs = (R + 1) / 2;
    for (int64_t t0 = 0; t0 < T; t0 += TOK) {
        const int nt = T - t0 < TOK ? (int)(T - t0) : TOK;
        #pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const int nr = 2 * p + 1 < R ? 2 : 1;
            if (gidx) {                       /* a pair across two gidx rows goes row by row */
                if (nr == 2 && (2 * p) / gidx_div != (2 * p + 1) / gidx_div) {
                    block_int4_gidx(&a, 1, nt, 2 * p, t0);
                    block_int4_gidx(&a, 1, nt, 2 * p + 1, t0);
                } else {
                    block_int4_gidx(&a, nr, nt, 2 * p, t0);
                }
                continue;
            }
#if HAVE_BF16_CHAIN
            if (bf16) {
                if (kind == 0) block_fp8_bf16(&a, nr, nt, 2 * p, t0);
                else if (kind == 1) block_int4_bf16(&a, nr, nt, 2 * p, t0);
                else block_fp4_bf16(&a, nr, nt, 2 * p, t0);
                continue;
            }
#endif
            if (vscale) {
                if (kind == 0) block_fp8_vscale(&a, nr, nt, 2 * p, t0);
                else if (kind == 1) block_int4_vscale(&a, nr, nt, 2 * p, t0);
                else block_fp4_vscale(&a, nr, nt, 2 * p, t0);
            } else if (kind == 0) block_fp8(&a, nr, nt, 2 * p, t0);
            else if (kind == 1) block_int4(&a, nr, nt, 2 * p, t0);
            else block_fp4(&a, nr, nt, 2 * p, t0);
        }
    }
    (void)bf16;
    free(xsum);
    return 0;
}
