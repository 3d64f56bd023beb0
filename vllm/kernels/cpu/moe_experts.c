/* CPU expert MLPs for (token, k) pairs: the apply_pairs contract of fused_moe.
 *
 *   out[t, k, :] = topk_w[t, k] * (down(act(gate(x[t]) + b13g, up(x[t]) + b13u)) + b2)
 *   for 0 <= ids[t, k] < G (other pairs untouched); the biases are optional (NULL: none).
 *   Non-gated experts (act 3, Nemotron-H): down(relu(up(x[t]) + b13)^2) + b2, same weighting.
 *
 * Layout: x [T, H]; weights prepacked at load (ops.prepack): w13 as [H, 2N] (gate
 * columns then up columns; [H, N], up alone, for act 3) and w2 as [N, H], each in column
 * blocks (see matmul), per expert; biases b13 [G, 2N] (gate then up; [G, N] for act 3) and
 * b2 [G, H] as loaded; ids/topk_w [T, K], out [T, K, H].
 * x, weights, biases and out share one dtype: f32 or bf16 (bf16 products run in pairs as
 * gemm.h says; all accumulation is f32, and the biases are added to the f32 accumulators).
 *
 * Quantized experts (moe_expert_pairs_quant: FP8 e4m3, INT4 GPTQ, NVFP4 and MXFP4,
 * weight-only): the same computation over codes packed by the cpu_kernel backend (layout and
 * dequantization: qgemm.h, qgemm_fp4.h; bf16 activations: qgemm_codes.h (FP8, INT4) and
 * qgemm_codes_fp4.h (NVFP4, MXFP4), scales applied to f32 accumulators), gate and up as two
 * matrices [N, H] (each with its own group table or global scale), down as one [H, N].
 *
 * Invariant: a pair's value depends only on x[t], its expert's weights and its weight, never on
 * which other pairs are in the call: every output element is the one chain over the input dim
 * that gemm.h (or qgemm_codes.h, qgemm_codes_fp4.h) states for its dtype, whatever register
 * tile computed it. So a batch split into expert-cache waves, or a token batched with others,
 * gives identical bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "qgemm.h"
#include "qgemm_codes.h"
#include "qgemm_codes_fp4.h"
#include "qgemm_fp4.h"
#include "vec.h"

#define CHUNK 32      /* tokens of one expert processed together (bounds the scratch) */

/* h[j] = act(gate[j], up[j]) for j < n. act 0: silu(gate) * up; 1: gelu(gate) * up (erf-exact);
 * 2: GPT-OSS's swigluoai: gate clamped above at limit, up to [-limit, limit], then
 * (up + 1) * gate * sigmoid(alpha * gate). silu and swigluoai use the vector exp (tail through
 * a padded vector, so each element's arithmetic is the same wherever it sits). */
INLINE void activate_mul(const float *gate, const float *up, int64_t n, int act, float alpha,
                         float limit, float *h) {
    if (act == 1) {
        for (int64_t j = 0; j < n; j++)
            h[j] = 0.5f * gate[j] * (1.0f + erff(gate[j] * 0.70710678118654752f)) * up[j];
        return;
    }
    const vf lim = splat(limit), neg_lim = splat(-limit);
    for (int64_t j = 0; j < n; j += LANES) {
        const int64_t w = n - j < LANES ? n - j : LANES;
        float g[LANES] = {0}, u[LANES] = {0};
        memcpy(g, gate + j, (size_t)w * 4);
        memcpy(u, up + j, (size_t)w * 4);
        vf gv = *(vf *)g, uv = *(vf *)u, hv;
        if (act == 0) {
            hv = gv / (1.0f + vexp(-gv)) * uv;
        } else {
            gv = vselect(gv > lim, lim, gv);        /* NaN stays NaN, as torch's clamp */
            uv = vselect(uv > lim, lim, vselect(uv < neg_lim, neg_lim, uv));
            hv = (uv + 1.0f) * (gv * (1.0f / (1.0f + vexp(-(gv * alpha)))));
        }
        memcpy(h + j, &hv, (size_t)w * 4);
    }
}

