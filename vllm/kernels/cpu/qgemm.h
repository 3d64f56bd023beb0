/* Weight-only quantized GEMM tiles for the expert kernel: FP8 e4m3 and INT4 (GPTQ) weights are
 * dequantized in registers, 16 output columns by 2 input rows at a time, right before the
 * FMAs, and then run the very chains gemm.h states for the activation dtype:
 *
 *   w[i][c] = (code(i, c) - zero[g(i)][c]) * scale[g(i)][c]           (f32, one rounding)
 *   f32:  acc = fma(a[i], w[i][c], acc) for i = 0 .. n-1
 *   bf16: w rounded to bf16 (nearest even), then gemm.h's pair chain
 *
 * which is what a dequantize-then-matmul computes: float(fp8) * scale, or float(q - zero) *
 * scale, rounded to the activation dtype. So each output equals the unquantized kernel's on
 * the dequantized weights, bit for bit, and inherits its invariant: a row's value never
 * depends on the other rows in the call.
 *
 * The expert kernel runs these chains for f32 activations, and for bf16 ones only where the
 * groups are not runs of row pairs (an odd-sized INT4 group; GPTQ act order reaches the kernel
 * with its rows sorted by group, the activations gathered to match: moe_experts.c's
 * qproject): other bf16 calls go through
 * qgemm_codes.h, which feeds the codes' exact values to vdpbf16ps and scales f32 accumulators
 * per group instead (other bits, the same invariant; its header states the chain).
 *
 * Packed layout of one quantized matrix [cols, n] (out, in), made by the cpu_kernel backend's
 * pack (fused_moe/cpu_kernel.py, pack_quantized): gemm.h's column blocks of BLOCK columns
 * (width bw), each one contiguous stream of codes with input-row pairs interleaved:
 *   fp8:  byte (p * bw + c) * 2 + i % 2 for row i = 2p or 2p+1 < n - n % 2, then the last row
 *         [bw] when n is odd (a block is n * bw bytes; block c0 starts at byte c0 * n);
 *   int4: byte p * bw + c holds row 2p in its low nibble, 2p+1 in its high one (n even; a block
 *         is n * bw / 2 bytes, block c0 starts at byte c0 * n / 2).
 * Scales (and INT4 zero points, as f32) are [groups, lds] tables: group g of column c at
 * g * lds + c; gidx [n] gives the group of each input row (GPTQ's g_idx, any order, though the
 * backend's pack sorts act order's rows by group; i / block for FP8, one group for per-tensor
 * and per-channel scales).
 */
#pragma once
#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "vec.h"

typedef uint8_t vb16 __attribute__((vector_size(16), aligned(1)));

/* Codes widened to 32-bit lanes, zero-extended: 16 bytes from p (widen_u8), 16 u16 from p
 * (widen_u16), or a vh in a register (widen_vh). GCC 12 lowers __builtin_convertvector of an
 * unaligned byte (or u16) vector to one scalar extract and insert per lane; vpmovzx* widen in
 * one instruction (two 256-bit ones without AVX-512). The same values either way. */
#if defined(__AVX2__)
#include <immintrin.h>
/* two 256-bit halves as one vu (a 16-lane shuffle of them is lowered lane by lane there) */
INLINE vu vu_cat(__m256i lo, __m256i hi) {
    vu r;
    memcpy(&r, &lo, sizeof(lo));
    memcpy((char *)&r + sizeof(lo), &hi, sizeof(hi));
    return r;
}
#endif

INLINE vu widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return vu_cat(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
#else
    vb16 b;
    memcpy(&b, p, sizeof(b));
    return __builtin_convertvector(b, vu);
#endif
}

INLINE vu widen_u16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return vu_cat(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
#else
    vh h;
    memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, vu);
#endif
}

INLINE vu widen_vh(vh h) {
    uint8_t b[sizeof(vh)];
    memcpy(b, &h, sizeof(b));
    return widen_u16(b);
}

typedef struct {
    const uint8_t *w;      /* packed codes (layout above) */
    const float *scale;    /* [groups, lds] */
    const float *zero;     /* [groups, lds] for int4; NULL for fp8 */
    const int32_t *gidx;   /* [n] group of each input row */
    int64_t lds;
    int int4;
} qmat;

