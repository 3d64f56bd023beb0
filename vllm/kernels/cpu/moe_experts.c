/* CPU expert MLPs for (token, k) pairs: the apply_pairs contract of fused_moe.
 *
 *   out[t, k, :] = topk_w[t, k] * down(act(gate(x[t])) * up(x[t]))   for 0 <= ids[t, k] < G
 *   (other pairs untouched)
 *
 * Layout: x [T, H]; weights prepacked at load (cpu_kernel.prepack): w13 as [H, 2N] (gate
 * columns then up columns) and w2 as [N, H], each in column blocks (see matmul), per expert;
 * ids/topk_w [T, K], out [T, K, H]. x, weights and out share one dtype: f32 or bf16
 * (bf16 is widened to f32; all accumulation is f32).
 *
 * Invariant: a pair's value depends only on x[t], its expert's weights and its weight, never on
 * which other pairs are in the call: every output element is one sequential f32 FMA chain over
 * the input dim, whatever register tile computed it. So a batch split into expert-cache waves,
 * or a token batched with others, gives identical bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16      /* f32 partial sums per dot product: one AVX-512 register */
#define CHUNK 32      /* tokens of one expert processed together (bounds the scratch) */

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                       /* nearest even */
    return (bf16_t)(u >> 16);
}

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));      /* unaligned ok */
typedef uint16_t vh __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

static inline vf load_w(const void *w, int bf16, int64_t i) {
    if (!bf16) return *(const vf *)((const float *)w + i);
    vu u = __builtin_convertvector(*(const vh *)((const bf16_t *)w + i), vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline float weight_at(const void *w, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const bf16_t *)w)[i]) : ((const float *)w)[i];
}

/* y[m * ldy + c] = sum_i a[m * n + i] * wt[i * ldw + c] for m < TM, c < CV * LANES: a register
 * tile of TM tokens x CV vectors of columns. Every output is one sequential FMA chain over
 * i = 0..n-1 (a lane of a vector accumulator), the same chain ``column_tail`` runs, so its
 * bits do not depend on the tile it was computed in. */
#define TM_MAX 4
#define PREFETCH 8
#define CV_MAX 4
static inline __attribute__((always_inline)) void tile(const float *a, int TM, const void *wt,
                                                       int bf16, int CV, int64_t n, int64_t ldw,
                                                       float *y, int64_t ldy) {
    vf acc[TM_MAX][CV_MAX];
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) acc[m][v] = (vf){0};
    for (int64_t i = 0; i < n; i++) {
        vf wv[CV_MAX];
        for (int v = 0; v < CV; v++) {
            /* Cold experts stream from DRAM: ask for rows PREFETCH ahead (harmless past the end). */
            __builtin_prefetch((const char *)wt + ((i + PREFETCH) * ldw + v * LANES) * (bf16 ? 2 : 4));
            wv[v] = load_w(wt, bf16, i * ldw + v * LANES);
        }
        for (int m = 0; m < TM; m++) {
            const vf av = (vf){0} + a[m * n + i];
            for (int v = 0; v < CV; v++) acc[m][v] += av * wv[v];
        }
    }
    for (int m = 0; m < TM; m++)
        for (int v = 0; v < CV; v++) memcpy(y + m * ldy + v * LANES, &acc[m][v], sizeof(vf));
}

static inline __attribute__((always_inline)) void column_tail(const float *a, int64_t M, const void *wt, int bf16, int64_t n,
                        int64_t ldw, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += a[m * n + i] * weight_at(wt, bf16, i * ldw);
        y[m * ldy] = s;
    }
}

/* CV * LANES columns of y for every token. */
static inline __attribute__((always_inline)) void columns(const float *a, int64_t M,
                                                          const void *wt, int bf16, int CV,
                                                          int64_t n, int64_t ldw, float *y,
                                                          int64_t ldy) {
    int64_t m = 0;
    for (; m + TM_MAX <= M; m += TM_MAX) tile(a + m * n, TM_MAX, wt, bf16, CV, n, ldw, y + m * ldy, ldy);
    switch (M - m) { /* the last 1-3 tokens in one tile: one more pass over the weights, not 3 */
    case 3: tile(a + m * n, 3, wt, bf16, CV, n, ldw, y + m * ldy, ldy); break;
    case 2: tile(a + m * n, 2, wt, bf16, CV, n, ldw, y + m * ldy, ldy); break;
    case 1: tile(a + m * n, 1, wt, bf16, CV, n, ldw, y + m * ldy, ldy); break;
    default: break;
    }
}

/* y [M, cols] = a [M, n] (f32) @ W [n, cols], W stored in column blocks (see prepack in
 * cpu_kernel.py): block b holds columns [b * BLOCK, b * BLOCK + bw) as a contiguous [n, bw]
 * row-major matrix, bw = BLOCK except for the last block. So every block is one sequential
 * stream from memory, and it stays in L2 while every token passes over it. */