/* h[j] = relu(up[j])^2 for j < n (act 3: not gated). NaN stays NaN, as torch's relu. */
INLINE void relu_squared(const float *up, int64_t n, float *h) {
    for (int64_t j = 0; j < n; j++) {
        const float v = up[j] < 0.0f ? 0.0f : up[j];
        h[j] = v * v;
    }
}

/* v[m * n + j] += bias[j] for m < M, j < n (bias in the kernel's dtype; NULL: nothing). */
INLINE void add_bias(float *v, const void *bias, int bf16, int64_t M, int64_t n) {
    if (!bias) return;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < n; j++) v[m * n + j] += load1(bias, bf16, j);
}

/* One expert's weights as the chunk reads them: packed w13/w2 (unquantized), or quantized
 * matrices 0 (gate; up alone when not gated), 1 (up) and 2 (down): q[] (FP8 / INT4) or f[]
 * (FP4, fp4 != 0). */
typedef struct {
    const void *w13, *w2;      /* NULL when quantized */
    qmat q[3];
    fp4mat f[3];
    int fp4;
    const int32_t *perm[3];    /* INT4 act order: q[h]'s input rows sorted by group, row i of
                                * the packed matrix being input perm[h][i]; NULL: in order */
    void *wbuf;                /* quantized: the thread's BLOCK * max(H, N) f32 block buffer */
    void *pbuf;                /* with perms: CHUNK * max(H, N) f32, the gathered activations */
} expert_w;

/* The quantized GEMMs, one out-of-line copy per format and dtype (a copy inlined at each of
 * the three projections would double the build time and gain nothing: one call per matrix). */
#define QGEMM_COPY(name, fn, mat, bf16)                                                      \
    static __attribute__((noinline)) void name(const void *a, int64_t M, const mat *q,       \
                                               int64_t n, int64_t cols, float *y,            \
                                               int64_t ldy, void *wbuf) {                    \
        fn(a, M, q, bf16, n, cols, y, ldy, wbuf);                                            \
    }
QGEMM_COPY(qmatmul_f32, qmatmul, qmat, 0)
static __attribute__((noinline)) void qmatmul_bf16(const void *a, int64_t M, const qmat *q,
                                                   int64_t n, int64_t cols, float *y,
                                                   int64_t ldy, void *wbuf) {
    qmatmul_bf16_act(a, M, q, n, cols, y, ldy, wbuf);     /* qgemm_codes.h */
}
static __attribute__((noinline)) void fp4_matmul_f32(const void *a, int64_t M, const fp4mat *q,
                                                     int64_t n, int64_t cols, float *y,
                                                     int64_t ldy, void *wbuf) {
    fp4_matmul(a, M, q, n, cols, y, ldy, wbuf);           /* qgemm_fp4.h */
}
static __attribute__((noinline)) void fp4_matmul_bf16(const void *a, int64_t M, const fp4mat *q,
                                                      int64_t n, int64_t cols, float *y,
                                                      int64_t ldy, void *wbuf) {
    fp4_codes_matmul(a, M, q, n, cols, y, ldy, wbuf);     /* qgemm_codes_fp4.h */
}

/* dst [M, n] = a [M, n] with its columns gathered by perm: dst[m, i] = a[m, perm[i]] (a copy,
 * so the same values: the matmul then sums a[perm[i]] * w[perm[i]] in the packed order). */
INLINE const void *gather_columns(const void *a, int bf16, int64_t M, int64_t n,
                                  const int32_t *perm, void *dst) {
    for (int64_t m = 0; m < M; m++) {
        if (bf16) {
            const bf16_t *s = (const bf16_t *)a + m * n;
            bf16_t *d = (bf16_t *)dst + m * n;
            for (int64_t i = 0; i < n; i++) d[i] = s[perm[i]];
        } else {
            const float *s = (const float *)a + m * n;
            float *d = (float *)dst + m * n;
            for (int64_t i = 0; i < n; i++) d[i] = s[perm[i]];
        }
    }
    return dst;
}

