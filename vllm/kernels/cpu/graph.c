/* Replay of a recorded forward pass (a "CPU graph", the role CUDA graphs play on a GPU): the
 * kernel calls of one decode step, with their pointers and sizes fixed, run from one C call
 * instead of one Python call (and its torch and ctypes work) each.
 *
 * A program is an int64 array of nodes, each [opcode, nargs, args...]. Opcodes are indexes into
 * GRAPH_OPS (graph_op_names() returns it, so Python never hard-codes a number). Arguments are
 * pointers, integers, or a float's 32 bits. A kernel node passes its arguments as the kernel's
 * ctypes call did; the other nodes stand for the few torch ops a decode step makes (residual
 * add, dtype conversion, zero fill, embedding lookup) and compute the same bits as torch.
 * Buffers are never allocated here: the program only names memory its owner keeps alive.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

int moe_expert_pairs(const void *, const void *, const void *, const float *, const int64_t *,
                     void *, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, const void *,
                     const void *, float, float);
int moe_expert_pairs_quant(const void *, const void *, const void *, const float *,
                           const float *, const float *, const float *, const int32_t *,
                           const int32_t *, const float *, const int64_t *, void *, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int, int, const void *,
                           const void *, float, float, int, int64_t, int64_t, int64_t);
int rms_norm(const void *, const void *, void *, int64_t, int64_t, float, int);
int rope_cos_sin(const int64_t *, const float *, float, int64_t, int64_t, float *);
int rotary_embedding(const float *, const void *, const void *, void *, void *, int64_t, int64_t,
                     int64_t, int64_t, int64_t, int);
int dense_linear(const void *, const void *, const void *, void *, int64_t, int64_t, int64_t,
                 int);
int paged_attention(const void *, const void *, const int64_t *, int64_t, int64_t,
                    const int64_t *, const int64_t *, void *, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, float, int, const float *, int64_t, int);
int write_kv_cache(const void *, const void *, const int64_t *, void *, int64_t, int64_t,
                   int64_t);
int topk_softmax(const void *, int64_t, int64_t, int64_t, int, int, float *, int64_t *);
int moe_sum(const void *, void *, int64_t, int64_t, int64_t, int);
int silu_and_mul(const void *, const void *, void *, int64_t, int64_t, int);
int sigmoid_gate_add(const void *, const void *, const void *, void *, int64_t, int64_t, int);
int moe_residency_step(const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t *, int64_t *, int64_t *, int64_t *, int, int64_t *,
                       int64_t *, double *, double *, double *, uint8_t *, const double *,
                       const double *, int64_t, int64_t *, int64_t *, uint8_t *, int64_t *,
                       int64_t);
int expert_copy(const void *, void *, int64_t, const int64_t *, const int64_t *, const uint8_t *,
                int64_t, int64_t, int64_t);

/* In opcode order; the argument counts are what each case below reads. */
static const char GRAPH_OPS[] =
    "moe_expert_pairs,rms_norm,rope_cos_sin,rotary_embedding,dense_linear,paged_attention,"
    "write_kv_cache,topk_softmax,moe_sum,add,convert,zero,embedding,silu_and_mul,"
    "sigmoid_gate_add,moe_residency_step,expert_copy,moe_expert_pairs_quant";
static const int64_t NARGS[] = {17, 7, 6, 11, 8, 19, 7, 8, 6, 5, 5, 2, 6, 6, 7, 26, 9, 27};
#define NUM_OPS ((int64_t)(sizeof(NARGS) / sizeof(NARGS[0])))

const char *graph_op_names(void) { return GRAPH_OPS; }

/* Element codes of the non-kernel nodes: 0 = f32, 1 = bf16 (the kernels' code). */
INLINE float load_elem(const void *p, int64_t code, int64_t i) { return load1(p, code == 1, i); }

/* out = a + b over n elements, as torch adds: in f32, rounded once to the dtype. */
static int add_op(const void *a, const void *b, void *out, int64_t n, int64_t code) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        storev(out, code == 1, i, loadv(a, code == 1, i) + loadv(b, code == 1, i));
    for (; i < n; i++) store1(out, code == 1, i, load_elem(a, code, i) + load_elem(b, code, i));
    return 0;
}

/* dst = src converted between f32 and bf16 (round to nearest even), n elements. */
static int convert_op(const void *src, void *dst, int64_t n, int64_t from, int64_t to) {
    for (int64_t i = 0; i < n; i++) store1(dst, to == 1, i, load_elem(src, from, i));
    return 0;
}