/* e4m3 codes (one per lane) -> f32, exact: the code's exponent and mantissa bits placed in an
 * f32 (whose exponent bias is 120 larger) and scaled by 2^120, which also gives e4m3's
 * subnormals exactly (through f32 subnormals). The NaN code 0x7f reads as 480. */
INLINE vf fp8_to_f32(vu b) {
    const vu bits = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
    vf f;
    memcpy(&f, &bits, sizeof(f));
    return f * 0x1p120f;
}

INLINE float fp8_to_f32_1(uint32_t b) {
    const uint32_t bits = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f * 0x1p120f;
}

/* Rows 2p (*even) and 2p+1 (*odd), block columns c .. c+15, dequantized to f32. blk: the
 * block's codes; se/so (ze/zo): the scale (zero) rows of the two rows' groups, from the block's
 * first column (ze/zo unread for fp8). */
INLINE void deq_pair(const qmat *q, const uint8_t *blk, int64_t bw, int64_t p, int64_t c,
                     const float *se, const float *so, const float *ze, const float *zo,
                     vf *even, vf *odd) {
    vf s_e, s_o;
    memcpy(&s_e, se + c, sizeof(vf));
    memcpy(&s_o, so + c, sizeof(vf));
    if (q->int4) {
        const vu u = widen_u8(blk + p * bw + c);
        vf z_e, z_o;
        memcpy(&z_e, ze + c, sizeof(vf));
        memcpy(&z_o, zo + c, sizeof(vf));
        *even = (__builtin_convertvector((vi)(u & 15u), vf) - z_e) * s_e;
        *odd = (__builtin_convertvector((vi)(u >> 4), vf) - z_o) * s_o;
        return;
    }
    const vu u = widen_u16(blk + (p * bw + c) * 2);
    *even = fp8_to_f32(u & 0xffu) * s_e;
    *odd = fp8_to_f32(u >> 8) * s_o;
}

/* One weight (row i, block column c; global column col) dequantized to f32. */
INLINE float deq1(const qmat *q, const uint8_t *blk, int64_t n, int64_t bw, int64_t i, int64_t c,
                  int64_t col) {
    const int64_t g = q->gidx[i] * q->lds + col;
    if (q->int4) {
        const uint32_t code = (blk[(i / 2) * bw + c] >> (4 * (i & 1))) & 15u;
        return ((float)code - q->zero[g]) * q->scale[g];
    }
    const uint8_t b = i < n - n % 2 ? blk[((i / 2) * bw + c) * 2 + (i & 1)] : blk[(n - 1) * bw + c];
    return fp8_to_f32_1(b) * q->scale[g];
}

#if defined(__AVX512BF16__)
/* The bf16 path with AVX512-BF16: a pair of rows dequantized straight into the interleaved
 * wpair, about 10 instructions per 32 weights. FP8 codes widen exactly to f16 (q * 2^-8:
 * e4m3's exponent and mantissa fit f16's, subnormals included) and from f16 to f32
 * (vcvtph2ps); INT4 values minus zero points are exact integers. Scales (and zeros) are
 * interleaved per lane pair like the weights, FP8's multiplied by 256 (exact), so each product
 * is the same f32 rounding of code * scale as above; vcvtne2ps2bf16 rounds to nearest even, as
 * f32_to_bf16 does, and flushes f32 subnormals, which the packing excludes (it refuses scales
 * below 2^-117, where |code * scale| could fall under 2^-126). */
typedef struct { __m512 s_lo, s_hi, z_lo, z_hi; } qscale;

INLINE qscale qscale_make(const float *se, const float *so, const float *ze, const float *zo,
                          int64_t c, int int4) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512 a = _mm512_loadu_ps(se + c), b = _mm512_loadu_ps(so + c);
    const __m512 k = _mm512_set1_ps(int4 ? 1.0f : 256.0f);
    qscale q;
    q.s_lo = _mm512_mul_ps(_mm512_permutex2var_ps(a, lo, b), k);
    q.s_hi = _mm512_mul_ps(_mm512_permutex2var_ps(a, hi, b), k);
    q.z_lo = q.z_hi = _mm512_setzero_ps();
    if (int4) {
        const __m512 za = _mm512_loadu_ps(ze + c), zb = _mm512_loadu_ps(zo + c);
        q.z_lo = _mm512_permutex2var_ps(za, lo, zb);
        q.z_hi = _mm512_permutex2var_ps(za, hi, zb);
    }
    return q;
}

