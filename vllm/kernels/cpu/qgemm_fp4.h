/* Weight-only FP4 GEMM tiles for the expert kernel: NVFP4 and MXFP4 weights (e2m1 codes, one
 * scale byte per gs consecutive inputs, one f32 global scale per matrix) are dequantized in
 * registers, 16 output columns by 2 input rows at a time, right before the FMAs, and then run
 * the very chains gemm.h states for the activation dtype:
 *
 *   S[g][c]  = scale(byte[g][c]) * global             (f32, one rounding; exact for e8m0)
 *   w[i][c]  = e2m1(code(i, c)) * S[i / gs][c]         (f32, one rounding)
 *   f32:  acc = fma(a[i], w[i][c], acc) for i = 0 .. n-1
 *   bf16: w rounded to bf16 (nearest even), then gemm.h's pair chain
 *
 * scale(): e4m3 (NVFP4, gs 16, global = weight_scale_2) or e8m0 2^(b - 127) (MXFP4, gs 32,
 * global 1). That is nvfp4.py's / mxfp4.py's dequantize, vals * (scale * global), rounded to
 * the activation dtype, so each output equals the unquantized kernel's on the dequantized
 * weights, bit for bit, and a row's value never depends on the other rows in the call.
 *
 * Packed layout of one matrix [cols, n] (out, in), made by fused_moe/cpu_kernel.py's
 * pack_fp4_codes; cols % 16 == 0, n % gs == 0, gs even (so rows 2p, 2p+1 share a group):
 *   codes: gemm.h's column blocks (width bw, a multiple of 16; block c0 starts at byte
 *          c0 * n / 2), n / 2 * bw bytes each: pair p of the 16 columns c .. c+15 is the 16
 *          bytes from p * bw + c, byte k = 2j + r holding row 2p + r of column c + j in its
 *          low nibble and of column c + 8 + j in its high one (j < 8, r < 2), so the low (high)
 *          nibbles read in byte order are the bf16 pair lanes of columns c .. c+7 (c+8 .. c+15);
 *   scales: bytes [n / gs, lds], group g of column col at g * lds + col.
 * Scales with |e2m1 * S| below 2^-126 for a nonzero code, and non-finite ones, are refused at
 * packing (vcvtne2ps2bf16 flushes f32 subnormals; the e4m3 NaN code would read as 480).
 */
#pragma once
#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "qgemm.h"
#include "vec.h"

typedef struct {
    const uint8_t *w;       /* packed codes (layout above) */
    const uint8_t *scale;   /* [n / gs, lds] e4m3 or e8m0 bytes */
    float global;
    int64_t lds;
    int gs;                 /* inputs per scale byte */
    int e8m0;
} fp4mat;

/* e2m1 codes (bits 0-3 of each lane; higher bits ignored) -> f32, exact; code 8 is -0. */
INLINE vf e2m1_to_f32(vu code) {
#if defined(__AVX512F__)
    const __m512 t = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                    -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    return (vf)_mm512_permutexvar_ps((__m512i)code, t);
#else
    /* magnitude m >= 2: exponent m >> 1, mantissa m & 1 placed as f32 bits; m < 2: m / 2 */
    const vu m = code & 7u, big = (m << 22) + (126u << 23);
    vf v = vselect((vi)(m < 2u), __builtin_convertvector((vi)m, vf) * 0.5f, (vf)big);
    const vu s = (vu)v | ((code & 8u) << 28);
    memcpy(&v, &s, sizeof(v));
    return v;
#endif
}

/* S of group g, columns col .. col+15 (f32). e8m0 0 is 2^-127 (an f32 subnormal). */
INLINE vf fp4_scale(const fp4mat *q, int64_t g, int64_t col) {
    vb16 b;
    memcpy(&b, q->scale + g * q->lds + col, sizeof(b));
    const vu u = __builtin_convertvector(b, vu);
    vf s;
    if (q->e8m0) {
        const vu bits = (u << 23) | ((vu)(u == 0u) & 0x00400000u);
        memcpy(&s, &bits, sizeof(s));
    } else {
        s = fp8_to_f32(u);
    }
    return s * q->global;
}

/* Rows 2p (*even) and 2p+1 (*odd) of block columns c .. c+15 in f32; s: their scale. */
INLINE void fp4_pair(const uint8_t *blk, int64_t bw, int64_t p, int64_t c, vf s, vf *even,
                     vf *odd) {
    vb16 b;
    memcpy(&b, blk + p * bw + c, sizeof(b));
    const vu u = __builtin_convertvector(b, vu);
    const vf lo = e2m1_to_f32(u & 15u), hi = e2m1_to_f32(u >> 4);   /* lane 2j + r (above) */
    *even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                    28, 30) * s;
    *odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31) * s;
}