/* out[t] = weight[ids[t]] (rows of row_bytes bytes); -2 when an id is outside [0, rows). */
static int embedding_op(const void *weight, const int64_t *ids, void *out, int64_t n,
                        int64_t row_bytes, int64_t rows) {
    for (int64_t t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= rows) return -2;
    for (int64_t t = 0; t < n; t++)
        memcpy((char *)out + t * row_bytes, (const char *)weight + ids[t] * row_bytes,
               (size_t)row_bytes);
    return 0;
}

#define P(i) ((void *)(intptr_t)a[i])
static int run_node(int64_t op, const int64_t *a) {
    float f, f2;
    switch (op) {
    case 0:
        memcpy(&f, &a[15], sizeof(f));
        memcpy(&f2, &a[16], sizeof(f2));
        return moe_expert_pairs(P(0), P(1), P(2), P(3), P(4), P(5), a[6], a[7], a[8], a[9],
                                a[10], (int)a[11], (int)a[12], P(13), P(14), f, f2);
    case 1:
        memcpy(&f, &a[5], sizeof(f));
        return rms_norm(P(0), P(1), P(2), a[3], a[4], f, (int)a[6]);
    case 2:
        memcpy(&f, &a[2], sizeof(f));
        return rope_cos_sin(P(0), P(1), f, a[3], a[4], P(5));
    case 3:
        return rotary_embedding(P(0), P(1), P(2), P(3), P(4), a[5], a[6], a[7], a[8], a[9],
                                (int)a[10]);
    case 4:
        return dense_linear(P(0), P(1), P(2), P(3), a[4], a[5], a[6], (int)a[7]);
    case 5:
        memcpy(&f, &a[14], sizeof(f));
        return paged_attention(P(0), P(1), P(2), a[3], a[4], P(5), P(6), P(7), a[8], a[9], a[10],
                               a[11], a[12], a[13], f, (int)a[15], P(16), a[17], (int)a[18]);
    case 6:
        return write_kv_cache(P(0), P(1), P(2), P(3), a[4], a[5], a[6]);
    case 7:
        return topk_softmax(P(0), a[1], a[2], a[3], (int)a[4], (int)a[5], P(6), P(7));
    case 8:
        return moe_sum(P(0), P(1), a[2], a[3], a[4], (int)a[5]);
    case 9:
        return add_op(P(0), P(1), P(2), a[3], a[4]);
    case 10:
        return convert_op(P(0), P(1), a[2], a[3], a[4]);
    case 11:
        memset(P(0), 0, (size_t)a[1]);
        return 0;
    case 12:
        return embedding_op(P(0), P(1), P(2), a[3], a[4], a[5]);
    case 13:
        return silu_and_mul(P(0), P(1), P(2), a[3], a[4], (int)a[5]);
    case 14:
        return sigmoid_gate_add(P(0), P(1), P(2), P(3), a[4], a[5], (int)a[6]);
    case 15:
        return moe_residency_step(P(0), P(1), a[2], a[3], a[4], a[5], a[6], P(7), P(8), P(9),
                                  P(10), (int)a[11], P(12), P(13), P(14), P(15), P(16), P(17),
                                  P(18), P(19), a[20], P(21), P(22), P(23), P(24), a[25]);
    case 16:
        return expert_copy(P(0), P(1), a[2], P(3), P(4), P(5), a[6], a[7], a[8]);
    case 17:
        memcpy(&f, &a[21], sizeof(f));
        memcpy(&f2, &a[22], sizeof(f2));
        return moe_expert_pairs_quant(P(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7), P(8),
                                      P(9), P(10), P(11), a[12], a[13], a[14], a[15], a[16],
                                      (int)a[17], (int)a[18], P(19), P(20), f, f2, (int)a[23],
                                      a[24], a[25], a[26]);
    }
    return -3;
}
#undef P

/* Runs the program's nodes in order. Returns 0; or the first failing node's code (a kernel's
 * nonzero return, -3 for a malformed node) with its index in *failed_node. */
int run_graph(const int64_t *prog, int64_t len, int64_t *failed_node) {
    int64_t node = 0;
    for (int64_t i = 0; i < len; node++) {
        const int64_t op = prog[i], nargs = i + 1 < len ? prog[i + 1] : -1;
        const int rc = op < 0 || op >= NUM_OPS || nargs != NARGS[op] || i + 2 + nargs > len
                       ? -3 : run_node(op, prog + i + 2);
        if (rc) {
            *failed_node = node;
            return rc;
        }
        i += 2 + nargs;
    }
    return 0;
}
