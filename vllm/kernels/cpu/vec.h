/* Shared by the CPU kernels: 16-lane f32 vectors (GCC vector extensions, lowered to whatever the
 * build's -march offers), bf16 <-> f32, fused multiply-add, and a vector exp.
 *
 * Rounding is written out, never left to the compiler: the library is built with
 * -ffp-contract=off (build.py), and every a * b + c that should round once is an explicit
 * fma (vfma, fmaf). Whether GCC contracts a * b + c on its own depends on its tuning for the
 * CPU (e.g. Sapphire Rapids tuning avoids 512-bit FMAs), which would make one register tile
 * round differently from another and break the batch invariance the kernels promise. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define LANES 16
#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));      /* unaligned ok */
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2), aligned(2)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint16_t bf16_t;

/* a * b + c lane-wise, rounded once. */
INLINE vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    const vf8 lo = (vf8)_mm256_fmadd_ps(
        (__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
        (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
        (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    const vf8 hi = (vf8)_mm256_fmadd_ps(
        (__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
        (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
        (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vf r;
    for (int l = 0; l < LANES; l++) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

/* a * b + c in f32, rounded once (one instruction where the build has FMA). */
INLINE float sfma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

/* v in every lane. */
INLINE vf splat(float v) { return (vf){0} + v; }

INLINE float bf16_to_f32(bf16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                       /* nearest even */
    return (bf16_t)(u >> 16);
}

/* f32_to_bf16 lane-wise (the same bits), in integer ops. */
INLINE vh f32_to_bf16v_int(vf f) {
    vu u;
    memcpy(&u, &f, sizeof(u));
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return __builtin_convertvector((nan & quiet) | (~nan & rounded), vh);
}

/* f32_to_bf16 lane-wise (the same bits). With AVX512-BF16, vcvtneps2bf16 rounds to nearest
 * even and quiets NaNs as f32_to_bf16 does in one instruction (the integer ops cost more than a
 * bf16 RMSNorm's arithmetic), but it flushes denormal inputs to zero: a vector holding one
 * takes the integer path. */
#if defined(__AVX512BF16__)
INLINE vh f32_to_bf16v(vf f) {
    const __m512i u = _mm512_castps_si512((__m512)f);
    const __mmask16 denormal = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)) &
                               _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(denormal != 0, 0)) return f32_to_bf16v_int(f);
    const __m256bh h = _mm512_cvtneps_pbh((__m512)f);
    vh out;
    memcpy(&out, &h, sizeof(out));
    return out;
}
#else
#define f32_to_bf16v f32_to_bf16v_int
#endif

/* fn(args..., r, BF16) for every row r < rows, BF16 a constant in each branch: OpenMP outlines
 * a parallel loop's body into its own function, where a dtype flag passed in would be a runtime
 * branch in every load. Threads share the rows when the call touches over 65536 elements. */
#define FOR_ROWS_BY_DTYPE(bf16, rows, elements, fn, ...)                                      \
    do {                                                                                     \
        const int64_t rows_ = (rows);                                                        \
        const int parallel_ = (elements) > 65536;                                            \
        if (bf16) {                                                                          \
            _Pragma("omp parallel for schedule(static) if (parallel_)")                      \
            for (int64_t r_ = 0; r_ < rows_; r_++) fn(__VA_ARGS__, r_, 1);                   \
        } else {                                                                             \
            _Pragma("omp parallel for schedule(static) if (parallel_)")                      \
            for (int64_t r_ = 0; r_ < rows_; r_++) fn(__VA_ARGS__, r_, 0);                   \
        }                                                                                    \
    } while (0)

/* Element i of an f32 (bf16 == 0) or bf16 array, widened to f32. */
INLINE float load1(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

/* p[i] = v in an f32 (bf16 == 0) or bf16 array (rounded to nearest even). */
INLINE void store1(void *p, int bf16, int64_t i, float v) {
    if (bf16) ((bf16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* 16 bf16 values widened to f32 (exact). */
INLINE vf bf16v_to_f32(vh h) {
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* v rounded to bf16 and widened back (a store to and load from a bf16 tensor), or v in f32. */
INLINE vf round_to(vf v, int bf16) { return bf16 ? bf16v_to_f32(f32_to_bf16v(v)) : v; }

/* Elements i .. i + 15 of an f32 or bf16 array, widened to f32. */
INLINE vf loadv(const void *p, int bf16, int64_t i) {
    if (!bf16) return *(const vf *)((const float *)p + i);
    return bf16v_to_f32(*(const vh *)((const bf16_t *)p + i));
}

/* p[i .. i + 15] = v in an f32 or bf16 array (rounded to nearest even). */
INLINE void storev(void *p, int bf16, int64_t i, vf v) {
    if (!bf16) {
        memcpy((float *)p + i, &v, sizeof(v));
        return;
    }
    const vh h = f32_to_bf16v(v);
    memcpy((bf16_t *)p + i, &h, sizeof(h));
}

/* bf16 pair products, as AVX512-BF16's vdpbf16ps computes them: a wpair holds 16 lanes of two
 * bf16 each (the even element in the low half). Per lane, acc = fma(odd products) then
 * fma(even products); a product of two bf16 is exact in f32, so each step rounds once. Without
 * the instruction the same steps run as FMAs (equal bits, except that the instruction flushes
 * denormals to zero). */
#if defined(__AVX512BF16__)
typedef __m512bh wpair;
INLINE wpair load_pair(const bf16_t *w) { return (__m512bh)_mm512_loadu_si512(w); }
/* acc += one pair (a_pair: even in the low 16 bits), broadcast, times each lane's pair. */
INLINE vf dot_pair(vf acc, uint32_t a_pair, wpair w) {
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)a_pair), w);
}
/* acc += lane-wise pair products of a and b. */
INLINE vf dot_pairs(vf acc, wpair a, wpair b) { return (vf)_mm512_dpbf16_ps((__m512)acc, a, b); }
/* The pair of f32 rows (even, odd), each rounded to bf16 as f32_to_bf16v rounds. */
INLINE wpair make_pair(vf even, vf odd) {
    const vu pr = __builtin_convertvector(f32_to_bf16v(even), vu) |
                  (__builtin_convertvector(f32_to_bf16v(odd), vu) << 16);
    wpair w;
    memcpy(&w, &pr, sizeof(w));
    return w;
}
#else
typedef struct { vf even, odd; } wpair;
INLINE wpair load_pair(const bf16_t *w) {
    vu u;
    memcpy(&u, w, sizeof(u));
    const vu even = u << 16, odd = u & 0xffff0000u;
    wpair p;
    memcpy(&p.even, &even, sizeof(vf));
    memcpy(&p.odd, &odd, sizeof(vf));
    return p;
}
INLINE vf dot_pair(vf acc, uint32_t a_pair, wpair w) {
    acc = vfma(splat(bf16_to_f32((bf16_t)(a_pair >> 16))), w.odd, acc);
    return vfma(splat(bf16_to_f32((bf16_t)a_pair)), w.even, acc);
}
INLINE vf dot_pairs(vf acc, wpair a, wpair b) {
    acc = vfma(a.odd, b.odd, acc);
    return vfma(a.even, b.even, acc);
}
INLINE wpair make_pair(vf even, vf odd) {
    wpair w;
    w.even = bf16v_to_f32(f32_to_bf16v(even));
    w.odd = bf16v_to_f32(f32_to_bf16v(odd));
    return w;
}
#endif

/* Sum of the 16 lanes in a fixed tree (halves, then quarters, ...), in registers. */
INLINE float lane_sum(vf v) {
    vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* mask ? a : b lane-wise (mask lanes are all ones or all zeros, as vector compares give). */
INLINE vf vselect(vi mask, vf a, vf b) {
    vi ai, bi;
    memcpy(&ai, &a, sizeof(ai));
    memcpy(&bi, &b, sizeof(bi));
    vi r = (mask & ai) | (~mask & bi);
    vf f;
    memcpy(&f, &r, sizeof(f));
    return f;
}

/* exp(x) lane-wise (Cephes expf: range reduction by ln 2, degree-6 polynomial; about 1 ulp).
 * Inputs are clamped to [-87.3, 88.7]: below, the result is ~1e-38 instead of 0 or a denormal. */
INLINE vf vexp(vf x) {
    const vf hi = (vf){0} + 88.7f, lo = (vf){0} - 87.3f;
    x = vselect(x > hi, hi, x);
    x = vselect(x < lo, lo, x);
    vf fx = vfma(x, splat(1.44269504088896341f), splat(0.5f));
    vf fl = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);   /* trunc */
    fl = vselect(fl > fx, fl - 1.0f, fl);                                  /* floor */
    x = vfma(-fl, splat(0.693359375f), x);
    x = vfma(-fl, splat(-2.12194440e-4f), x);
    vf p = splat(1.9875691500e-4f);
    p = vfma(p, x, splat(1.3981999507e-3f));
    p = vfma(p, x, splat(8.3334519073e-3f));
    p = vfma(p, x, splat(4.1665795894e-2f));
    p = vfma(p, x, splat(1.6666665459e-1f));
    p = vfma(p, x, splat(5.0000001201e-1f));
    p = vfma(p * x, x, x) + 1.0f;
    vi e = (__builtin_convertvector(fl, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &e, sizeof(scale));
    return p * scale;
}

/* x[i] = exp(x[i] + shift) for i < n; the tail runs through a padded vector, so every element
 * gets the same arithmetic wherever it sits. */
INLINE void exp_shifted(float *x, int64_t n, float shift) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf v = vexp(*(vf *)(x + i) + shift);
        memcpy(x + i, &v, sizeof(v));
    }
    if (i < n) {
        float tmp[LANES] = {0};
        memcpy(tmp, x + i, (size_t)(n - i) * 4);
        vf v = vexp(*(vf *)tmp + shift);
        memcpy(x + i, &v, (size_t)(n - i) * 4);
    }
}
