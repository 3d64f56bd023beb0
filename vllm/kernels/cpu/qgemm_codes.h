/* bf16 activations on FP8 e4m3 and INT4 (GPTQ) weights, without rounding w * scale to bf16:
 * the codes' exact values go through the bf16 pair chain (vdpbf16ps) and the scales multiply
 * f32 accumulators, once per scale group. For column c, with groups as runs of input-row pairs
 * (both rows of a pair in one group, groups non-decreasing along the input dim: every FP8
 * scheme with an even block, GPTQ with even groups: act order's rows are sorted by group at
 * pack time, fused_moe/cpu_kernel.py's sort_groups):
 *
 *   part  = gemm.h's bf16 pair chain over the group's rows, from 0, on v(i, c):
 *             FP8:  v = the e4m3 code's value (exact in bf16, subnormals included; 0x7f: 480)
 *             INT4: v = q, the 4-bit value 0..15
 *           (FP8, odd n: the last row is one more fma(a[n-1], v, part) in its group's part)
 *   FP8:  acc = fma(part, scale[g][c], acc)
 *   INT4: acc = fma(fma(-zero[g][c], xsum[g], part), scale[g][c], acc)
 *           xsum[g] = the sum of the token's a[i] over the group's rows: 16-lane f32 vector
 *           adds over the group's 16-row chunks in order (the last one zero-padded), then
 *           vec.h's lane_sum; computed once per token and matrix
 *   y[c] = acc after the last group (acc from 0, groups in input order).
 *
 * Every step depends on the token's row and the weights only, whichever tile, build or call
 * size computes it, so a row's value never depends on the other rows in the call. The result
 * is within f32 rounding of sum_i a[i] * (v - zero) * scale (tests bound it against a torch
 * f32 dequantize-then-matmul), but no longer bitwise the unquantized kernel on
 * round_bf16((v - zero) * scale). f32 activations, and matrices whose groups are not runs of
 * pairs (INT4 groups of odd size or out of order, FP8 blocks an odd number of inputs wide),
 * keep qgemm.h's dequantize-to-f32 chains (codes_grouped decides, per matrix, never per call
 * size).
 *
 * Conversion with AVX512-BF16 (+ VBMI for FP8): FP8, 64 codes -> two bf16 pairs of 16 lanes
 * with two vpermi2b on 128-entry byte tables (high and low bf16 bytes of the magnitude), the
 * sign bit or-ed in, and two vpermt2b interleaving the bytes; INT4, 16 bytes -> one pair by
 * widening each byte to a 32-bit lane, splitting its nibbles into the two 16-bit halves and a
 * 16-entry vpermw table. Elsewhere the same values through f32 (equal bits: the values are
 * exact; vdpbf16ps flushes denormal activations, as gemm.h says). A call of more than TM_MAX
 * tokens converts each 64-column block once into a bf16 buffer that its tiles read (the same
 * values, so the same bits). Layouts, scale and zero tables: qgemm.h's, unchanged.
 */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "qgemm.h"
#include "vec.h"

/* bf16 bits of e4m3 magnitude codes 0 .. 127 (high byte, low byte); 0x7f (NaN) reads as 480,
 * as qgemm.h's fp8_to_f32 reads it. */
static const uint8_t FP8_BF16_HI[128] __attribute__((aligned(64))) = {
    0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c,
    0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d,
    0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e,
    0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43,
};
static const uint8_t FP8_BF16_LO[128] __attribute__((aligned(64))) = {
    0x00, 0x00, 0x80, 0xc0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
};

/* One e4m3 code's value, exact. */
INLINE float fp8_value(uint8_t b) {
    const uint32_t m = b & 0x7fu;
    return bf16_to_f32((bf16_t)((FP8_BF16_HI[m] << 8) | FP8_BF16_LO[m] | ((b & 0x80u) << 8)));
}

/* The code value of row i, block column c (layouts: qgemm.h). */
INLINE float code_value(int int4, const uint8_t *blk, int64_t n, int64_t bw, int64_t i,
                        int64_t c) {
    if (int4) return (float)((blk[(i / 2) * bw + c] >> (4 * (i & 1))) & 15u);
    return fp8_value(i < n - n % 2 ? blk[((i / 2) * bw + c) * 2 + (i & 1)] : blk[(n - 1) * bw + c]);
}

