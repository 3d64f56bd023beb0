/* bf16 activations on FP4 weights (NVFP4, MXFP4; layout: qgemm_fp4.h), as qgemm_codes.h does
 * for FP8 and INT4: the e2m1 values (0, +-0.5, 1, 1.5, 2, 3, 4, 6: exact in bf16) go through the
 * bf16 pair chain and the scales multiply f32 accumulators, once per scale group. For column c:
 *
 *   part = gemm.h's bf16 pair chain over group g's gs / 2 row pairs, from 0, on e2m1(code)
 *   acc  = fma(part, s[g][c], acc)      s: the e4m3 value (NVFP4) or 2^(b - 127) (MXFP4), f32,
 *                                         exact (fp4_group_scale)
 *   y[c] = acc * global                 after the last group (acc from 0, groups in order)
 *
 * MXFP4's s is a power of two and its global 1, so part * s and the final product are exact:
 * each group adds its partial sum scaled exactly, with one rounding. NVFP4 applies the global
 * scale once per output instead of once per weight. The result is within f32 rounding of
 * sum_i a[i] * e2m1 * s * global (tests bound it against a torch f32 dequantize-then-matmul),
 * no longer bitwise the unquantized kernel on round_bf16(e2m1 * S).
 *
 * Every step depends on the token's row and the weights only, whichever tile, build or call
 * size computes it, so a row's value never depends on the other rows in the call.
 *
 * Conversion with AVX512-BF16: a full block's 64-byte pair row holds slot s of its 4 vectors in
 * nibble v of word s, so vector v is one shift (vpsrlw by 4v; none for v = 0) and one vpermw on
 * a 32-entry word table (the 16 codes' bf16 bits twice: vpermw reads index bits 0-4, and bit 4
 * is the next nibble's): 1.75 instructions per 32 weights beside the one load per 128; each
 * scale group adds 4 (e4m3) or 5 (e8m0) per 16 columns to widen its scale bytes, and one FMA
 * per token. A lone vector (narrower last block) is a 16-byte broadcast, one vpsrlvw (nibble k
 * to lanes 4k .. 4k+3) and one vpermw.
 * Elsewhere the same values through f32 (equal bits: the values are exact; vdpbf16ps flushes
 * denormal activations, as gemm.h says). A call of more than TM_MAX tokens converts each block
 * once into a bf16 buffer that its tiles read (the same values, so the same bits).
 */
#pragma once
#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "qgemm_codes.h"
#include "qgemm_fp4.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The bf16 bits of the 16 e2m1 codes (sign in bit 3), twice (vpermw reads 5 index bits). */
INLINE __m512i e2m1_bf16_words(void) {
    return _mm512_set_epi16(
        (short)0xC0C0, (short)0xC080, (short)0xC040, (short)0xC000, (short)0xBFC0, (short)0xBF80,
        (short)0xBF00, (short)0x8000, 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0,
        (short)0xC0C0, (short)0xC080, (short)0xC040, (short)0xC000, (short)0xBFC0, (short)0xBF80,
        (short)0xBF00, (short)0x8000, 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0);
}
#endif

/* Rows 2p, 2p+1 of the CV vectors of block columns from c as bf16 pairs of the codes' values
 * (wv[v]: columns c + 16v .. c + 16v + 15); CV == CV_MAX only for a full block (c = 0). */
INLINE void fp4_code_pairs(const uint8_t *blk, int64_t bw, int64_t p, int64_t c, int CV,
                           wpair *wv) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const __m512i tab = e2m1_bf16_words();
    if (bw == BLOCK) {
        const __m512i w = _mm512_loadu_si512(blk + p * bw);
        for (int v = 0; v < CV; v++)
            wv[v] = (wpair)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4 * (c / LANES + v)),
                                                    tab);
        return;
    }
    const __m512i sh = _mm512_set_epi16(12, 12, 12, 12, 12, 12, 12, 12, 8, 8, 8, 8, 8, 8, 8, 8,
                                        4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int v = 0; v < CV; v++) {
        const __m512i w = _mm512_broadcast_i32x4(
            _mm_loadu_si128((const __m128i *)(blk + p * bw + c + v * LANES)));
        wv[v] = (wpair)_mm512_permutexvar_epi16(_mm512_srlv_epi16(w, sh), tab);
    }
#else
    for (int v = 0; v < CV; v++) {
        vu e, o;
        fp4_codes(blk, bw, p, c + v * LANES, &e, &o);
        wv[v] = make_pair(e2m1_to_f32(e), e2m1_to_f32(o));      /* exact: the values are bf16 */
    }
#endif
}

/* The codes' values of the block (width bw) as bf16 in gemm.h's packed layout, for the tiles
 * of a call of more than TM_MAX tokens (the same values, so the same bits). */