/* y [M, cols] (row stride ldy) = a [M, n] @ quantized matrix h of the expert (under act order:
 * a's columns gathered by the matrix's perm first). */
INLINE void qproject(const expert_w *ew, int h, const void *a, int64_t M, int bf16, int64_t n,
                     int64_t cols, float *y, int64_t ldy) {
    if (ew->fp4) {
        (bf16 ? fp4_matmul_bf16 : fp4_matmul_f32)(a, M, &ew->f[h], n, cols, y, ldy, ew->wbuf);
        return;
    }
    if (ew->perm[h]) a = gather_columns(a, bf16, M, n, ew->perm[h], ew->pbuf);
    (bf16 ? qmatmul_bf16 : qmatmul_f32)(a, M, &ew->q[h], n, cols, y, ldy, ew->wbuf);
}

/* gu [M, R] = xs @ w13: [gate | up] columns, or up alone (R = N). */
INLINE void first_projection(const expert_w *ew, const void *xs, int64_t M, int bf16, int64_t H,
                             int64_t N, int64_t R, float *gu) {
    if (ew->w13) {
        matmul(xs, M, ew->w13, bf16, H, R, gu);
        return;
    }
    qproject(ew, 0, xs, M, bf16, H, N, gu, R);
    if (R == 2 * N) qproject(ew, 1, xs, M, bf16, H, N, gu + N, R);
}

/* One expert over M of its pairs: rows of x -> out rows, through scratch. The matmuls take
 * their activations in the weights' dtype (gemm.h), so in bf16 the gathered rows stay bf16 and
 * the hidden activation h is rounded to bf16 (as the model's torch forward rounds it). Inlined
 * with a constant bf16 so each dtype gets its own vectorised loops. */
INLINE void expert_chunk(const void *x, const expert_w *ew, const void *b13,
                         const void *b2, int bf16, const float *topk_w, const int64_t *pairs,
                         int64_t M, int64_t K, int64_t H, int64_t N, int act, float alpha,
                         float limit, void *out, float *scratch) {
    /* scratch: xs [CHUNK, H] (x's dtype), gu [CHUNK, 2N], h [CHUNK, N], y [CHUNK, H] (f32),
     * hb [CHUNK, N] (bf16 h) */
    float *xs = scratch, *gu = xs + CHUNK * H, *h = gu + CHUNK * 2 * N, *y = h + CHUNK * N;
    bf16_t *hb = (bf16_t *)(y + CHUNK * H);
    const size_t esz = bf16 ? 2 : 4;
    for (int64_t m = 0; m < M; m++)
        memcpy((char *)xs + m * H * esz, (const char *)x + pairs[m] / K * H * esz, H * esz);
    const int64_t R = act == 3 ? N : 2 * N;     /* w13 columns: [gate | up], or up alone */
    first_projection(ew, xs, M, bf16, H, N, R, gu);
    add_bias(gu, b13, bf16, M, R);
    if (act == 3)
        relu_squared(gu, M * N, h);
    else
        for (int64_t m = 0; m < M; m++)
            activate_mul(gu + m * 2 * N, gu + m * 2 * N + N, N, act, alpha, limit, h + m * N);
    if (bf16) {
        int64_t j = 0;
        for (; j + LANES <= M * N; j += LANES) storev(hb, 1, j, *(const vf *)(h + j));
        for (; j < M * N; j++) hb[j] = f32_to_bf16(h[j]);
    }
    if (ew->w2) matmul(bf16 ? (const void *)hb : h, M, ew->w2, bf16, N, H, y);
    else qproject(ew, 2, bf16 ? (const void *)hb : h, M, bf16, N, H, y, H);
    add_bias(y, b2, bf16, M, H);
    for (int64_t m = 0; m < M; m++) {
        const float wt = topk_w[pairs[m]];
        int64_t j = 0;
        for (; j + LANES <= H; j += LANES)
            storev(out, bf16, pairs[m] * H + j, *(const vf *)(y + m * H + j) * wt);
        for (; j < H; j++) store1(out, bf16, pairs[m] * H + j, y[m * H + j] * wt);
    }
}