/* The last row (n odd, FP8) of block columns c .. c+15, exact. */
INLINE vf code_last_row(const uint8_t *blk, int64_t n, int64_t bw, int64_t c) {
    vf w;
    for (int l = 0; l < LANES; l++) w[l] = fp8_value(blk[(n - 1) * bw + c + l]);
    return w;
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
/* 64 e4m3 codes b -> their exact bf16 values, codes 0-31 in *w0 and 32-63 in *w1 (lane l of
 * *w0: codes 2l, 2l + 1): the high and low bytes of each magnitude from the two 128-entry
 * tables (index: bits 0-6), the sign or-ed into the high byte, then the bytes interleaved.
 * Also qgemv_decode.h's. */
INLINE void fp8_bf16_64(__m512i b, __m512i *w0, __m512i *w1) {
    const __m512i ia = _mm512_set_epi8(
        95, 31, 94, 30, 93, 29, 92, 28, 91, 27, 90, 26, 89, 25, 88, 24, 87, 23, 86, 22, 85, 21,
        84, 20, 83, 19, 82, 18, 81, 17, 80, 16, 79, 15, 78, 14, 77, 13, 76, 12, 75, 11, 74, 10,
        73, 9, 72, 8, 71, 7, 70, 6, 69, 5, 68, 4, 67, 3, 66, 2, 65, 1, 64, 0);
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(FP8_BF16_LO), b,
                                                _mm512_load_si512(FP8_BF16_LO + 64));
    __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(FP8_BF16_HI), b,
                                          _mm512_load_si512(FP8_BF16_HI + 64));
    hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8((char)0x80), 0xF8);   /* | b & 0x80 */
    *w0 = _mm512_permutex2var_epi8(lo, ia, hi);                  /* bytes lo[j], hi[j] */
    *w1 = _mm512_permutex2var_epi8(lo, _mm512_add_epi8(ia, _mm512_set1_epi8(32)), hi);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The bf16 bits of the INT4 values 0 .. 15, twice (vpermw reads 5 index bits). */
INLINE __m512i int4_bf16_words(void) {
    return _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0,
        0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130,
        0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0);
}

/* 16 bytes of 4-bit codes (low nibble first) -> 16 lanes of bf16 pairs: each byte widened to
 * a 32-bit lane, its nibbles split into the lane's two 16-bit halves, then the word table
 * ``tab`` (the 16 codes' bf16 bits twice). Also qgemv_decode.h's. */
INLINE __m512i nibble_pairs_bf16(const uint8_t *p, __m512i tab) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i r = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12),
                                                _mm512_set1_epi32(0x000f000f), 0xA8);
    return _mm512_permutexvar_epi16(r, tab);
}
#endif

/* Rows 2p, 2p+1 of the CV vectors of block columns from c, as bf16 pairs of the codes'
 * values (wv[v]: columns c + 16v .. c + 16v + 15). */
INLINE void code_pairs(int int4, const uint8_t *blk, int64_t bw, int64_t p, int64_t c, int CV,
                       wpair *wv) {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
    if (!int4) {            /* bytes (p * bw + c) * 2 + 32v + 2l + r: row 2p + r, lane l */
        const uint8_t *src = blk + (p * bw + c) * 2;
        for (int v = 0; v < CV; v += 2) {
            const __m512i b = CV - v >= 2 ? _mm512_loadu_si512(src + 32 * v)
                                          : _mm512_maskz_loadu_epi8(0xffffffffull, src + 32 * v);
            __m512i w0, w1;
            fp8_bf16_64(b, &w0, &w1);
            wv[v] = (wpair)w0;
            if (v + 1 < CV) wv[v + 1] = (wpair)w1;
        }
        return;
    }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (int4) {             /* byte p * bw + c + 16v + l: row 2p low nibble, 2p+1 high */
        const __m512i tab = int4_bf16_words();
        for (int v = 0; v < CV; v++)
            wv[v] = (wpair)nibble_pairs_bf16(blk + p * bw + c + v * LANES, tab);
        return;
    }
#endif
    for (int v = 0; v < CV; v++) {
        vf e = (vf){0}, o = (vf){0};
        for (int l = 0; l < LANES; l++) {
            const int64_t col = c + v * LANES + l;
            e[l] = code_value(int4, blk, 2 * p + 2, bw, 2 * p, col);   /* n: any even > 2p+1 */
            o[l] = code_value(int4, blk, 2 * p + 2, bw, 2 * p + 1, col);
        }
        wv[v] = make_pair(e, o);                 /* exact: the values are bf16 */
    }
}