INLINE wpair deq_pair_bf16(int int4, const uint8_t *blk, int64_t bw, int64_t p, int64_t c,
                           const qscale *qs) {
    __m512 lo, hi;
    if (int4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + p * bw + c)));
        /* 32-bit lane j: row 2p's value (low 16 bits), row 2p+1's (high 16 bits) */
        const __m512i r = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12),
                                                    _mm512_set1_epi32(0x000f000f), 0xA8);
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(r)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(r, 1)));
        lo = _mm512_mul_ps(_mm512_sub_ps(lo, qs->z_lo), qs->s_lo);
        hi = _mm512_mul_ps(_mm512_sub_ps(hi, qs->z_hi), qs->s_hi);
    } else {
        /* e4m3 s.eeee.mmm, sign-extended to 16 bits and shifted by 7, is f16 s.seeee.mmm0000000;
         * clearing bit 14 leaves s.0eeee.mmm0000000, the value times 2^-8 */
        const __m512i w = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256((const __m256i *)(blk + (p * bw + c) * 2)));
        const __m512i h = _mm512_and_si512(_mm512_slli_epi16(w, 7),
                                           _mm512_set1_epi16((short)0xBFFF));
        lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), qs->s_lo);
        hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), qs->s_hi);
    }
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif

#if defined(__AVX512BF16__)
/* qtile's pair loop for bf16 activations: acc[m][v] over rows 0 .. n - n % 2. The scales are
 * remade only when a pair's groups change (once per tile for one group, per 128 rows for FP8
 * blocks, per pair at worst for an unsorted g_idx). */
INLINE void qpairs_bf16(const void *a, int TM, const qmat *q, int int4, const uint8_t *blk,
                        int64_t col0, int CV, int64_t n, int64_t bw, int64_t c,
                        vf acc[TM_MAX][CV_MAX]) {
    const float *zbase = q->zero ? q->zero + col0 : q->scale + col0;  /* unread for fp8 */
    qscale qs[CV_MAX];
    memset(qs, 0, sizeof(qs));         /* made at p = 0 (silences -Wmaybe-uninitialized) */
    int64_t cur_e = -1, cur_o = -1;    /* the groups qs was made for (rows 2p, 2p+1) */
    for (int64_t p = 0; p < n / 2; p++) {
        const int64_t ge = q->gidx[2 * p] * q->lds, go = q->gidx[2 * p + 1] * q->lds;
        if (ge != cur_e || go != cur_o) {
            for (int v = 0; v < CV; v++)
                qs[v] = qscale_make(q->scale + col0 + ge, q->scale + col0 + go, zbase + ge,
                                    zbase + go, c + v * LANES, int4);
            cur_e = ge;
            cur_o = go;
        }
        wpair wv[CV_MAX];
        /* cold codes stream from DRAM: ask for rows PREFETCH pairs ahead */
        __builtin_prefetch(blk + (int4 ? (p + PREFETCH) * bw + c
                                       : (p + PREFETCH) * 2 * bw + 2 * c));
        for (int v = 0; v < CV; v++)
            wv[v] = deq_pair_bf16(int4, blk, bw, p, c + v * LANES, &qs[v]);
        for (int m = 0; m < TM; m++) {
            uint32_t ap;
            memcpy(&ap, (const bf16_t *)a + m * n + 2 * p, sizeof(ap));
            for (int v = 0; v < CV; v++) acc[m][v] = dot_pair(acc[m][v], ap, wv[v]);
        }
    }
}
#endif