/* A layer's expert weights (rows of every tensor: experts, or cache slots). Quantized:
 * codes in w13/w2 (gate then up in w13), scale (and int4 zero) tables [ng13, R] and [ng2, H]
 * per expert (f32; FP4: bytes), group tables g13 [2, H] and g2 [1, N], per expert (gstride 1)
 * or shared (0; FP4: none, row i is in group i / (H / ng13) or i / (N / ng2)); gstride 2: per
 * expert and followed by the act-order perms, g13 [4, H] (gate, up groups; gate, up perms) and
 * g2 [2, N] (groups; perm), a perm's first entry -1 when its rows are in order. FP4 global
 * scales: z13 [R / N] and z2 [1] per expert (NULL: 1). */
typedef struct {
    const void *w13, *w2;
    const float *s13, *s2, *z13, *z2;
    const int32_t *g13, *g2;
    int64_t ng13, ng2, gstride;
    int qtype;                  /* -1 unquantized, 0 fp8, 1 int4, 2 nvfp4, 3 mxfp4 */
} layer_w;

/* Expert e's FP4 matrices (qtype 2: e4m3 scales, 3: e8m0), codes n * cols / 2 bytes each. */
static void fp4_weights(const layer_w *L, int64_t e, int64_t H, int64_t N, int64_t R,
                        expert_w *ew) {
    const size_t half = (size_t)N * H / 2;
    const uint8_t *w13 = (const uint8_t *)L->w13 + e * (R / N) * half;
    const uint8_t *s13 = (const uint8_t *)L->s13 + e * L->ng13 * R;
    const uint8_t *s2 = (const uint8_t *)L->s2 + e * L->ng2 * H;
    const int e8m0 = L->qtype == 3;
    for (int h = 0; h < 2; h++)
        ew->f[h] = (fp4mat){w13 + h * half, s13 + h * N, L->z13 ? L->z13[e * (R / N) + h] : 1.0f,
                            R, (int)(H / L->ng13), e8m0};
    ew->f[2] = (fp4mat){(const uint8_t *)L->w2 + e * half, s2, L->z2 ? L->z2[e] : 1.0f, H,
                        (int)(N / L->ng2), e8m0};
    ew->fp4 = 1;
}

static expert_w expert_weights(const layer_w *L, int64_t e, int64_t H, int64_t N, int64_t R,
                               int bf16) {
    expert_w ew;
    memset(&ew, 0, sizeof(ew));
    if (L->qtype < 0) {
        const size_t esz = bf16 ? 2 : 4;
        ew.w13 = (const char *)L->w13 + e * (size_t)R * H * esz;
        ew.w2 = (const char *)L->w2 + e * (size_t)H * N * esz;
        return ew;
    }
    if (L->qtype >= 2) {
        fp4_weights(L, e, H, N, R, &ew);
        return ew;
    }
    const int int4 = L->qtype == 1;
    const size_t half = int4 ? (size_t)N * H / 2 : (size_t)N * H;     /* bytes of [N, H] */
    const uint8_t *w13 = (const uint8_t *)L->w13 + e * (R / N) * half;
    const int32_t *g13 = L->g13 + e * L->gstride * 2 * H, *g2 = L->g2 + e * L->gstride * N;
    const int64_t s13 = e * L->ng13 * R, s2 = e * L->ng2 * H;
    for (int h = 0; h < 2; h++)
        ew.q[h] = (qmat){w13 + h * half, L->s13 + s13 + h * N,
                         int4 ? L->z13 + s13 + h * N : NULL, g13 + h * H, R, int4};
    ew.q[2] = (qmat){(const uint8_t *)L->w2 + e * half, L->s2 + s2, int4 ? L->z2 + s2 : NULL,
                     g2, H, int4};
    if (L->gstride == 2 && H > 0 && N > 0) {   /* perms after the groups; -1: rows in order */
        for (int h = 0; h < 2; h++)
            ew.perm[h] = g13[2 * H + h * H] >= 0 ? g13 + 2 * H + h * H : NULL;
        ew.perm[2] = g2[N] >= 0 ? g2 + N : NULL;
    }
    return ew;
}

