/* The expert cache's residency step (all of a step's waves in one call) and its miss copy, for CPU
 * graphs and eager steps.
 *
 * moe_residency_step plans waves [wave, wave + num_waves) of a cached MoE layer in one call (the
 * provider passes 0 and all W waves of the step: one call per layer) and makes exactly the
 * decisions of the torch reference (expert_cache/residency_step.py: reference_step, over
 * Residency.plan and the policies in policy.py) called once per wave in order, bit for bit:
 *   wave 0: needed[e] = some valid pair routes to e (pairs with id < 0, and every pair of a
 *           padding row, row_slots[t] == PAD_SLOT_ID, route nowhere); needed experts are ranked
 *           resident-first, then by expert id, and rank / N is each one's wave
 *           (wave_of_expert [E], -1 = not needed); counters[STEP_WAVES] = ceil(needed / N).
 *   each wave w: its experts W = {e : wave_of_expert[e] == w} (at most N) are made resident:
 *           hits keep their slots; misses, in expert-id order, take the empty slots in slot order,
 *           then the held slots whose expert is not in W by ascending (keep score, expert id);
 *           the policy state is updated for W at the pre-step clock; counters follow; the
 *           miss list (plan_slots, plan_experts, plan_valid [N], valid entries first, padding
 *           -1 / -1 / 0) and the slot ids [T*K] (slot of the pair's expert when it is in W,
 *           else -1) are written, wave i of the call at offset i*N and i*T*K of those arrays
 *           ([num_waves, N] and [num_waves, T*K]). An empty W changes no state.
 *           Planning a later wave before an earlier wave's experts have run is safe because the
 *           caller copies wave i's misses only after wave i-1's kernels (stream order): the plan
 *           of wave i may name a slot that wave i-1 reads.
 * Policies (codes as policy.py's kernel_code), state int64 freq/last_use and float64 crf [E]:
 *   0 lru: score = last_use                  on use: last_use = clock
 *   1 lfu: score = freq                      on use: freq += 1
 *   2 lfru: score = freq / (clock - last_use + 1)   on use: freq += 1, last_use = clock
 *   3 lrfu: dt = clock - last_use, p = decay_pow[min(dt, D-1)]:
 *           score = crf * p * params[1] + (1 / (dt + 1)) * params[0]
 *           on use: crf = crf * p + 1, last_use = clock
 *   4 lrfu_next: lrfu (3) plus float64 weight [E, E], bias [E] and uint8 prev [E], params [4]:
 *           score = lrfu's + predict(e | the wave) * params[2], where predict(j | G) =
 *           (bias[j] + sum over i in G of weight[i, j]) / 2**32, an exact integer sum;
 *           on a non-empty wave W (learn_next), before lrfu's update: predict(. | prev) ->
 *           delta = rint((([j in W] - predict) * params[3]) / (|prev| + 1) * 2**32), bias and
 *           the rows of prev += delta (clamped to +-2**40), prev = W
 * with IEEE double operations in that order (no contraction: the build passes -ffp-contract=off),
 * as torch computes them.
 *
 * Returns 0; -2 when a valid pair's id is >= E (nothing written); -1 when scratch could not be
 * allocated (the waves before the failing one planned; the caller then trusts no slot).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { CLOCK, HITS, MISSES, EVICTIONS, LAST_HITS, LAST_MISSES, WAVES, STEP_WAVES };
#define PAD_SLOT_ID (-1)
#define LRFU_NEXT 4
#define FIX_ONE 4294967296.0      /* 2**32, lrfu_next's weight unit (policy.py _FIX_ONE) */
#define FIX_MAX 1099511627776.0   /* 2**40, the bound of |weight| and |bias| (_FIX_MAX) */

/* One layer's policy state as the step reads it (policy.py's state names; NULL where the policy
 * has none), with its constants. */
typedef struct {
    int code;                            /* policy.py's kernel_code */
    int64_t E, table_len;                /* experts; decay_pow entries (D) */
    int64_t *freq, *last_use;            /* [E] */
    double *crf;                         /* [E] */
    double *weight, *bias;               /* lrfu_next: [E, E] row-major, [E]; integers */
    uint8_t *prev;                       /* lrfu_next: [E] bool, the last non-empty wave */
    const double *params, *decay_pow;    /* [2] ([4] for lrfu_next), [table_len] */
} policy_t;

typedef struct {
    double score;
    int64_t expert, slot;
} victim_t;

static int by_score_then_expert(const void *pa, const void *pb) {
    const victim_t *a = pa, *b = pb;
    if (a->score < b->score) return -1;
    if (b->score < a->score) return 1;
    return (a->expert > b->expert) - (a->expert < b->expert);
}