#if defined(__AVX512BF16__)
/* The bf16 path with AVX512-BF16: the layout's nibbles are already the pair lanes, so a pair
 * of rows is 7 instructions per 32 weights (widen, shift, two table permutes, two scale
 * products, one rounding to bf16 pairs). lo/hi: S of columns 0-7 / 8-15, each twice. */
typedef struct { __m512 lo, hi; } fp4scale;

INLINE fp4scale fp4_scale_pairs(vf s) {
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    return (fp4scale){_mm512_permutexvar_ps(lo, (__m512)s), _mm512_permutexvar_ps(hi, (__m512)s)};
}

INLINE wpair fp4_pair_bf16(const uint8_t *blk, int64_t bw, int64_t p, int64_t c,
                           const fp4scale *s) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + p * bw + c)));
    const __m512 lo = _mm512_mul_ps((__m512)e2m1_to_f32((vu)b), s->lo);
    const __m512 hi = _mm512_mul_ps((__m512)e2m1_to_f32((vu)_mm512_srli_epi32(b, 4)), s->hi);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* fp4_tile's pairs of group g for bf16 activations: acc[m][v] over rows g*gs .. (g+1)*gs-1. */
INLINE void fp4_group_bf16(const bf16_t *a, int TM, const fp4mat *q, const uint8_t *blk,
                           int64_t col0, int CV, int64_t n, int64_t bw, int64_t c, int64_t g,
                           vf acc[TM_MAX][CV_MAX]) {
    fp4scale s[CV_MAX];
    for (int v = 0; v < CV; v++) s[v] = fp4_scale_pairs(fp4_scale(q, g, col0 + c + v * LANES));
    const int64_t gp = q->gs / 2;
    for (int64_t p = g * gp; p < (g + 1) * gp; p++) {
        __builtin_prefetch(blk + (p + PREFETCH) * bw + c);   /* cold codes stream from DRAM */
        wpair wv[CV_MAX];
        for (int v = 0; v < CV; v++) wv[v] = fp4_pair_bf16(blk, bw, p, c + v * LANES, &s[v]);
        for (int m = 0; m < TM; m++) {
            uint32_t ap;
            memcpy(&ap, a + m * n + 2 * p, sizeof(ap));
            for (int v = 0; v < CV; v++) acc[m][v] = dot_pair(acc[m][v], ap, wv[v]);
        }
    }
}
#endif

/* tile_f32 / tile_bf16 over an FP4 block: TM tokens x CV vectors from block column c. */
INLINE void fp4_tile(const void *a, int TM, const fp4mat *q, const uint8_t *blk, int64_t col0,
                     int bf16, int CV, int64_t n, int64_t bw, int64_t c, float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = (vf){0};
    const int64_t gp = q->gs / 2;
    for (int64_t g = 0; g < n / q->gs; g++) {
#if defined(__AVX512BF16__)
        if (bf16) {
            fp4_group_bf16(a, TM, q, blk, col0, CV, n, bw, c, g, acc);
            continue;
        }
#endif
        vf s[CV_MAX];
        for (int v = 0; v < CV; v++) s[v] = fp4_scale(q, g, col0 + c + v * LANES);
        for (int64_t p = g * gp; p < (g + 1) * gp; p++) {
            __builtin_prefetch(blk + (p + PREFETCH) * bw + c);
            vf we[CV_MAX], wo[CV_MAX];
            for (int v = 0; v < CV; v++) fp4_pair(blk, bw, p, c + v * LANES, s[v], &we[v], &wo[v]);
            if (!bf16) {
                const float *af = a;
                for (int m = 0; m < TM; m++) {
                    const vf ae = splat(af[m * n + 2 * p]), ao = splat(af[m * n + 2 * p + 1]);
                    for (int v = 0; v < CV; v++)
                        acc[m][v] = vfma(ao, wo[v], vfma(ae, we[v], acc[m][v]));
                }
                continue;
            }
            wpair wv[CV_MAX];
            for (int v = 0; v < CV; v++) wv[v] = make_pair(we[v], wo[v]);
            for (int m = 0; m < TM; m++) {
                uint32_t ap;
                memcpy(&ap, (const bf16_t *)a + m * n + 2 * p, sizeof(ap));
                for (int v = 0; v < CV; v++) acc[m][v] = dot_pair(acc[m][v], ap, wv[v]);
            }
        }
    }
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

/* CV * LANES columns (from block column c) for every token, in tiles of up to TM_MAX tokens. */
INLINE void fp4_columns(const void *a, int64_t M, const fp4mat *q, const uint8_t *blk,
                        int64_t col0, int bf16, int CV, int64_t n, int64_t bw, int64_t c,
                        float *y, int64_t ldy) {
    const size_t asz = bf16 ? 2 : 4;
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX)
        fp4_tile((const char *)a + m * n * asz, TM_MAX, q, blk, col0, bf16, CV, n, bw, c,
                 y + m * ldy, ldy);
    const void *am = (const char *)a + m * n * asz;
    switch (M - m) {
    case 3: fp4_tile(am, 3, q, blk, col0, bf16, CV, n, bw, c, y + m * ldy, ldy); break;
    case 2: fp4_tile(am, 2, q, blk, col0, bf16, CV, n, bw, c, y + m * ldy, ldy); break;
    case 1: fp4_tile(am, 1, q, blk, col0, bf16, CV, n, bw, c, y + m * ldy, ldy); break;
    default: break;
    }
}

