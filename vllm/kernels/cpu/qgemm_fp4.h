/* FP4 weights for the expert kernel: NVFP4 and MXFP4 (e2m1 codes, one scale byte per gs
 * consecutive inputs, one f32 global scale per matrix). This file holds the packed layout, its
 * decoding and the chain for f32 activations: the codes are dequantized in registers, 16 output
 * columns by 2 input rows at a time, right before the FMAs, and run gemm.h's f32 chain:
 *
 *   S[g][c]  = scale(byte[g][c]) * global             (f32, one rounding; exact for e8m0)
 *   w[i][c]  = e2m1(code(i, c)) * S[i / gs][c]         (f32, one rounding)
 *   acc = fma(a[i], w[i][c], acc) for i = 0 .. n-1
 *
 * scale(): e4m3 (NVFP4, gs 16, global = weight_scale_2) or e8m0 2^(b - 127) (MXFP4, gs 32,
 * global 1). That is nvfp4.py's / mxfp4.py's dequantize, vals * (scale * global), so each output
 * equals the unquantized f32 kernel's on the dequantized weights, bit for bit, and a row's value
 * never depends on the other rows in the call. bf16 activations run qgemm_codes_fp4.h's chain
 * (the codes' exact values through vdpbf16ps, the scales applied per group in f32).
 *
 * Packed layout of one matrix [cols, n] (out, in), made by ops.py's pack_fp4_codes; cols % 16
 * == 0, n % gs == 0, gs even (so rows 2p, 2p+1 share a group):
 *   codes: gemm.h's column blocks (width bw, a multiple of 16; block c0 starts at byte
 *          c0 * n / 2), n / 2 * bw bytes each; pair of rows p is the bw bytes from p * bw, in
 *          units of U 16-column vectors (U = CV_MAX when bw == BLOCK, else 1; the unit of
 *          block column c starts at byte p * bw + c rounded down to 16U): slot L = 32v + 2l + r
 *          of the unit (vector v, lane l, row 2p + r) is nibble L / 8U of its 16-bit word
 *          L % 8U. In a full block word s holds slot s of each of the 4 vectors, nibble v; in
 *          a lone vector lane group k (lanes 4k .. 4k+3) sits in nibble k of words 0 .. 7.
 *   scales: bytes [n / gs, lds], group g of column col at g * lds + col.
 * Refused at packing: non-finite scales (the e4m3 NaN code would read as 480) and, for a group
 * holding a nonzero code, |S| below 2^-125 (kept from the chain that rounded w to bf16).
 */
#pragma once
#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "qgemm.h"
#include "vec.h"

typedef int8_t vsb16 __attribute__((vector_size(16), aligned(1)));

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

/* 16 bytes widened to 32-bit lanes, sign-extended or not (GCC 12 scalarizes a
 * __builtin_convertvector of an unaligned byte vector: one instruction here). */
INLINE vu widen_bytes(const uint8_t *p, int sign) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (vu)(sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
    vb16 b;
    memcpy(&b, p, sizeof(b));
    return sign ? (vu)__builtin_convertvector((vsb16)b, vi) : __builtin_convertvector(b, vu);
#endif
}

/* The scale of group g, columns col .. col+15, without the global scale (f32, exact): the e4m3
 * value, or 2^(b - 127) (e8m0 0 is 2^-127, an f32 subnormal). */
INLINE vf fp4_group_scale(const fp4mat *q, int64_t g, int64_t col) {
    const uint8_t *b = q->scale + g * q->lds + col;
    vu bits;
    if (q->e8m0) {
        const vu u = widen_bytes(b, 0);
        bits = (u << 23) | ((vu)(u == 0u) & 0x00400000u);
    } else {
        /* fp8_to_f32's bits: the byte sign-extended and shifted by 20 has exponent and
         * mantissa at bits 20-26 and the sign at bits 27-31; keep bits 31 and 0-26 */
        bits = (widen_bytes(b, 1) << 20) & 0x87ffffffu;
    }
    vf s;
    memcpy(&s, &bits, sizeof(s));
    return q->e8m0 ? s : s * 0x1p120f;
}

/* S of group g, columns col .. col+15 (header). */
INLINE vf fp4_scale(const fp4mat *q, int64_t g, int64_t col) {
    return fp4_group_scale(q, g, col) * q->global;
}

/* Codes of rows 2p (*even) and 2p+1 (*odd) of block columns c .. c+15, one per lane in bits
 * 0-3 (higher bits: other codes). A 32-bit lane is two words, rows 2p and 2p+1 of one slot
 * pair: in a full block lane l of the 64-byte pair row, nibble c / 16; in a lone vector lane
 * l % 4 of its 16 bytes, nibble l / 4. */
INLINE void fp4_codes(const uint8_t *blk, int64_t bw, int64_t p, int64_t c, vu *even, vu *odd) {
    vu d, sh;
    if (bw == BLOCK) {
        memcpy(&d, blk + p * bw, sizeof(d));
        sh = (vu){0} + (uint32_t)(4 * (c / LANES));
    } else {
#if defined(__AVX512F__)
        d = (vu)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + p * bw + c)));
