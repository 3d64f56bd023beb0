/* Quantized matrix-vector products on the schemes' own layouts: the experts a GPU machine's CPU
 * computes from the host store (expert_cache/host_compute.py), without dequantizing them first.
 *
 *   y [T, R] = x [T, C] @ W^T,  W [R, C] dequantized in registers right before the FMAs.
 *
 * kind 0, FP8: e4m3 codes [R, C], row-major (a row is an output).
 * kind 1, GPTQ INT4: int32 words [R, C / 8], column c at bits [4 (c % 8), +4) of word c / 8;
 *   zero points from the scheme's packed qzeros [ceil(R / 8), Gs] int32 (row r at bits
 *   [4 (r % 8), +4) of word r / 8) plus zero_offset (GPTQ v1 stores zero - 1).
 * Scales f32 [Rs, Gs]: element (r, c) reads scales[(r / row_div) * Gs + c / group] (a tensor
 * scale per half, per-channel, 128 x 128 blocks, GPTQ groups: the wrapper builds the view).
 *
 * Per row r, token t and group g: dot = sum over the group's columns of q[r, c] x[t, c] in f32
 * (q: the code's value, exactly representable), then y[t, r] += s (dot - z sum x[t, c]); for
 * FP8 z = 0 and q is value / 256 (the f16 bit trick below), the 256 riding in s. x, y f32;
 * the caller rounds. Tokens go in chunks of up to TOK, each weight vector decoded once per
 * chunk; rows in pairs (two independent FMA chains even at one token); threads split the rows.
 * The wrapper (kernels/cpu/qgemv.py) checks shapes: int4 needs group % 8 == 0.
 * An e4m3 NaN code (0x7f, 0xff) decodes to +-480: weights are never NaN. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define TOK 4

/* One e4m3 code -> its value / 256 (normal: (8 + m) 2^(e - 10); subnormal: m 2^-9). */
INLINE float e4m3_over_256(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? __builtin_ldexpf((float)(8 + m), e - 18) : __builtin_ldexpf((float)m, -17);
    return (b & 0x80) ? -v : v;
}

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
    for (int l = 0; l < LANES; l++) v[l] = e4m3_over_256(p[l]);
    return v;
#endif
}

/* Words p[0] (columns 0-7) and p[1] (8-15) -> the 16 int4 values. */
INLINE vf int4x16(const int32_t *p) {
    const uint32_t a = (uint32_t)p[0], b = (uint32_t)p[1];
    const vu w = {a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
    const vu sh = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
    return __builtin_convertvector((vi)((w >> sh) & 15u), vf);
}

INLINE float code1(int kind, const void *row, int64_t c) {
    if (kind == 0) return e4m3_over_256(((const uint8_t *)row)[c]);
    return (float)((((const uint32_t *)row)[c >> 3] >> (4 * (c & 7))) & 15u);
}

INLINE vf code16(int kind, const void *row, int64_t c) {
    return kind == 0 ? e4m3x16((const uint8_t *)row + c) : int4x16((const int32_t *)row + (c >> 3));
}

typedef struct {
    int kind, zero_offset;
    const void *codes;
    const float *scales, *x, *xsum;       /* xsum [T, Gs]: x summed per group (int4 zeros) */
    const int32_t *zeros;
    float *y;
    int64_t T, R, C, Gs, row_div, group, row_bytes;
} qgemv_args;

/* Rows [r0, r0 + NR) x tokens [t0, t0 + NT): NR, NT constant in each instantiation. */
INLINE void rows_tokens(const qgemv_args *a, int kind, int NR, int NT, int64_t r0, int64_t t0) {
    vf tot[2][TOK];
    float corr[2][TOK] = {{0}};
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++) tot[i][t] = splat(0.0f);
    const char *rows[2] = {(const char *)a->codes + r0 * a->row_bytes,
                           (const char *)a->codes + (r0 + NR - 1) * a->row_bytes};
    const float unit = kind == 0 ? 256.0f : 1.0f;
    for (int64_t g = 0; g < a->Gs; g++) {
        const int64_t c0 = g * a->group, c1 = c0 + a->group < a->C ? c0 + a->group : a->C;
        vf acc[2][TOK];
        float tail[2][TOK] = {{0}};
        for (int i = 0; i < NR; i++)
            for (int t = 0; t < NT; t++) acc[i][t] = splat(0.0f);
        int64_t c = c0;
        for (; c + LANES <= c1; c += LANES) {
            vf w[2];
            for (int i = 0; i < NR; i++) w[i] = code16(kind, rows[i], c);
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
            const int64_t r = r0 + i;
            const float s = a->scales[(r / a->row_div) * a->Gs + g] * unit;
            float z = 0.0f;
            if (kind == 1)
                z = (float)((((uint32_t)a->zeros[(r >> 3) * a->Gs + g]) >> (4 * (r & 7))) & 15u) +
                    (float)a->zero_offset;
            for (int t = 0; t < NT; t++) {
                tot[i][t] = vfma(splat(s), acc[i][t], tot[i][t]);
                corr[i][t] += s * (tail[i][t] - z * a->xsum[(t0 + t) * a->Gs + g]);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < NT; t++)
            a->y[(t0 + t) * a->R + r0 + i] = lane_sum(tot[i][t]) + corr[i][t];
}

#define NT_CASES(KIND, NR)                                                                   \
    switch (nt) {                                                                            \
    case 1: rows_tokens(a, KIND, NR, 1, r0, t0); break;                                     \
    case 2: rows_tokens(a, KIND, NR, 2, r0, t0); break;                                     \
    case 3: rows_tokens(a, KIND, NR, 3, r0, t0); break;                                     \
    default: rows_tokens(a, KIND, NR, 4, r0, t0); break;                                    \
    }

static void block_fp8(const qgemv_args *a, int nr, int nt, int64_t r0, int64_t t0) {
    if (nr == 2) { NT_CASES(0, 2) } else { NT_CASES(0, 1) }
}

static void block_int4(const qgemv_args *a, int nr, int nt, int64_t r0, int64_t t0) {
    if (nr == 2) { NT_CASES(1, 2) } else { NT_CASES(1, 1) }
}

/* Returns 0, -1 for an unknown kind, -2 when scratch could not be allocated. zeros: NULL for
 * FP8. Shapes as the file's comment says, checked by the wrapper. */
int qgemv(int kind, const void *codes, const float *scales, const int32_t *zeros, const float *x,
          float *y, int64_t T, int64_t R, int64_t C, int64_t Gs, int64_t row_div, int64_t group,
          int zero_offset) {
    if (kind != 0 && kind != 1) return -1;
    float *xsum = calloc((size_t)(T * Gs > 0 ? T * Gs : 1), sizeof(float));
    if (!xsum) return -2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < C; c++) xsum[t * Gs + c / group] += x[t * C + c];
    const qgemv_args a = {kind, zero_offset, codes, scales, x, xsum, zeros, y, T, R, C, Gs,
                          row_div, group, kind == 0 ? C : (C / 8) * 4};
    const int64_t pairs = (R + 1) / 2;
    for (int64_t t0 = 0; t0 < T; t0 += TOK) {
        const int nt = T - t0 < TOK ? (int)(T - t0) : TOK;
        #pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const int nr = 2 * p + 1 < R ? 2 : 1;
            if (kind == 0) block_fp8(&a, nr, nt, 2 * p, t0);
            else block_int4(&a, nr, nt, 2 * p, t0);
        }
    }
    free(xsum);
    return 0;
}
