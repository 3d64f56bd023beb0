/* The decoders of qgemv.c (its header comment states the layouts): one code or 16 codes to f32
 * (the f32 chain; FP8 as value / 256), a scale byte to f32, and with AVX512-BF16 and VBMI a
 * bf16-chain step of codes to exact bf16 pairs. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "qgemm_codes_fp4.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define HAVE_BF16_CHAIN 1
#else
#define HAVE_BF16_CHAIN 0
#endif

/* 16 e4m3 codes -> values / 256. The code's bits shifted left by 7 put e and m where an f16's
 * exponent and top mantissa bits are, and the sign at bit 14; adding bit 14 to itself moves it
 * to bit 15. The f16 read that way is the e4m3 value / 2^8 (the biases differ by 8), also for
 * subnormals, which the f16 conversion handles exactly. */
INLINE vf e4m3x16(const uint8_t *p) {
#if defined(__AVX512F__)
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));
    return (vf)_mm512_cvtph_ps(h);
#else
    vf v;
    for (int l = 0; l < LANES; l++) v[l] = fp8_value(p[l]) * 0x1p-8f;     /* exact */
    return v;
#endif
}

/* Words p[0] (columns 0-7) and p[1] (8-15) -> the 16 nibbles, one per lane. */
INLINE vu nibbles16(const int32_t *p) {
    const uint32_t a = (uint32_t)p[0], b = (uint32_t)p[1];
    const vu w = {a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
    const vu sh = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
    return (w >> sh) & 15u;
}

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* One code's exact value (FP8: fp8_value, qgemm_codes.h's table). */
INLINE float code1(int kind, const void *row, int64_t c) {
    if (kind == 0) return fp8_value(((const uint8_t *)row)[c]);
    const uint32_t q = (((const uint32_t *)row)[c >> 3] >> (4 * (c & 7))) & 15u;
    return kind == 1 ? (float)q : E2M1[q];
}

/* Columns c .. c + 15 decoded (FP8: value / 256, see e4m3x16). */
INLINE vf code16(int kind, const void *row, int64_t c) {
    if (kind == 0) return e4m3x16((const uint8_t *)row + c);
    const vu q = nibbles16((const int32_t *)row + (c >> 3));
    return kind == 1 ? __builtin_convertvector((vi)q, vf) : e2m1_to_f32(q);
}

/* A scale byte's value: e4m3 exact, or e8m0 2^(b - 127) (0: 2^-127, an f32 subnormal). */
INLINE float scale_byte(int code, uint8_t b) {
    if (code == 1) return fp8_value(b);
    const uint32_t bits = b ? (uint32_t)b << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}


#if HAVE_BF16_CHAIN
/* Step of the bf16 chain in columns: 64 FP8 codes, 32 INT4 or FP4 values (4 words). */
#define BSTEP(kind) ((kind) == 0 ? 64 : 32)

/* The codes of columns c .. c + BSTEP - 1 of a row as exact bf16 values, consecutive columns
 * paired in each 32-bit lane (w[1]: FP8's columns 32-63). */
INLINE void bf16_codes(int kind, const void *row, int64_t c, __m512bh *w) {
    if (kind == 0) {
        __m512i w0, w1;
        fp8_bf16_64(_mm512_loadu_si512((const uint8_t *)row + c), &w0, &w1);
        w[0] = (__m512bh)w0;
        w[1] = (__m512bh)w1;
        return;
    }
    /* Byte k of the 4 words: column 2k in its low nibble, 2k + 1 in its high one. */
    w[0] = (__m512bh)nibble_pairs_bf16((const uint8_t *)((const int32_t *)row + (c >> 3)),
                                       kind == 1 ? int4_bf16_words() : e2m1_bf16_words());
}
#endif