/* lrfu_next's predict(j | given[0..n)). Every term is an integer below 2**40 and the sum below
 * 2**53 (policy.py), so any order gives torch's bits (which multiplies by the whole mask). */
static double predict(const policy_t *pol, const int64_t *given, int64_t n, int64_t j) {
    double sum = 0.0;
    for (int64_t k = 0; k < n; k++) sum += pol->weight[given[k] * pol->E + j];
    return (pol->bias[j] + sum) / FIX_ONE;
}

/* Keep score of expert e at clock; lrfu_next's prediction is conditioned on given[0..n). */
static double keep_score(const policy_t *pol, int64_t e, int64_t clock, const int64_t *given,
                         int64_t n) {
    switch (pol->code) {
    case 0:
        return (double)pol->last_use[e];
    case 1:
        return (double)pol->freq[e];
    case 2:
        return (double)pol->freq[e] / (double)(clock - pol->last_use[e] + 1);
    default: {
        const int64_t dt = clock - pol->last_use[e], D = pol->table_len;
        const double p = pol->decay_pow[dt < D - 1 ? dt : D - 1];
        const double rate = pol->crf[e] * p * pol->params[1];
        const double lrfu = rate + (1.0 / ((double)dt + 1.0)) * pol->params[0];
        if (pol->code != LRFU_NEXT) return lrfu;
        return lrfu + predict(pol, given, n, e) * pol->params[2];
    }
    }
}

/* torch.clamp(x, -2**40, 2**40) for a finite x. */
static inline double clamp_fix(double x) {
    return x < -FIX_MAX ? -FIX_MAX : x > FIX_MAX ? FIX_MAX : x;
}

/* lrfu_next's learning step for the non-empty wave W = {e : wave_of_expert[e] == wave}, as
 * policy.py's on_access (scratch: E doubles; prev_ids: E int64). rint rounds half to even, as
 * torch.round (the default rounding mode). */
static void learn_next(const policy_t *pol, const int64_t *wave_of_expert, int64_t wave,
                       double *delta, int64_t *prev_ids) {
    const int64_t E = pol->E;
    int64_t n_prev = 0;
    for (int64_t i = 0; i < E; i++)
        if (pol->prev[i]) prev_ids[n_prev++] = i;
    const double norm = (double)n_prev + 1.0, lr = pol->params[3];
    for (int64_t j = 0; j < E; j++) {
        const double used = wave_of_expert[j] == wave ? 1.0 : 0.0;
        const double err = used - predict(pol, prev_ids, n_prev, j);
        delta[j] = rint(err * lr / norm * FIX_ONE);
        pol->bias[j] = clamp_fix(pol->bias[j] + delta[j]);
    }
    for (int64_t k = 0; k < n_prev; k++) {
        double *row = pol->weight + prev_ids[k] * E;
        for (int64_t j = 0; j < E; j++) row[j] = clamp_fix(row[j] + delta[j]);
    }
    for (int64_t i = 0; i < E; i++) pol->prev[i] = wave_of_expert[i] == wave;
}

/* on_access of the wave's expert e at clock (lrfu_next's learning step is learn_next). */
static void on_access(const policy_t *pol, int64_t e, int64_t clock) {
    if (pol->code == 1 || pol->code == 2) pol->freq[e] += 1;
    if (pol->code >= 3) {
        const int64_t dt = clock - pol->last_use[e], D = pol->table_len;
        const double p = pol->decay_pow[dt < D - 1 ? dt : D - 1];
        const double decayed = pol->crf[e] * p;
        pol->crf[e] = decayed + 1.0;
    }
    if (pol->code != 1) pol->last_use[e] = clock;
}

static inline int pair_valid(const int64_t *ids, const int64_t *row_slots, int64_t p, int64_t K) {
    return ids[p] >= 0 && !(row_slots && row_slots[p / K] == PAD_SLOT_ID);
}