/* Counting sort of the valid pairs by expert (stable: each expert sees ascending pairs):
 * start [G + 1], order [P]. Returns -1 when out of memory. */
static int sort_pairs(const int64_t *ids, int64_t P, int64_t G, int64_t *start, int64_t *order) {
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < G) start[ids[p] + 1]++;
    for (int64_t e = 0; e < G; e++) start[e + 1] += start[e];
    int64_t *fill = malloc((size_t)G * sizeof(int64_t) + 1);
    if (!fill) return -1;
    memcpy(fill, start, (size_t)G * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < G) order[fill[ids[p]]++] = p;
    free(fill);
    return 0;
}

/* Returns 0, or -1 when scratch could not be allocated (out is then partly written). */
static int run_pairs(const void *x, const layer_w *L, const float *topk_w, const int64_t *ids,
                     void *out, int64_t T, int64_t K, int64_t G, int64_t H, int64_t N, int bf16,
                     int act, const void *b13, const void *b2, float alpha, float limit) {
    const int64_t P = T * K;
    int64_t *start = calloc((size_t)G + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(P ? P : 1) * sizeof(int64_t));
    int failed = 0;
    if (!start || !order || sort_pairs(ids, P, G, start, order)) {
        free(start);
        free(order);
        return -1;
    }
    if (start[G] == 0) {        /* no pair (an empty expert-cache wave): no parallel region */
        free(start);
        free(order);
        return 0;
    }
    const size_t esz = bf16 ? 2 : 4;
    const int64_t R = act == 3 ? N : 2 * N;     /* w13 columns per expert */
    #pragma omp parallel
    {
        const size_t chunk_floats = CHUNK * (size_t)(2 * H + 4 * N);
        const size_t wbuf_floats = L->qtype < 0 ? 0 : BLOCK * (size_t)(H > N ? H : N);
        const size_t pbuf_floats = L->gstride == 2 ? CHUNK * (size_t)(H > N ? H : N) : 0;
        float *scratch = malloc(sizeof(float) * (chunk_floats + wbuf_floats + pbuf_floats));
        if (!scratch) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < G; e++) {
            if (!scratch || start[e] == start[e + 1]) continue;
            expert_w ew = expert_weights(L, e, H, N, R, bf16);
            ew.wbuf = L->qtype < 0 ? NULL : scratch + chunk_floats;
            ew.pbuf = scratch + chunk_floats + wbuf_floats;
            const void *eb13 = b13 ? (const char *)b13 + e * R * esz : NULL;
            const void *eb2 = b2 ? (const char *)b2 + e * H * esz : NULL;
            for (int64_t s = start[e]; s < start[e + 1]; s += CHUNK) {
                const int64_t M = start[e + 1] - s < CHUNK ? start[e + 1] - s : CHUNK;
                if (bf16)
                    expert_chunk(x, &ew, eb13, eb2, 1, topk_w, order + s, M, K, H, N, act,
                                 alpha, limit, out, scratch);
                else
                    expert_chunk(x, &ew, eb13, eb2, 0, topk_w, order + s, M, K, H, N, act,
                                 alpha, limit, out, scratch);
            }
        }
        free(scratch);
    }
    free(start);
    free(order);
    return failed ? -1 : 0;
}

/* Unquantized experts: w13/w2 prepacked (ops.prepack). b13/b2 may be NULL; alpha and limit are
 * read for act 2 only. */