/* w stored as 16 interleaved bf16 pairs (gemm.h's packed layout), exact. */
INLINE void store_wpair(bf16_t *dst, wpair w) {
#if defined(__AVX512BF16__)
    memcpy(dst, &w, sizeof(w));
#else
    const vh e = f32_to_bf16v(w.even), o = f32_to_bf16v(w.odd);
    for (int l = 0; l < LANES; l++) {
        dst[2 * l] = e[l];
        dst[2 * l + 1] = o[l];
    }
#endif
}

/* The codes' values of block columns 0 .. bw - bw % 16 as bf16 in gemm.h's packed layout
 * (row pairs interleaved, the last row alone when n is odd): converted once per block for a
 * call of more than TM_MAX tokens, then read by every tile (the same values, so the same
 * bits). The columns outside any vector are read from the codes. */
INLINE void codes_fill(int int4, const uint8_t *blk, int64_t n, int64_t bw, bf16_t *buf) {
    const int CV = (int)(bw / LANES);
    for (int64_t p = 0; p < n / 2; p++) {
        wpair wv[CV_MAX];
        code_pairs(int4, blk, bw, p, 0, CV, wv);
        for (int v = 0; v < CV; v++) store_wpair(buf + p * 2 * bw + 2 * v * LANES, wv[v]);
    }
    if (n & 1)
        for (int v = 0; v < CV; v++)
            storev(buf, 1, (n - 1) * bw + v * LANES, code_last_row(blk, n, bw, v * LANES));
}

/* Whether the codes chain applies: groups 0, 1, ... in order (each a run of rows, the next
 * one group up), rows 2p and 2p+1 in one group. Then there are at most n / 2 groups (n > 1). */
INLINE int codes_grouped(const qmat *q, int64_t n) {
    if (n && q->gidx[0] != 0) return 0;
    for (int64_t i = 0; i + 1 < n; i++) {
        const int32_t step = q->gidx[i + 1] - q->gidx[i];
        if (step < 0 || step > 1 || (i % 2 == 0 && step)) return 0;
    }
    return 1;
}

/* xs[m * ng + g] = xsum[g] of token m (header), for m < M and every group of gidx. */
INLINE void group_sums(const bf16_t *a, int64_t M, int64_t n, const int32_t *gidx, int64_t ng,
                       float *xs) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < ng; g++) xs[m * ng + g] = 0.0f;
        for (int64_t i0 = 0; i0 < n;) {
            int64_t i1 = i0;
            while (i1 < n && gidx[i1] == gidx[i0]) i1++;
            vf s = (vf){0};
            for (int64_t i = i0; i < i1; i += LANES) {
                bf16_t t[LANES] = {0};
                memcpy(t, a + m * n + i, (size_t)(i1 - i < LANES ? i1 - i : LANES) * 2);
                vh h;
                memcpy(&h, t, sizeof(h));
                s += bf16v_to_f32(h);
            }
            xs[m * ng + gidx[i0]] = lane_sum(s);
            i0 = i1;
        }
    }
}

/* acc[m][v] += the flushed part of group g (header), part[m][v] = 0. xs: the tile's first
 * token's group sums. */