/* tile_f32 / tile_bf16 over a quantized block: TM tokens x CV vectors from block column c. */
INLINE void qtile(const void *a, int TM, const qmat *q, const uint8_t *blk, int64_t col0, int bf16,
                  int CV, int64_t n, int64_t bw, int64_t c, float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = (vf){0};
    const float *zbase = q->zero ? q->zero + col0 : q->scale + col0;  /* unread for fp8 */
#if defined(__AVX512BF16__)
    if (bf16) {
        if (q->int4) qpairs_bf16(a, TM, q, 1, blk, col0, CV, n, bw, c, acc); /* one loop each */
        else qpairs_bf16(a, TM, q, 0, blk, col0, CV, n, bw, c, acc);
    } else
#endif
    for (int64_t p = 0; p < n / 2; p++) {
        const int64_t ge = q->gidx[2 * p] * q->lds, go = q->gidx[2 * p + 1] * q->lds;
        const float *se = q->scale + col0 + ge, *so = q->scale + col0 + go;
        vf we[CV_MAX], wo[CV_MAX];
        for (int v = 0; v < CV; v++)
            deq_pair(q, blk, bw, p, c + v * LANES, se, so, zbase + ge, zbase + go, &we[v],
                     &wo[v]);
        if (!bf16) {
            const float *af = a;
            for (int m = 0; m < TM; m++) {
                const vf ae = splat(af[m * n + 2 * p]), ao = splat(af[m * n + 2 * p + 1]);
                for (int v = 0; v < CV; v++) acc[m][v] = vfma(ao, wo[v], vfma(ae, we[v], acc[m][v]));
            }
        } else {
            wpair wv[CV_MAX];
            for (int v = 0; v < CV; v++) wv[v] = make_pair(we[v], wo[v]);
            for (int m = 0; m < TM; m++) {
                uint32_t ap;
                memcpy(&ap, (const bf16_t *)a + m * n + 2 * p, sizeof(ap));
                for (int v = 0; v < CV; v++) acc[m][v] = dot_pair(acc[m][v], ap, wv[v]);
            }
        }
    }
    if (n & 1)      /* fp8 only (int4 needs n even): the last row, unpaired */
        for (int v = 0; v < CV; v++) {
            const vu b = widen_u8(blk + (n - 1) * bw + c + v * LANES);
            vf s;
            memcpy(&s, q->scale + q->gidx[n - 1] * q->lds + col0 + c + v * LANES, sizeof(s));
            const vf w = round_to(fp8_to_f32(b) * s, bf16);
            for (int m = 0; m < TM; m++)
                acc[m][v] = vfma(splat(load1(a, bf16, m * n + n - 1)), w, acc[m][v]);
        }
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

/* Block column c alone (a ragged block's columns outside any vector): column_tail's chains. */
INLINE void qcolumn_tail(const void *a, int64_t M, const qmat *q, const uint8_t *blk,
                         int64_t col0, int bf16, int64_t n, int64_t bw, int64_t c, float *y,
                         int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        float s = 0.0f;
        if (!bf16) {
            for (int64_t i = 0; i < n; i++)
                s = sfma(((const float *)a)[m * n + i], deq1(q, blk, n, bw, i, c, col0 + c), s);
        } else {
            const bf16_t *ab = (const bf16_t *)a + m * n;
            for (int64_t p = 0; p < n / 2; p++) {
                const float we = deq1(q, blk, n, bw, 2 * p, c, col0 + c);
                const float wo = deq1(q, blk, n, bw, 2 * p + 1, c, col0 + c);
                s = sfma(bf16_to_f32(ab[2 * p + 1]), bf16_to_f32(f32_to_bf16(wo)), s);
                s = sfma(bf16_to_f32(ab[2 * p]), bf16_to_f32(f32_to_bf16(we)), s);
            }
            if (n & 1)
                s = sfma(bf16_to_f32(ab[n - 1]),
                         bf16_to_f32(f32_to_bf16(deq1(q, blk, n, bw, n - 1, c, col0 + c))), s);
        }
        y[m * ldy] = s;
    }
}

/* CV * LANES columns (from block column c) for every token, in tiles of up to TM_MAX tokens. */
INLINE void qcolumns(const void *a, int64_t M, const qmat *q, const uint8_t *blk, int64_t col0,
                     int bf16, int CV, int64_t n, int64_t bw, int64_t c, float *y, int64_t ldy) {
    const size_t asz = bf16 ? 2 : 4;
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX)
        qtile((const char *)a + m * n * asz, TM_MAX, q, blk, col0, bf16, CV, n, bw, c,
              y + m * ldy, ldy);
    const void *am = (const char *)a + m * n * asz;
    switch (M - m) {
    case 3: qtile(am, 3, q, blk, col0, bf16, CV, n, bw, c, y + m * ldy, ldy); break;
    case 2: qtile(am, 2, q, blk, col0, bf16, CV, n, bw, c, y + m * ldy, ldy); break;
    case 1: qtile(am, 1, q, blk, col0, bf16, CV, n, bw, c, y + m * ldy, ldy); break;
    default: break;
    }
}