/* Rows 2p, 2p+1 of block columns c .. c+15 (scale s) into buf, gemm.h's packed layout. */
INLINE void fp4_store_pair(const uint8_t *blk, int bf16, int64_t bw, int64_t p, int64_t c, vf s,
                           void *buf) {
    vf e, o;
    fp4_pair(blk, bw, p, c, s, &e, &o);
    if (!bf16) {
        memcpy((float *)buf + 2 * p * bw + c, &e, sizeof(e));
        memcpy((float *)buf + (2 * p + 1) * bw + c, &o, sizeof(o));
        return;
    }
    const vh he = f32_to_bf16v(e), ho = f32_to_bf16v(o);
    bf16_t *d = (bf16_t *)buf + p * 2 * bw + 2 * c;
    for (int l = 0; l < LANES; l++) {
        d[2 * l] = he[l];
        d[2 * l + 1] = ho[l];
    }
}

/* The block at col0 (width bw) dequantized into buf in gemm.h's packed layout for the
 * activation dtype (the same weights as the register tiles, so the same bits). */
INLINE void fp4_dequant_block(const fp4mat *q, const uint8_t *blk, int64_t col0, int bf16,
                              int64_t n, int64_t bw, void *buf) {
    const int64_t gp = q->gs / 2;
    for (int64_t g = 0; g < n / q->gs; g++)
        for (int64_t c = 0; c < bw; c += LANES) {
            const vf s = fp4_scale(q, g, col0 + c);
#if defined(__AVX512BF16__)
            if (bf16) {
                const fp4scale sp = fp4_scale_pairs(s);
                for (int64_t p = g * gp; p < (g + 1) * gp; p++) {
                    const wpair w = fp4_pair_bf16(blk, bw, p, c, &sp);
                    memcpy((bf16_t *)buf + p * 2 * bw + 2 * c, &w, sizeof(w));
                }
                continue;
            }
#endif
            for (int64_t p = g * gp; p < (g + 1) * gp; p++)
                fp4_store_pair(blk, bf16, bw, p, c, s, buf);
        }
}

/* y [M, cols] (row stride ldy) = a [M, n] @ the FP4 matrix q ([cols, n]), block by block, as
 * qmatmul: with more than TM_MAX rows and a scratch wbuf (BLOCK * n f32) each block is
 * dequantized once into wbuf and gemm.h's tiles run on it; else the register tiles dequantize
 * as they go. Either way the same bits. */
INLINE void fp4_matmul(const void *a, int64_t M, const fp4mat *q, int bf16, int64_t n,
                       int64_t cols, float *y, int64_t ldy, void *wbuf) {
    for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) {
        const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;     /* a multiple of LANES */
        const uint8_t *blk = q->w + c0 * n / 2;
        if (M > TM_MAX && wbuf) {
            fp4_dequant_block(q, blk, c0, bf16, n, bw, wbuf);
            matmul_block(a, M, wbuf, bf16, n, bw, 0, y + c0, ldy);
        } else if (bw == BLOCK) {
            fp4_columns(a, M, q, blk, c0, bf16, CV_MAX, n, bw, 0, y + c0, ldy);
        } else {
            for (int64_t v = 0; v < bw; v += LANES)
                fp4_columns(a, M, q, blk, c0, bf16, 1, n, bw, v, y + c0 + v, ldy);
        }
    }
}