#else
        uint32_t w[4];
        memcpy(w, blk + p * bw + c, sizeof(w));
        d = (vu){w[0], w[1], w[2], w[3], w[0], w[1], w[2], w[3],
                 w[0], w[1], w[2], w[3], w[0], w[1], w[2], w[3]};
#endif
        sh = (vu){0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12};
    }
    *even = d >> sh;
    *odd = d >> (sh + 16u);
}

/* Rows 2p (*even) and 2p+1 (*odd) of block columns c .. c+15 in f32; s: their S. */
INLINE void fp4_pair(const uint8_t *blk, int64_t bw, int64_t p, int64_t c, vf s, vf *even,
                     vf *odd) {
    vu e, o;
    fp4_codes(blk, bw, p, c, &e, &o);
    *even = e2m1_to_f32(e) * s;
    *odd = e2m1_to_f32(o) * s;
}

/* tile_f32 over an FP4 block: TM tokens x CV vectors from block column c. */
INLINE void fp4_tile(const float *a, int TM, const fp4mat *q, const uint8_t *blk, int64_t col0,
                     int CV, int64_t n, int64_t bw, int64_t c, float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = (vf){0};
    const int64_t gp = q->gs / 2;
    for (int64_t g = 0; g < n / q->gs; g++) {
        vf s[CV_MAX];
        for (int v = 0; v < CV; v++) s[v] = fp4_scale(q, g, col0 + c + v * LANES);
        for (int64_t p = g * gp; p < (g + 1) * gp; p++) {
            __builtin_prefetch(blk + (p + PREFETCH) * bw + c);   /* cold codes stream from DRAM */
            vf we[CV_MAX], wo[CV_MAX];
            for (int v = 0; v < CV; v++) fp4_pair(blk, bw, p, c + v * LANES, s[v], &we[v], &wo[v]);
            for (int m = 0; m < TM; m++) {
                const vf ae = splat(a[m * n + 2 * p]), ao = splat(a[m * n + 2 * p + 1]);
                for (int v = 0; v < CV; v++)
                    acc[m][v] = vfma(ao, wo[v], vfma(ae, we[v], acc[m][v]));
            }
        }
    }
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

/* CV * LANES columns (from block column c) for every token, in tiles of up to TM_MAX tokens. */
INLINE void fp4_columns(const float *a, int64_t M, const fp4mat *q, const uint8_t *blk,
                        int64_t col0, int CV, int64_t n, int64_t bw, int64_t c, float *y,
                        int64_t ldy) {
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX)
        fp4_tile(a + m * n, TM_MAX, q, blk, col0, CV, n, bw, c, y + m * ldy, ldy);
    const float *am = a + m * n;
    switch (M - m) {
    case 3: fp4_tile(am, 3, q, blk, col0, CV, n, bw, c, y + m * ldy, ldy); break;
    case 2: fp4_tile(am, 2, q, blk, col0, CV, n, bw, c, y + m * ldy, ldy); break;
    case 1: fp4_tile(am, 1, q, blk, col0, CV, n, bw, c, y + m * ldy, ldy); break;
    default: break;
    }
}

/* The block at col0 (width bw) dequantized into buf in gemm.h's f32 layout ([n, bw]): the
 * same weights as the register tiles, so the same bits. */
INLINE void fp4_dequant_block(const fp4mat *q, const uint8_t *blk, int64_t col0, int64_t n,
                              int64_t bw, float *buf) {
    const int64_t gp = q->gs / 2;
    for (int64_t g = 0; g < n / q->gs; g++)
        for (int64_t c = 0; c < bw; c += LANES) {
            const vf s = fp4_scale(q, g, col0 + c);
            for (int64_t p = g * gp; p < (g + 1) * gp; p++) {
                vf e, o;
                fp4_pair(blk, bw, p, c, s, &e, &o);
                memcpy(buf + 2 * p * bw + c, &e, sizeof(e));
                memcpy(buf + (2 * p + 1) * bw + c, &o, sizeof(o));
            }
        }
}

/* y [M, cols] (row stride ldy) = a [M, n] (f32) @ the FP4 matrix q ([cols, n]), block by
 * block, as qmatmul: with more than TM_MAX rows and a scratch wbuf (BLOCK * n f32) each block
 * is dequantized once into wbuf and gemm.h's tiles run on it; else the register tiles
 * dequantize as they go. Either way the same bits. */
INLINE void fp4_matmul(const float *a, int64_t M, const fp4mat *q, int64_t n, int64_t cols,
                       float *y, int64_t ldy, void *wbuf) {
    for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) {
        const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;     /* a multiple of LANES */
        const uint8_t *blk = q->w + c0 * n / 2;
        if (M > TM_MAX && wbuf) {
            fp4_dequant_block(q, blk, c0, n, bw, wbuf);
            matmul_block(a, M, wbuf, 0, n, bw, 0, y + c0, ldy);
        } else if (bw == BLOCK) {
            fp4_columns(a, M, q, blk, c0, CV_MAX, n, bw, 0, y + c0, ldy);
        } else {
            for (int64_t v = 0; v < bw; v += LANES)
                fp4_columns(a, M, q, blk, c0, 1, n, bw, v, y + c0 + v, ldy);
        }
    }
}