/* Rows 2p, 2p+1 of block columns c .. c+15 into buf, gemm.h's packed layout of the dtype. */
INLINE void store_pair(const qmat *q, const uint8_t *blk, int64_t col0, int bf16, int64_t bw,
                       int64_t p, int64_t c, void *buf) {
    const int64_t ge = q->gidx[2 * p] * q->lds + col0, go = q->gidx[2 * p + 1] * q->lds + col0;
    const float *z = q->zero ? q->zero : q->scale;                  /* unread for fp8 */
#if defined(__AVX512BF16__)
    if (bf16) {
        const qscale qs = qscale_make(q->scale + ge, q->scale + go, z + ge, z + go, c, q->int4);
        const wpair w = deq_pair_bf16(q->int4, blk, bw, p, c, &qs);
        memcpy((bf16_t *)buf + p * 2 * bw + 2 * c, &w, sizeof(w));
        return;
    }
#endif
    vf e, o;
    deq_pair(q, blk, bw, p, c, q->scale + ge, q->scale + go, z + ge, z + go, &e, &o);
    if (!bf16) {
        memcpy((float *)buf + 2 * p * bw + c, &e, sizeof(e));
        memcpy((float *)buf + (2 * p + 1) * bw + c, &o, sizeof(o));
        return;
    }
    const vh he = f32_to_bf16v(e), ho = f32_to_bf16v(o);
    const vu pr = widen_vh(he) | (widen_vh(ho) << 16);   /* lane l: he[l], then ho[l] */
    memcpy((bf16_t *)buf + p * 2 * bw + 2 * c, &pr, sizeof(pr));
}

/* The block at col0 (width bw) dequantized into buf in gemm.h's packed layout for the
 * activation dtype, so gemm.h's tiles run on it: the same weights, so the same bits, with each
 * weight dequantized once per call instead of once per tile of TM_MAX tokens. */
INLINE void dequant_block(const qmat *q, const uint8_t *blk, int64_t col0, int bf16, int64_t n,
                          int64_t bw, void *buf) {
    for (int64_t p = 0; p < n / 2; p++) {
        int64_t c = 0;
        for (; c + LANES <= bw; c += LANES) store_pair(q, blk, col0, bf16, bw, p, c, buf);
        for (; c < bw; c++) {
            const float we = deq1(q, blk, n, bw, 2 * p, c, col0 + c);
            const float wo = deq1(q, blk, n, bw, 2 * p + 1, c, col0 + c);
            if (bf16) {
                ((bf16_t *)buf)[p * 2 * bw + 2 * c] = f32_to_bf16(we);
                ((bf16_t *)buf)[p * 2 * bw + 2 * c + 1] = f32_to_bf16(wo);
            } else {
                ((float *)buf)[2 * p * bw + c] = we;
                ((float *)buf)[(2 * p + 1) * bw + c] = wo;
            }
        }
    }
    if (n & 1)
        for (int64_t c = 0; c < bw; c++)
            store1(buf, bf16, (n - 1) * bw + c, deq1(q, blk, n, bw, n - 1, c, col0 + c));
}

/* y [M, cols] (row stride ldy) = a [M, n] @ the quantized matrix q ([cols, n]), block by
 * block; a is f32 or bf16 (bf16 != 0), y f32. More than TM_MAX rows and a scratch wbuf (BLOCK
 * * n f32): each block is dequantized once into wbuf and gemm.h's tiles run on it; else the
 * register tiles dequantize as they go. Either way the same bits. */
INLINE void qmatmul(const void *a, int64_t M, const qmat *q, int bf16, int64_t n, int64_t cols,
                    float *y, int64_t ldy, void *wbuf) {
    for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) {
        const int64_t bw = cols - c0 < BLOCK ? cols - c0 : BLOCK;
        const uint8_t *blk = q->w + (q->int4 ? c0 * n / 2 : c0 * n);
        if (M > TM_MAX && wbuf) {
            dequant_block(q, blk, c0, bf16, n, bw, wbuf);
            matmul_block(a, M, wbuf, bf16, n, bw, 0, y + c0, ldy);
            continue;
        }
        if (bw == BLOCK) {
            qcolumns(a, M, q, blk, c0, bf16, CV_MAX, n, bw, 0, y + c0, ldy);
            continue;
        }
        int64_t v = 0;
        for (; v + LANES <= bw; v += LANES)
            qcolumns(a, M, q, blk, c0, bf16, 1, n, bw, v, y + c0 + v, ldy);
        for (; v < bw; v++) qcolumn_tail(a, M, q, blk, c0, bf16, n, bw, v, y + c0 + v, ldy);
    }
}