INLINE void fp4_codes_fill(const uint8_t *blk, int64_t n, int64_t bw, bf16_t *buf) {
    const int CV = bw == BLOCK ? CV_MAX : 1;
    for (int64_t p = 0; p < n / 2; p++)
        for (int64_t c = 0; c < bw; c += CV * LANES) {
            wpair wv[CV_MAX];
            fp4_code_pairs(blk, bw, p, c, CV, wv);
            for (int v = 0; v < CV; v++) store_wpair(buf + p * 2 * bw + 2 * (c + v * LANES), wv[v]);
        }
}

/* acc[m][v] = fma(part[m][v], s[g], acc[m][v]) (header), part[m][v] = 0. */
INLINE void fp4_codes_flush(const fp4mat *q, int TM, int CV, int64_t g, int64_t col,
                            vf acc[TM_MAX][CV_MAX], vf part[TM_MAX][CV_MAX]) {
    for (int v = 0; v < CV; v++) {
        const vf s = fp4_group_scale(q, g, col + v * LANES);
        for (int m = 0; m < TM; m++) {
            acc[m][v] = vfma(part[m][v], s, acc[m][v]);
            part[m][v] = (vf){0};
        }
    }
}

/* TM tokens x CV vectors of block columns from c (global column col0 + c): the chain in the
 * header, converting the codes as it goes, or reading their values from buf (fp4_codes_fill). */
INLINE void fp4_codes_tile(const bf16_t *a, int TM, const fp4mat *q, const uint8_t *blk,
                           const bf16_t *buf, int64_t col0, int CV, int64_t n, int64_t bw,
                           int64_t c, float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX], part[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = part[m][v] = (vf){0};
    const int64_t gp = q->gs / 2;
    for (int64_t g = 0; g < n / q->gs; g++) {
        /* the next group's scale row is one line at a stride of lds bytes: ask for it early */
        __builtin_prefetch(q->scale + (g + 1) * q->lds + col0 + c);
        for (int64_t p = g * gp; p < (g + 1) * gp; p++) {
            wpair wv[CV_MAX];
            if (buf) {
                for (int v = 0; v < CV; v++)
                    wv[v] = load_pair(buf + p * 2 * bw + 2 * (c + v * LANES));
            } else {
                __builtin_prefetch(blk + (p + PREFETCH) * bw + c);   /* cold codes: DRAM */
                fp4_code_pairs(blk, bw, p, c, CV, wv);
            }
            for (int m = 0; m < TM; m++) {
                uint32_t ap;
                memcpy(&ap, a + m * n + 2 * p, sizeof(ap));
                for (int v = 0; v < CV; v++) part[m][v] = dot_pair(part[m][v], ap, wv[v]);
            }
        }
        fp4_codes_flush(q, TM, CV, g, col0 + c, acc, part);
    }
    const vf global = splat(q->global);
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) {
            const vf r = acc[m][v] * global;
            memcpy(y + m * ldy + v * LANES, &r, sizeof(vf));
        }
}

/* CV * LANES columns (from block column c) for every token, in tiles of up to TM_MAX tokens. */
INLINE void fp4_codes_columns(const bf16_t *a, int64_t M, const fp4mat *q, const uint8_t *blk,
                              const bf16_t *buf, int64_t col0, int CV, int64_t n, int64_t bw,
                              int64_t c, float *y, int64_t ldy) {
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX)
        fp4_codes_tile(a + m * n, TM_MAX, q, blk, buf, col0, CV, n, bw, c, y + m * ldy, ldy);
    const bf16_t *am = a + m * n;
    float *ym = y + m * ldy;
    switch (M - m) {
    case 3: fp4_codes_tile(am, 3, q, blk, buf, col0, CV, n, bw, c, ym, ldy); break;
    case 2: fp4_codes_tile(am, 2, q, blk, buf, col0, CV, n, bw, c, ym, ldy); break;
    case 1: fp4_codes_tile(am, 1, q, blk, buf, col0, CV, n, bw, c, ym, ldy); break;
    default: break;
    }
}

/* y [M, cols] (row stride ldy) = a [M, n] (bf16) @ the FP4 matrix q ([cols, n]), block by
 * block: the chain in the header. wbuf: BLOCK * n / 2 floats at least (the bf16 values of one
 * block, used when M > TM_MAX; NULL: the register tiles convert as they go). */
INLINE void fp4_codes_matmul(const bf16_t *a, int64_t M, const fp4mat *q, int64_t n,
                             int64_t cols, float *y, int64_t ldy, void *wbuf) {
    for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) {
        const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;     /* a multiple of LANES */
        const uint8_t *blk = q->w + c0 * n / 2;
        const bf16_t *buf = M > TM_MAX && wbuf ? wbuf : NULL;
        if (buf) fp4_codes_fill(blk, n, bw, wbuf);
        if (bw == BLOCK) {
            fp4_codes_columns(a, M, q, blk, buf, c0, CV_MAX, n, bw, 0, y + c0, ldy);
            continue;
        }
        for (int64_t v = 0; v < bw; v += LANES)
            fp4_codes_columns(a, M, q, blk, buf, c0, 1, n, bw, v, y + c0 + v, ldy);
    }
}
