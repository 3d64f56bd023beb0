/* The expert cache's per-wave residency step and its miss copy, for CPU graphs and eager steps.
 *
 * moe_residency_step is one call per wave of a cached MoE layer and makes exactly the decisions
 * of the torch reference (expert_cache/residency_step.py: reference_step, over
 * Residency.plan and the policies in policy.py), bit for bit:
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
 *           else -1) are written. An empty W changes no state.
 * Policies (codes as policy.py's kernel_code), state int64 freq/last_use and float64 crf [E]:
 *   0 lru: score = last_use                  on use: last_use = clock
 *   1 lfu: score = freq                      on use: freq += 1
 *   2 lfru: score = freq / (clock - last_use + 1)   on use: freq += 1, last_use = clock
 *   3 lrfu: dt = clock - last_use, p = decay_pow[min(dt, D-1)]:
 *           score = crf * p * params[1] + (1 / (dt + 1)) * params[0]
 *           on use: crf = crf * p + 1, last_use = clock
 * with IEEE double operations in that order (no contraction: the build passes -ffp-contract=off),
 * as torch computes them.
 *
 * Returns 0; -2 when a valid pair's id is >= E (nothing written); -1 when scratch could not be
 * allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { CLOCK, HITS, MISSES, EVICTIONS, LAST_HITS, LAST_MISSES, WAVES, STEP_WAVES };
#define PAD_SLOT_ID (-1)

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

static double keep_score(int policy, int64_t e, int64_t clock, const int64_t *freq,
                         const int64_t *last_use, const double *crf, const double *params,
                         const double *decay_pow, int64_t table_len) {
    switch (policy) {
    case 0:
        return (double)last_use[e];
    case 1:
        return (double)freq[e];
    case 2:
        return (double)freq[e] / (double)(clock - last_use[e] + 1);
    default: {
        const int64_t dt = clock - last_use[e];
        const double p = decay_pow[dt < table_len - 1 ? dt : table_len - 1];
        const double rate = crf[e] * p * params[1];
        return rate + (1.0 / ((double)dt + 1.0)) * params[0];
    }
    }
}

static void on_access(int policy, int64_t e, int64_t clock, int64_t *freq, int64_t *last_use,
                      double *crf, const double *decay_pow, int64_t table_len) {
    if (policy == 1 || policy == 2) freq[e] += 1;
    if (policy == 3) {
        const int64_t dt = clock - last_use[e];
        const double p = decay_pow[dt < table_len - 1 ? dt : table_len - 1];
        const double decayed = crf[e] * p;
        crf[e] = decayed + 1.0;
    }
    if (policy != 1) last_use[e] = clock;
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

int moe_residency_step(const int64_t *ids, const int64_t *row_slots, int64_t T, int64_t K,
                       int64_t E, int64_t N, int64_t wave, int64_t *slot_of_expert,
                       int64_t *expert_of_slot, int64_t *wave_of_expert, int64_t *counters,
                       int policy, int64_t *freq, int64_t *last_use, double *crf,
                       const double *params, const double *decay_pow, int64_t table_len,
                       int64_t *plan_slots, int64_t *plan_experts, uint8_t *plan_valid,
                       int64_t *slot_ids) {
    const int64_t P = T * K;
    if (wave == 0) {
        const int rc = assign_waves(ids, row_slots, P, K, E, N, slot_of_expert, wave_of_expert,
                                    counters);
        if (rc) return rc;
    }
    for (int64_t i = 0; i < N; i++) plan_slots[i] = plan_experts[i] = -1;
    memset(plan_valid, 0, (size_t)N);
    int64_t hits = 0, misses = 0, evictions = 0;
    for (int64_t e = 0; e < E; e++)
        if (wave_of_expert[e] == wave) {
            if (slot_of_expert[e] >= 0) hits++;
            else plan_experts[misses++] = e;        /* misses in expert-id order */
        }
    if (hits + misses) {
        const int64_t clock = counters[CLOCK];
        int64_t empty = 0;
        for (int64_t s = 0; s < N && empty < misses; s++)
            if (expert_of_slot[s] < 0) plan_slots[empty++] = s;
        if (empty < misses) {                      /* evict: held, not in this wave */
            victim_t *v = malloc(sizeof(victim_t) * (size_t)N);
            if (!v) return -1;
            int64_t n = 0;
            for (int64_t s = 0; s < N; s++) {
                const int64_t e = expert_of_slot[s];
                if (e >= 0 && wave_of_expert[e] != wave)
                    v[n++] = (victim_t){keep_score(policy, e, clock, freq, last_use, crf, params,
                                                   decay_pow, table_len), e, s};
            }
            qsort(v, (size_t)n, sizeof(victim_t), by_score_then_expert);
            for (int64_t i = empty; i < misses; i++) plan_slots[i] = v[i - empty].slot;
            free(v);
        }
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
        for (int64_t e = 0; e < E; e++)
            if (wave_of_expert[e] == wave)
                on_access(policy, e, clock, freq, last_use, crf, decay_pow, table_len);
        counters[LAST_HITS] = hits;
        counters[LAST_MISSES] = misses;
        counters[HITS] += hits;
        counters[MISSES] += misses;
        counters[EVICTIONS] += evictions;
        counters[WAVES] += 1;
        counters[CLOCK] += 1;
    }
    for (int64_t p = 0; p < P; p++)
        slot_ids[p] = pair_valid(ids, row_slots, p, K) && wave_of_expert[ids[p]] == wave
                      ? slot_of_expert[ids[p]] : -1;
    return 0;
}

/* out[e] = keep score of expert e at clock (the scores the step ranks victims by), for tests of
 * their bits against the torch policies. */
int moe_cache_scores(int policy, int64_t E, int64_t clock, const int64_t *freq,
                     const int64_t *last_use, const double *crf, const double *params,
                     const double *decay_pow, int64_t table_len, double *out) {
    for (int64_t e = 0; e < E; e++)
        out[e] = keep_score(policy, e, clock, freq, last_use, crf, params, decay_pow, table_len);
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
