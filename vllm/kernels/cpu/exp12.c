/* exp12's encoder (expert_cache/link_codec.py has the layout): one expert's bf16 weights into
 * its planes, at load, for every expert of every cached layer with link compression on; and its
 * whole-expert decode (exp12.h), for the CPU's misses of more tokens than gemv16 takes. The
 * torch version moves each weight through about a dozen whole-tensor passes (0.3 GB/s of bf16
 * on the 2-core dev machine); this is one pass per block of 128, split by OpenMP, then a
 * second over the blocks that have escapes.
 *
 *   w [n] bf16 bits (n a multiple of 128) -> lo [n], codes [n / 2], base [n / 128] (uint8),
 *   the escapes' positions and bits, ascending, into esc_idx / esc_bits (room for cap), and
 *   their count into *count. Returns 0; 1 for n not a multiple of 128, 2 out of memory, 3 more
 *   escapes than cap (*count says how many). */
#include <stdint.h>
#include <stdlib.h>

#include "exp12.h"

#define BLK 128
#define ZERO_CODE 14
#define ESCAPE 15

static inline int code_of(uint16_t x, int top) {
    int e = (x >> 7) & 0xFF;
    if (e == 0) return ZERO_CODE;
    return top - e < ZERO_CODE ? top - e : ESCAPE;
}

int exp12_encode(const uint16_t *w, int64_t n, uint8_t *lo, uint8_t *codes, uint8_t *base,
                 int32_t *esc_idx, uint16_t *esc_bits, int64_t cap, int64_t *count) {
    if (n % BLK) return 1;
    int64_t nb = n / BLK;
    int64_t *start = malloc((size_t)(nb + 1) * sizeof(int64_t));
    if (!start) return 2;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const uint16_t *x = w + b * BLK;
        int top = 0, esc = 0;
        for (int i = 0; i < BLK; i++) {
            int e = (x[i] >> 7) & 0xFF;
            top = e > top ? e : top;
        }
        base[b] = (uint8_t)top;
        for (int i = 0; i < BLK; i += 2) {
            int c0 = code_of(x[i], top), c1 = code_of(x[i + 1], top);
            esc += (c0 == ESCAPE) + (c1 == ESCAPE);
            codes[b * (BLK / 2) + i / 2] = (uint8_t)(c0 | (c1 << 4));
            lo[b * BLK + i] = (uint8_t)(((x[i] >> 8) & 0x80) | (x[i] & 0x7F));
            lo[b * BLK + i + 1] = (uint8_t)(((x[i + 1] >> 8) & 0x80) | (x[i + 1] & 0x7F));
        }
        start[b + 1] = esc;
    }
    start[0] = 0;
    for (int64_t b = 0; b < nb; b++) start[b + 1] += start[b];
    *count = start[nb];
    if (start[nb] > cap) {
        free(start);
        return 3;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int64_t k = start[b];
        if (k == start[b + 1]) continue;
        for (int i = 0; i < BLK; i++) {
            int c = (codes[b * (BLK / 2) + i / 2] >> (4 * (i & 1))) & 15;
            if (c == ESCAPE) {
                esc_idx[k] = (int32_t)(b * BLK + i);
                esc_bits[k++] = w[b * BLK + i];
            }
        }
    }
    free(start);
    return 0;
}

/* One expert's planes (exp12_planes, nesc escapes) -> out [n] bf16 bits. Returns 0; 1 for n not
 * a multiple of 128. */
int exp12_decode(const uint8_t *lo, const uint8_t *codes, const uint8_t *base,
                 const int32_t *esc_idx, const uint16_t *esc_bits, int64_t nesc, int64_t n,
                 uint16_t *out) {
    if (n % BLK) return 1;
    const exp12_planes p = {lo, codes, base, esc_idx, esc_bits, nesc};
    const int64_t nb = n / BLK, step = 64;
#pragma omp parallel for schedule(static)
    for (int64_t b0 = 0; b0 < nb; b0 += step)
        exp12_decode_blocks(&p, b0, b0 + step < nb ? b0 + step : nb, out + b0 * BLK);
    return 0;
}