/* Wave 0's work: which wave each needed expert runs in. */
static int assign_waves(const int64_t *ids, const int64_t *row_slots, int64_t P, int64_t K,
                        int64_t E, int64_t N, const int64_t *slot_of_expert,
                        int64_t *wave_of_expert, int64_t *counters) {
    for (int64_t p = 0; p < P; p++)
        if (pair_valid(ids, row_slots, p, K) && ids[p] >= E) return -2;
    for (int64_t e = 0; e < E; e++) wave_of_expert[e] = -1;
    for (int64_t p = 0; p < P; p++)
        if (pair_valid(ids, row_slots, p, K)) wave_of_expert[ids[p]] = 0;   /* needed */
    int64_t rank = 0;
    for (int pass = 0; pass < 2; pass++)            /* resident ones first, then misses */
        for (int64_t e = 0; e < E; e++)
            if (wave_of_expert[e] == 0 && (slot_of_expert[e] >= 0) == (pass == 0))
                wave_of_expert[e] = -2 - rank++;    /* rank, kept apart from "needed" */
    for (int64_t e = 0; e < E; e++)
        if (wave_of_expert[e] <= -2) wave_of_expert[e] = (-2 - wave_of_expert[e]) / N;
    counters[STEP_WAVES] = (rank + N - 1) / N;
    return 0;
}

/* plan_slots[empty..misses): the held slots whose expert is not in the wave, by ascending (keep
 * score, expert id). wave_ids [n_wave]: the wave's experts; v: scratch of N victims. */
static void choose_victims(const policy_t *pol, const int64_t *expert_of_slot,
                           const int64_t *wave_of_expert, int64_t wave, int64_t N, int64_t clock,
                           const int64_t *wave_ids, int64_t n_wave, int64_t empty,
                           int64_t misses, victim_t *v, int64_t *plan_slots) {
    int64_t n = 0;
    for (int64_t s = 0; s < N; s++) {
        const int64_t e = expert_of_slot[s];
        if (e >= 0 && wave_of_expert[e] != wave)
            v[n++] = (victim_t){keep_score(pol, e, clock, wave_ids, n_wave), e, s};
    }
    qsort(v, (size_t)n, sizeof(victim_t), by_score_then_expert);
    for (int64_t i = empty; i < misses; i++) plan_slots[i] = v[i - empty].slot;
}

/* A non-empty wave (n_wave experts, misses of them already in plan_experts): place the misses,
 * update the policy and the counters. Returns 0, or -1 when scratch could not be allocated. */
static int plan_wave(const policy_t *pol, int64_t N, int64_t wave, int64_t *slot_of_expert,
                     int64_t *expert_of_slot, const int64_t *wave_of_expert, int64_t *counters,
                     int64_t n_wave, int64_t misses, int64_t *plan_slots,
                     const int64_t *plan_experts, uint8_t *plan_valid) {
    const int64_t E = pol->E, clock = counters[CLOCK];
    const size_t next = pol->code == LRFU_NEXT ? (size_t)E : 0;   /* learn_next's scratch */
    char *scratch = malloc(sizeof(victim_t) * (size_t)N + (sizeof(int64_t) * 2 +
                                                            sizeof(double)) * next + 1);
    if (!scratch) return -1;
    victim_t *v = (victim_t *)scratch;
    int64_t *ids = (int64_t *)(v + N), *prev_ids = ids + next;     /* [E] each */
    double *delta = (double *)(prev_ids + next);
    int64_t n = 0, empty = 0, evictions = 0;
    for (int64_t e = 0; e < E && next; e++)
        if (wave_of_expert[e] == wave) ids[n++] = e;
    for (int64_t s = 0; s < N && empty < misses; s++)
        if (expert_of_slot[s] < 0) plan_slots[empty++] = s;
    if (empty < misses)                        /* evict: held, not in this wave */
        choose_victims(pol, expert_of_slot, wave_of_expert, wave, N, clock, ids, n, empty,
                       misses, v, plan_slots);
    for (int64_t i = 0; i < misses; i++) {
        const int64_t s = plan_slots[i], old = expert_of_slot[s], e = plan_experts[i];
        if (old >= 0) {
            slot_of_expert[old] = -1;
            evictions++;
        }
        expert_of_slot[s] = e;
        slot_of_expert[e] = s;
        plan_valid[i] = 1;
    }
    if (pol->code == LRFU_NEXT) learn_next(pol, wave_of_expert, wave, delta, prev_ids);
    for (int64_t e = 0; e < E; e++)
        if (wave_of_expert[e] == wave) on_access(pol, e, clock);
    free(scratch);
    counters[LAST_HITS] = n_wave - misses;
    counters[LAST_MISSES] = misses;
    counters[HITS] += n_wave - misses;
    counters[MISSES] += misses;
    counters[EVICTIONS] += evictions;
    counters[WAVES] += 1;
    counters[CLOCK] += 1;
    return 0;
}

