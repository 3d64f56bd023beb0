/* exp12's decode on the CPU (expert_cache/link_codec.py has the layout; its torch `decode` is
 * the reference): blocks [b0, b1) of one expert's planes into bf16 bits, then the escapes that
 * fall there written over them. exp12.c decodes whole experts with it; gemv16.c a few rows at
 * a time into a buffer that stays in the core's cache (the CPU computing a miss from the
 * planes, with gemv16's bits). */
#ifndef EXP12_H
#define EXP12_H

#include <stdint.h>
#include <string.h>

#include "vec.h"

#define EXP12_BLK 128
#define EXP12_ZERO_CODE 14

typedef uint8_t exp12_vb __attribute__((vector_size(LANES), aligned(1)));

/* One expert's planes: lo [n], codes [n / 2], base [n / 128]; its escapes' ascending positions
 * and bits [nesc] (the list's -1 padding left out by the caller). */
typedef struct {
    const uint8_t *lo, *codes, *base;
    const int32_t *esc_idx;
    const uint16_t *esc_bits;
    int64_t nesc;
} exp12_planes;

/* Weights 2j and 2j + 1 of each of 16 code bytes: lanes of u32, the pair's bits in one lane
 * (weight 2j low), so 32 weights are one 64-byte store. An escape's code (15) decodes to some
 * bits here: the escape list writes over them. */
INLINE vu exp12_pairs(const uint8_t *lo, const uint8_t *codes, uint32_t top) {
#if defined(__AVX512F__)
    const vu c = (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    const vu l = (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)lo));
#else
    exp12_vb cb;
    vh lh;
    memcpy(&cb, codes, sizeof(cb));
    memcpy(&lh, lo, sizeof(lh));
    const vu c = __builtin_convertvector(cb, vu), l = __builtin_convertvector(lh, vu);
#endif
    const vu c0 = c & 15u, c1 = c >> 4, l0 = l & 0xFFu, l1 = l >> 8;
    const vu e0 = (top - c0) & (vu)(c0 < EXP12_ZERO_CODE);
    const vu e1 = (top - c1) & (vu)(c1 < EXP12_ZERO_CODE);
    const vu r0 = ((l0 & 0x80u) << 8) | ((e0 & 0xFFu) << 7) | (l0 & 0x7Fu);
    const vu r1 = ((l1 & 0x80u) << 8) | ((e1 & 0xFFu) << 7) | (l1 & 0x7Fu);
    return r0 | (r1 << 16);
}

#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
/* 32 weights from 32 lo bytes and 16 code bytes, as 32 u16 lanes: each code byte spread to two
 * lanes (vpermb) and shifted by 0 or 4; the sign, exponent and mantissa fields joined by one
 * bit select. About half exp12_pairs' instructions per weight. */
INLINE __m512i exp12_w32(const uint8_t *lo, const uint8_t *codes, __m512i top) {
    static const uint8_t spread[64] = {                      /* byte k <- code byte k / 4 */
        0,  0,  0,  0,  1,  1,  1,  1,  2,  2,  2,  2,  3,  3,  3,  3,  4,  4,  4,  4,  5,  5,
        5,  5,  6,  6,  6,  6,  7,  7,  7,  7,  8,  8,  8,  8,  9,  9,  9,  9,  10, 10, 10, 10,
        11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};
    const __m512i l = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)lo));
    const __m512i cb = _mm512_maskz_permutexvar_epi8(            /* odd bytes (high) zeroed */
        0x5555555555555555ULL, _mm512_loadu_si512(spread),
        _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)codes)));
    const __m512i c = _mm512_and_si512(
        _mm512_srlv_epi16(cb, _mm512_set1_epi32(4 << 16)), _mm512_set1_epi16(15));
    const __m512i e = _mm512_maskz_sub_epi16(
        _mm512_cmplt_epu16_mask(c, _mm512_set1_epi16(EXP12_ZERO_CODE)), top, c);
    const __m512i sign_lo = _mm512_or_si512(_mm512_slli_epi16(l, 8), l);
    return _mm512_ternarylogic_epi64(_mm512_set1_epi16(0x7F80), _mm512_slli_epi16(e, 7),
                                     sign_lo, 0xCA);          /* exponent field ? e : the rest */
}
#endif

/* Blocks [b0, b1) into out [(b1 - b0) * 128] bf16 bits, escapes included. */
INLINE void exp12_decode_blocks(const exp12_planes *p, int64_t b0, int64_t b1, uint16_t *out) {
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *lo = p->lo + b * EXP12_BLK, *codes = p->codes + b * (EXP12_BLK / 2);
        uint16_t *o = out + (b - b0) * EXP12_BLK;
        /* A miss reads its planes from RAM: fetch 8 blocks ahead while this one decodes (the
         * hardware prefetchers alone left the decode and the reads about serial). */
        __builtin_prefetch(lo + 8 * EXP12_BLK, 0, 0);
        __builtin_prefetch(lo + 8 * EXP12_BLK + 64, 0, 0);
        __builtin_prefetch(codes + 8 * (EXP12_BLK / 2), 0, 0);
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
        const __m512i top = _mm512_set1_epi16((short)p->base[b]);
        for (int j = 0; j < EXP12_BLK / 2; j += 16)
            _mm512_storeu_si512(o + 2 * j, exp12_w32(lo + 2 * j, codes + j, top));
#else
        for (int j = 0; j < EXP12_BLK / 2; j += LANES) {
            const vu v = exp12_pairs(lo + 2 * j, codes + j, p->base[b]);
            memcpy(o + 2 * j, &v, sizeof(v));
        }
#endif
    }
    const int64_t first = b0 * EXP12_BLK, end = b1 * EXP12_BLK;
    int64_t k = 0, hi = p->nesc;                       /* the first escape at or past first */
    while (k < hi) {
        const int64_t mid = (k + hi) / 2;
        if (p->esc_idx[mid] < first) k = mid + 1; else hi = mid;
    }
    for (; k < p->nesc && p->esc_idx[k] < end; k++) out[p->esc_idx[k] - first] = p->esc_bits[k];
}

#endif