INLINE void codes_flush(const qmat *q, int TM, int CV, int64_t g, int64_t col, const float *xs,
                        int64_t ng, vf acc[TM_MAX][CV_MAX], vf part[TM_MAX][CV_MAX]) {
    for (int v = 0; v < CV; v++) {
        vf s, z = (vf){0};
        memcpy(&s, q->scale + g * q->lds + col + v * LANES, sizeof(s));
        if (q->int4) memcpy(&z, q->zero + g * q->lds + col + v * LANES, sizeof(z));
        for (int m = 0; m < TM; m++) {
            const vf t = q->int4 ? vfma(-z, splat(xs[m * ng + g]), part[m][v]) : part[m][v];
            acc[m][v] = vfma(t, s, acc[m][v]);
            part[m][v] = (vf){0};
        }
    }
}

/* TM tokens x CV vectors of block columns from c (global column col0 + c): the chain in the
 * header, converting the codes as it goes, or reading their values from buf (codes_fill). */
INLINE void codes_tile(const bf16_t *a, int TM, const qmat *q, int int4, const uint8_t *blk,
                       const bf16_t *buf, int64_t col0, int CV, int64_t n, int64_t bw, int64_t c,
                       const float *xs, int64_t ng, float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX], part[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = part[m][v] = (vf){0};
    int64_t g = n ? q->gidx[0] : 0;
    for (int64_t p = 0; p < n / 2; p++) {
        if (q->gidx[2 * p] != g) {
            codes_flush(q, TM, CV, g, col0 + c, xs, ng, acc, part);
            g = q->gidx[2 * p];
        }
        wpair wv[CV_MAX];
        if (buf) {
            for (int v = 0; v < CV; v++) wv[v] = load_pair(buf + p * 2 * bw + 2 * (c + v * LANES));
        } else {
            /* cold codes stream from DRAM: ask for rows PREFETCH pairs ahead */
            __builtin_prefetch(blk + (int4 ? (p + PREFETCH) * bw + c
                                           : (p + PREFETCH) * 2 * bw + 2 * c));
            code_pairs(int4, blk, bw, p, c, CV, wv);
        }
        for (int m = 0; m < TM; m++) {
            uint32_t ap;
            memcpy(&ap, a + m * n + 2 * p, sizeof(ap));
            for (int v = 0; v < CV; v++) part[m][v] = dot_pair(part[m][v], ap, wv[v]);
        }
    }
    if (n & 1) {    /* fp8 only (int4 needs n even): the last row, unpaired */
        if (q->gidx[n - 1] != g) {
            codes_flush(q, TM, CV, g, col0 + c, xs, ng, acc, part);
            g = q->gidx[n - 1];
        }
        for (int v = 0; v < CV; v++) {
            const vf w = buf ? loadv(buf, 1, (n - 1) * bw + c + v * LANES)
                             : code_last_row(blk, n, bw, c + v * LANES);
            for (int m = 0; m < TM; m++)
                part[m][v] = vfma(splat(bf16_to_f32(a[m * n + n - 1])), w, part[m][v]);
        }
    }
    if (n) codes_flush(q, TM, CV, g, col0 + c, xs, ng, acc, part);
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

/* Block column c alone (a ragged block's columns outside any vector): the same chain, scalar
 * (sfma in dot_pair's order: the odd row's product first). */
INLINE void codes_column_tail(const bf16_t *a, int64_t M, const qmat *q, const uint8_t *blk,
                              int64_t col0, int64_t n, int64_t bw, int64_t c, const float *xs,
                              int64_t ng, float *y, int64_t ldy) {
    const int64_t col = col0 + c;
    for (int64_t m = 0; m < M; m++) {
        const bf16_t *am = a + m * n;
        float acc = 0.0f, part = 0.0f;
        int64_t g = n ? q->gidx[0] : 0;
        for (int64_t i = 0; i < n; i += 2) {
            const int64_t gi = q->gidx[i];
            if (gi != g) {
                const float z = q->int4 ? q->zero[g * q->lds + col] : 0.0f;
                const float t = q->int4 ? sfma(-z, xs[m * ng + g], part) : part;
                acc = sfma(t, q->scale[g * q->lds + col], acc);
                part = 0.0f;
                g = gi;
            }
            if (i + 1 < n)
                part = sfma(bf16_to_f32(am[i + 1]), code_value(q->int4, blk, n, bw, i + 1, c), part);
            part = sfma(bf16_to_f32(am[i]), code_value(q->int4, blk, n, bw, i, c), part);
        }
        if (n) {
            const float z = q->int4 ? q->zero[g * q->lds + col] : 0.0f;
            const float t = q->int4 ? sfma(-z, xs[m * ng + g], part) : part;
            acc = sfma(t, q->scale[g * q->lds + col], acc);
        }
        y[m * ldy] = acc;
    }
}

/* CV * LANES columns (from block column c) for every token, in tiles of up to TM_MAX tokens;
 * int4 a constant in each call, so each format gets its own loop. */
INLINE void codes_columns(const bf16_t *a, int64_t M, const qmat *q, int int4,
                          const uint8_t *blk, const bf16_t *buf, int64_t col0, int CV, int64_t n,
                          int64_t bw, int64_t c, const float *xs, int64_t ng, float *y,
                          int64_t ldy) {
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX)
        codes_tile(a + m * n, TM_MAX, q, int4, blk, buf, col0, CV, n, bw, c, xs + m * ng, ng,
                   y + m * ldy, ldy);
    const bf16_t *am = a + m * n;
    const float *xm = xs + m * ng;
    float *ym = y + m * ldy;
    switch (M - m) {
    case 3: codes_tile(am, 3, q, int4, blk, buf, col0, CV, n, bw, c, xm, ng, ym, ldy); break;
    case 2: codes_tile(am, 2, q, int4, blk, buf, col0, CV, n, bw, c, xm, ng, ym, ldy); break;
    case 1: codes_tile(am, 1, q, int4, blk, buf, col0, CV, n, bw, c, xm, ng, ym, ldy); break;
    default: break;
    }
}