#define BLOCK (CV_MAX * LANES)
static inline __attribute__((always_inline)) void matmul(const float *a, int64_t M, const void *w, int bf16, int64_t n, int64_t cols,
                   float *y) {
    const size_t esz = bf16 ? 2 : 4;
    for (int64_t c = 0; c < cols; c += BLOCK) {
        const int64_t bw = cols - c < BLOCK ? cols - c : BLOCK;
        const char *blk = (const char *)w + (size_t)c * n * esz;
        int64_t v = 0;
        if (bw == BLOCK) {
            columns(a, M, blk, bf16, CV_MAX, n, bw, y + c, cols);
            continue;
        }
        for (; v + LANES <= bw; v += LANES) columns(a, M, blk + v * esz, bf16, 1, n, bw, y + c + v, cols);
        for (; v < bw; v++) column_tail(a, M, blk + v * esz, bf16, n, bw, y + c + v, cols);
    }
}

static inline float activate(float g, int act) {
    if (act == 0) return g / (1.0f + expf(-g));                 /* silu */
    return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)); /* gelu (erf) */
}

/* One expert over M of its pairs: rows of x -> out rows, through f32 scratch. Inlined with a
 * constant bf16 so each dtype gets its own vectorised loops. */
static inline __attribute__((always_inline)) void expert_chunk(const void *x, const void *w13, const void *w2, int bf16,
                         const float *topk_w, const int64_t *pairs, int64_t M, int64_t K,
                         int64_t H, int64_t N, int act, void *out, float *scratch) {
    float *xs = scratch, *gu = xs + CHUNK * H, *h = gu + CHUNK * 2 * N, *y = h + CHUNK * N;
    for (int64_t m = 0; m < M; m++) {
        int64_t t = pairs[m] / K;
        for (int64_t j = 0; j < H; j++)
            xs[m * H + j] = bf16 ? bf16_to_f32(((const bf16_t *)x)[t * H + j])
                                 : ((const float *)x)[t * H + j];
    }
    matmul(xs, M, w13, bf16, H, 2 * N, gu);
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < N; j++)
            h[m * N + j] = activate(gu[m * 2 * N + j], act) * gu[m * 2 * N + N + j];
    matmul(h, M, w2, bf16, N, H, y);
    for (int64_t m = 0; m < M; m++) {
        const float wt = topk_w[pairs[m]];
        for (int64_t j = 0; j < H; j++) {
            const float v = y[m * H + j] * wt;
            if (bf16) ((bf16_t *)out)[pairs[m] * H + j] = f32_to_bf16(v);
            else ((float *)out)[pairs[m] * H + j] = v;
        }
    }
}

/* Returns 0, or -1 when scratch could not be allocated (out is then partly written). */
int moe_expert_pairs(const void *x, const void *w13, const void *w2, const float *topk_w,
                     const int64_t *ids, void *out, int64_t T, int64_t K, int64_t G, int64_t H,
                     int64_t N, int bf16, int act) {
    const int64_t P = T * K;
    int64_t *start = calloc((size_t)G + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(P ? P : 1) * sizeof(int64_t));
    int failed = 0;
    if (!start || !order) { free(start); free(order); return -1; }
    /* Counting sort of valid pairs by expert; stable, so each expert sees ascending pairs. */
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0 && ids[p] < G) start[ids[p] + 1]++;
    for (int64_t e = 0; e < G; e++) start[e + 1] += start[e];
    {
        int64_t *fill = malloc((size_t)G * sizeof(int64_t) + 1);
        if (!fill) { free(start); free(order); return -1; }
        memcpy(fill, start, (size_t)G * sizeof(int64_t));
        for (int64_t p = 0; p < P; p++)
            if (ids[p] >= 0 && ids[p] < G) order[fill[ids[p]]++] = p;
        free(fill);
    }
    const size_t esz = bf16 ? 2 : 4;
    const size_t w13_stride = (size_t)2 * N * H * esz, w2_stride = (size_t)H * N * esz;
    #pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * CHUNK * (size_t)(2 * H + 3 * N));
        if (!scratch) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < G; e++) {
            if (!scratch) continue;
            for (int64_t s = start[e]; s < start[e + 1]; s += CHUNK) {
                const int64_t M = start[e + 1] - s < CHUNK ? start[e + 1] - s : CHUNK;
                const char *e13 = (const char *)w13 + e * w13_stride;
                const char *e2 = (const char *)w2 + e * w2_stride;
                if (bf16)
                    expert_chunk(x, e13, e2, 1, topk_w, order + s, M, K, H, N, act, out, scratch);
                else
                    expert_chunk(x, e13, e2, 0, topk_w, order + s, M, K, H, N, act, out, scratch);
            }
        }
        free(scratch);
    }
    free(start);
    free(order);
    return failed ? -1 : 0;
}

/* Column-block width of the packed weight layout (cpu_kernel.prepack must use the same). */
int moe_pack_block(void) { return BLOCK; }