int moe_expert_pairs(const void *x, const void *w13, const void *w2, const float *topk_w,
                     const int64_t *ids, void *out, int64_t T, int64_t K, int64_t G, int64_t H,
                     int64_t N, int bf16, int act, const void *b13, const void *b2, float alpha,
                     float limit) {
    const layer_w L = {w13, w2, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 0, -1};
    return run_pairs(x, &L, topk_w, ids, out, T, K, G, H, N, bf16, act, b13, b2, alpha, limit);
}

/* Quantized experts (qtype 0: fp8 e4m3, 1: int4, 2: nvfp4, 3: mxfp4), packed by the cpu_kernel
 * backend: codes w13 [G, R * H] / w2 [G, H * N] bytes (int4 and FP4: half), scales s13
 * [G, ng13, R], s2 [G, ng2, H] (f32; FP4: e4m3 / e8m0 bytes), int4 zero points z13, z2
 * likewise (f32; NULL for fp8), group tables g13 [2, H] and g2 [1, N] (int32) per expert when
 * gstride is 1, one shared table when 0; gstride 2 (int4, GPTQ act order packed by
 * pack_quantized: codes of input rows sorted by group): per expert g13 [4, H], g2 [2, N], the
 * groups then perm [H] of gate, of up, and [N] of down (packed row i is input row perm[i]; -1
 * first: in order), the activations gathered by each perm before its matrix. FP4: no group
 * tables (g13, g2 unread; groups of H / ng13 and N / ng2 consecutive rows, even, H and N
 * multiples of 16) and z13 [G, R / N], z2 [G, 1] the f32 global scales (NULL: 1). Other
 * arguments as moe_expert_pairs. Returns -2 for a qtype, gstride or FP4 shape outside these. */
int moe_expert_pairs_quant(const void *x, const void *w13, const void *w2, const float *s13,
                           const float *s2, const float *z13, const float *z2,
                           const int32_t *g13, const int32_t *g2, const float *topk_w,
                           const int64_t *ids, void *out, int64_t T, int64_t K, int64_t G,
                           int64_t H, int64_t N, int bf16, int act, const void *b13,
                           const void *b2, float alpha, float limit, int qtype, int64_t ng13,
                           int64_t ng2, int64_t gstride) {
    if (qtype < 0 || qtype > 3 || gstride < 0 || gstride > 2 || (gstride == 2 && qtype != 1))
        return -2;
    if (qtype >= 2 && (H % LANES || N % LANES || ng13 < 1 || ng2 < 1 || H % ng13 ||
                       N % ng2 || (H / ng13) % 2 || (N / ng2) % 2))
        return -2;
    const layer_w L = {w13, w2, s13, s2, z13, z2, g13, g2, ng13, ng2, gstride, qtype};
    return run_pairs(x, &L, topk_w, ids, out, T, K, G, H, N, bf16, act, b13, b2, alpha, limit);
}

/* The combine after the pairs: out[t, :] = sum over k = 0 .. K-1, in that order, of
 * pairs[t, k, :] (f32 accumulation; bf16 rounded once at the end, as torch's sum does).
 * pairs [T, K, H], out [T, H], one dtype. */
int moe_sum(const void *pairs, void *out, int64_t T, int64_t K, int64_t H, int bf16) {
    #pragma omp parallel for schedule(static) if (T * K * H > (1 << 18))
    for (int64_t t = 0; t < T; t++) {
        int64_t h = 0;
        for (; h + LANES <= H; h += LANES) {
            vf s = loadv(pairs, bf16, t * K * H + h);
            for (int64_t k = 1; k < K; k++) s += loadv(pairs, bf16, (t * K + k) * H + h);
            storev(out, bf16, t * H + h, s);
        }
        for (; h < H; h++) {
            float s = load1(pairs, bf16, t * K * H + h);
            for (int64_t k = 1; k < K; k++) s += load1(pairs, bf16, (t * K + k) * H + h);
            store1(out, bf16, t * H + h, s);
        }
    }
    return 0;
}
