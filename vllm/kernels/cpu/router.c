/* Softmax top-k routing, the "softmax" scoring of fused_moe/router.py without expert groups,
 * correction bias or routed scaling:
 *   scores = softmax(logits[t]) (f32); ids[t] = the k largest scores, largest first (ties: the
 *   lower expert id first); weights[t] = scores[ids[t]], divided by their sum when renorm.
 * (torch.topk leaves the order of equal scores unspecified.)
 * logits [T, E] f32 or bf16 -> weights [T, k] f32, ids [T, k] int64. The choice is made on the
 * logits, which order the experts exactly as the scores do (softmax is monotonic). */
#include <math.h>
#include <stdint.h>

#include "vec.h"

/* Returns 0; -1 when k is outside [1, E]. */
int topk_softmax(const void *logits, int64_t T, int64_t E, int64_t k, int renorm, int bf16,
                 float *weights, int64_t *ids) {
    if (k < 1 || k > E) return -1;
    /* Rows are independent (a prefill routes thousands of tokens). */
    #pragma omp parallel for schedule(static) if (T * E > 16384)
    for (int64_t t = 0; t < T; t++) {
        float x[E], p[E], mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            x[e] = p[e] = load1(logits, bf16, t * E + e);
            mx = x[e] > mx ? x[e] : mx;
        }
        exp_shifted(p, E, -mx);
        for (int64_t e = 0; e < E; e++) sum += p[e];
        /* Insertion into the k best so far, kept sorted; an equal logit goes after the ones
         * already there, so the lower expert id comes first. */
        int64_t *id = ids + t * k, n = 0;
        for (int64_t e = 0; e < E; e++) {
            if (n == k && !(x[e] > x[id[k - 1]])) continue;
            int64_t i = n < k ? n++ : k - 1;
            for (; i > 0 && x[e] > x[id[i - 1]]; i--) id[i] = id[i - 1];
            id[i] = e;
        }
        float *w = weights + t * k, wsum = 0.0f;
        for (int64_t j = 0; j < k; j++) wsum += (w[j] = p[id[j]] / sum);
        if (renorm)
            for (int64_t j = 0; j < k; j++) w[j] /= wsum;
    }
    return 0;
}