/* y [M, cols] (row stride ldy) = a [M, n] (bf16) @ the quantized matrix q ([cols, n]), block
 * by block: the chain in the header (codes_grouped). buf: BLOCK * n bf16 for codes_fill when
 * M > TM_MAX; xs: M * ng floats (INT4's group sums; ng = the last row's group + 1). */
INLINE void codes_matmul(const bf16_t *a, int64_t M, const qmat *q, int64_t n, int64_t cols,
                         float *y, int64_t ldy, bf16_t *buf, float *xs) {
    const int64_t ng = n ? q->gidx[n - 1] + 1 : 1;
    if (q->int4) group_sums(a, M, n, q->gidx, ng, xs);
    for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) {
        const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;
        const uint8_t *blk = q->w + (q->int4 ? c0 * n / 2 : c0 * n);
        const bf16_t *b = M > TM_MAX ? buf : NULL;
        if (b) codes_fill(q->int4, blk, n, bw, buf);
        if (bw == BLOCK) {
            if (q->int4)
                codes_columns(a, M, q, 1, blk, b, c0, CV_MAX, n, bw, 0, xs, ng, y + c0, ldy);
            else
                codes_columns(a, M, q, 0, blk, b, c0, CV_MAX, n, bw, 0, xs, ng, y + c0, ldy);
            continue;
        }
        int64_t v = 0;
        for (; v + LANES <= bw; v += LANES)
            codes_columns(a, M, q, q->int4, blk, b, c0, 1, n, bw, v, xs, ng, y + c0 + v, ldy);
        for (; v < bw; v++)
            codes_column_tail(a, M, q, blk, c0, n, bw, v, xs, ng, y + c0 + v, ldy);
    }
}

/* qmatmul for bf16 activations: codes_matmul where the matrix allows it, else qmatmul's
 * dequantize-to-f32 chains. wbuf (BLOCK * n floats, as qmatmul wants) holds codes_matmul's
 * buf (BLOCK * n / 2 floats) and then its group sums (M * n / 2 floats at most: room for
 * M <= BLOCK; the expert kernel's M <= CHUNK = 32). */
INLINE void qmatmul_bf16_act(const void *a, int64_t M, const qmat *q, int64_t n, int64_t cols,
                             float *y, int64_t ldy, void *wbuf) {
    if (wbuf && codes_grouped(q, n))
        codes_matmul(a, M, q, n, cols, y, ldy, wbuf, (float *)wbuf + BLOCK * n / 2);
    else
        qmatmul(a, M, q, 1, n, cols, y, ldy, wbuf);
}