/* One wave w (the state after the waves before it); plan [N] and slot_ids [P] are its own. */
static int one_wave(const policy_t *pol, const int64_t *ids, const int64_t *row_slots, int64_t P,
                    int64_t K, int64_t N, int64_t wave, int64_t *slot_of_expert,
                    int64_t *expert_of_slot, const int64_t *wave_of_expert, int64_t *counters,
                    int64_t *plan_slots, int64_t *plan_experts, uint8_t *plan_valid,
                    int64_t *slot_ids) {
    for (int64_t i = 0; i < N; i++) plan_slots[i] = plan_experts[i] = -1;
    memset(plan_valid, 0, (size_t)N);
    int64_t n_wave = 0, misses = 0;
    for (int64_t e = 0; e < pol->E; e++)
        if (wave_of_expert[e] == wave) {
            n_wave++;
            if (slot_of_expert[e] < 0) plan_experts[misses++] = e;   /* misses by expert id */
        }
    if (n_wave && plan_wave(pol, N, wave, slot_of_expert, expert_of_slot, wave_of_expert,
                            counters, n_wave, misses, plan_slots, plan_experts, plan_valid))
        return -1;
    for (int64_t p = 0; p < P; p++)
        slot_ids[p] = pair_valid(ids, row_slots, p, K) && wave_of_expert[ids[p]] == wave
                      ? slot_of_expert[ids[p]] : -1;
    return 0;
}

int moe_residency_step(const int64_t *ids, const int64_t *row_slots, int64_t T, int64_t K,
                       int64_t E, int64_t N, int64_t wave, int64_t *slot_of_expert,
                       int64_t *expert_of_slot, int64_t *wave_of_expert, int64_t *counters,
                       int policy, int64_t *freq, int64_t *last_use, double *crf, double *weight,
                       double *bias, uint8_t *prev, const double *params,
                       const double *decay_pow, int64_t table_len, int64_t *plan_slots,
                       int64_t *plan_experts, uint8_t *plan_valid, int64_t *slot_ids,
                       int64_t num_waves) {
    const policy_t pol = {policy, E, table_len, freq, last_use, crf, weight, bias, prev, params,
                          decay_pow};
    const int64_t P = T * K;
    if (wave == 0) {
        const int rc = assign_waves(ids, row_slots, P, K, E, N, slot_of_expert, wave_of_expert,
                                    counters);
        if (rc) return rc;
    }
    for (int64_t i = 0; i < num_waves; i++)
        if (one_wave(&pol, ids, row_slots, P, K, N, wave + i, slot_of_expert, expert_of_slot,
                     wave_of_expert, counters, plan_slots + i * N, plan_experts + i * N,
                     plan_valid + i * N, slot_ids + i * P))
            return -1;
    return 0;
}

/* out[e] = keep score of expert e at clock (the scores the step ranks victims by; lrfu_next's
 * conditioned on prev, as policy.py's keep_score), for tests of their bits against torch.
 * Returns 0, or -1 when scratch could not be allocated. */
int moe_cache_scores(int policy, int64_t E, int64_t clock, const int64_t *freq,
                     const int64_t *last_use, const double *crf, const double *weight,
                     const double *bias, const uint8_t *prev, const double *params,
                     const double *decay_pow, int64_t table_len, double *out) {
    const policy_t pol = {policy, E, table_len, (int64_t *)freq, (int64_t *)last_use,
                          (double *)crf, (double *)weight, (double *)bias, (uint8_t *)prev,
                          params, decay_pow};
    int64_t *given = malloc(sizeof(int64_t) * (size_t)E + 1), n = 0;
    if (!given) return -1;
    for (int64_t e = 0; e < E && prev; e++)
        if (prev[e]) given[n++] = e;
    for (int64_t e = 0; e < E; e++) out[e] = keep_score(&pol, e, clock, given, n);
    free(given);
    return 0;
}

/* The copy engine's CPU kernel (the contract of expert_cache/copy.py's UvaCopyKernel): for each
 * i < n with valid[i], row slots[i] of dst = row experts[i] of src, rows of row_bytes bytes.
 * Returns -2 (nothing copied) when a valid entry's ids are outside [0, num_src) / [0, num_dst). */
int expert_copy(const void *src, void *dst, int64_t row_bytes, const int64_t *experts,
                const int64_t *slots, const uint8_t *valid, int64_t n, int64_t num_src,
                int64_t num_dst) {
    for (int64_t i = 0; i < n; i++)
        if (valid[i] && (experts[i] < 0 || experts[i] >= num_src || slots[i] < 0 ||
                         slots[i] >= num_dst))
            return -2;
    for (int64_t i = 0; i < n; i++)
        if (valid[i])
            memcpy((char *)dst + slots[i] * row_bytes, (const char *)src + experts[i] * row_bytes,
                   (size_t)row_bytes);
    return 0;
}
