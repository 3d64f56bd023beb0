"""The key loop the paged decode and prefill kernels share (paged_decode.py, paged_prefill.py),
over a head dim held in one or two power-of-two column tiles.

Run on an H100 (2026-11-26) inside those kernels, whose gpu tests passed. Also checked under
Triton's interpreter and compiled for SM90 and SM120 with those kernels (their tests).

Head dim split (``head_split``): tl.arange and tl.dot need power-of-two widths, and padding D to
next_power_of_2(D) makes every q / K / V / accumulator tile that wide: MLA's absorbed D = 576
(kv_lora 512 + rope 64) padded to 1024 is 44% zero columns (78% more registers, shared memory
and tensor-core work than the data). So D is two column tiles, A = [0, D_A) with D_A the largest
power of two <= D, and B = [D_A, D_A + D_B) masked to D, D_B = next_power_of_2(D - D_A), both
16 at least (tl.dot's K): 576 = 512 + 64, 192 = 128 + 64, 96 = 64 + 32. Scores
= dot(q_A, k_A^T) + dot(q_B, k_B^T) (the second dot accumulates into the first's f32 result),
acc_A [R, D_A] += p @ v_A, acc_B [R, D_B] += p @ v_B; with a one-plane cache (V_IS_K) v_A, v_B
are the key tiles, loaded once. The constexpr SPLIT_D is off where D is a power of two,
wherever the split saves no columns (D = 24: 16 + 16 = next_power_of_2(24)), and where tile B
would have 16 columns (D = 80 = 64 + 16): there its own row offsets and block-table loads (each
tile's load layout gets its own copy) cost more registers than the 48 padded columns (SM90 /
SM120 decode: 187 / 204 registers instead of 118 / 112 under Triton 3.9, 8 B spilled under
3.6). Off, BLOCK_D = next_power_of_2(D), there is no tile B, and the kernels compile to the
one-tile code.
"""
from __future__ import annotations

import triton
import triton.language as tl


def head_split(head_dim: int) -> tuple[int, int]:
    """(D_A, D_B), the column tiles of ``head_dim`` (module docstring); D_B = 0: one tile of
    D_A = next_power_of_2(D) (at least 16) columns."""
    full = max(16, triton.next_power_of_2(head_dim))
    a = max(16, 1 << (max(head_dim, 1).bit_length() - 1))        # largest power of two <= D
    b = max(16, triton.next_power_of_2(head_dim - a)) if head_dim > a else 0
    return (a, b) if b >= 32 and a + b < full else (full, 0)


def tile_width(head_dim: int) -> int:
    """Columns of the kernels' q / K / V / accumulator tiles, D_A + D_B: what their registers
    and shared memory scale with, hence what the default block and warp choices go by."""
    return sum(head_split(head_dim))


def key_loop_consts(head_dim: int, keys: int, f32_cache: bool, dot_f32: bool,
                    v_is_k: bool = False) -> dict:
    """The constexprs ``attend_keys`` and its kernel take (decode and prefill alike): the column
    tiles (BLOCK_D, BLOCK_DB, SPLIT_D; BLOCK_DB = 0 without a split), keys per step in a tile of
    at least 16 rows, the dot's precision (fp32 caches IEEE, not TF32), and whether the cache
    has one plane (values = keys)."""
    block_d, block_db = head_split(head_dim)
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DB=block_db, SPLIT_D=block_db > 0,
                BLOCK_N=max(16, keys), KEYS=keys, DOT_F32=dot_f32,
                PRECISION="ieee" if f32_cache or dot_f32 else "tf32", V_IS_K=v_is_k)


@triton.jit
def head_cols(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DB: tl.constexpr,
              SPLIT_D: tl.constexpr):
    """(d [BLOCK_D], d_in, d_b [BLOCK_DB], d_b_in): the columns of tiles A and B and which are
    < HEAD_DIM; without SPLIT_D, d_b and d_b_in are d and d_in (and go unused)."""
    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_DIM
    d_b, d_b_in = d, d_in
    if SPLIT_D:
        d_b = BLOCK_D + tl.arange(0, BLOCK_DB)
        d_b_in = d_b < HEAD_DIM
    return d, d_in, d_b, d_b_in


@triton.jit
def load_cols(rows, r_in, d, d_in, dtype: tl.constexpr, DOT_F32: tl.constexpr):
    """[R, len(d)] columns d of the rows at pointers ``rows`` [R], as ``dtype`` (then f32 under
    DOT_F32); masked rows and columns read 0."""
    x = tl.load(rows[:, None] + d[None, :], mask=r_in[:, None] & d_in[None, :], other=0.0)
    x = x.to(dtype)
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def store_cols(rows, r_in, d, d_in, d_b, d_b_in, x, x_b, SPLIT_D: tl.constexpr):
    """x [R, len(d)] into columns d of the rows at pointers ``rows`` [R], and x_b into columns
    d_b under SPLIT_D; masked rows and columns are left as they are."""
    tl.store(rows[:, None] + d[None, :], x, mask=r_in[:, None] & d_in[None, :])
    if SPLIT_D:
        tl.store(rows[:, None] + d_b[None, :], x_b, mask=r_in[:, None] & d_b_in[None, :])


@triton.jit
def q_tiles(rows, r_in, d, d_in, d_b, d_b_in, dtype: tl.constexpr, ROWS: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_DB: tl.constexpr, DOT_F32: tl.constexpr,
            SPLIT_D: tl.constexpr):
    """(q [ROWS, BLOCK_D], q_b [ROWS, BLOCK_DB], acc, acc_b zeros in f32 of those shapes): the
    query rows at pointers ``rows`` [ROWS] (to q[t, h, 0]) in the cache's ``dtype``; without
    SPLIT_D, q_b and acc_b are q and acc (unused)."""
    q = load_cols(rows, r_in, d, d_in, dtype, DOT_F32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    q_b, acc_b = q, acc
    if SPLIT_D:
        q_b = load_cols(rows, r_in, d_b, d_b_in, dtype, DOT_F32)
        acc_b = tl.zeros([ROWS, BLOCK_DB], dtype=tl.float32)
    return q, q_b, acc, acc_b


@triton.jit
def attend_keys(q, q_b, m, s_sum, acc, acc_b, k_cache_ptr, v_cache_ptr, table, k_lo, k_hi, lo,
                n, d, d_in, d_b, d_b_in, head_off, scale_log2, BLOCK_N: tl.constexpr,
                KEYS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROW_STRIDE: tl.constexpr,
                ROW_MASK: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
                V_IS_K: tl.constexpr, SPLIT_D: tl.constexpr):
    """The online softmax of q [R, BLOCK_D] (+ q_b [R, BLOCK_DB] under SPLIT_D; in the cache's
    dtype) over keys [k_lo, k_hi) of one kv head (at ``head_off`` in a cache row of ROW_STRIDE
    elements), read through the block table ``table``, KEYS keys per step in tiles of
    BLOCK_N >= KEYS rows, folded into the running (max m [R], sum s_sum [R], acc [R, BLOCK_D],
    acc_b [R, BLOCK_DB]) -> the new four. ROW_MASK: row i keeps only keys [lo[i], n[i]) too (a
    prefill tile's causal / window mask). Scores in log2 units (f32 scores x scale_log2); P
    cast to the cache's dtype for the PV dots; under DOT_F32 the K/V/P operands widened to f32.
    A row with no key so far keeps p = alpha = 0 (no NaN). V_IS_K: a one-plane cache (MLA),
    its key tiles are the value tiles."""
    jj = tl.arange(0, BLOCK_N)
    for start in range(k_lo, k_hi, KEYS):
        j = start + jj                                               # [BLOCK_N] key positions
        j_in = (jj < KEYS) & (j < k_hi)
        block = tl.load(table + j // BLOCK_SIZE, mask=j_in, other=0)
        off = (block * BLOCK_SIZE + j % BLOCK_SIZE) * ROW_STRIDE + head_off
        k = load_cols(k_cache_ptr + off, j_in, d, d_in, k_cache_ptr.dtype.element_ty,
                      DOT_F32)                                       # [BLOCK_N, BLOCK_D]
        v = k
        if not V_IS_K:
            v = load_cols(v_cache_ptr + off, j_in, d, d_in, v_cache_ptr.dtype.element_ty,
                          DOT_F32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SPLIT_D:
            k_b = load_cols(k_cache_ptr + off, j_in, d_b, d_b_in,
                            k_cache_ptr.dtype.element_ty, DOT_F32)  # [BLOCK_N, BLOCK_DB]
            v_b = k_b
            if not V_IS_K:
                v_b = load_cols(v_cache_ptr + off, j_in, d_b, d_b_in,
                                v_cache_ptr.dtype.element_ty, DOT_F32)
            s = tl.dot(q_b, tl.trans(k_b), acc=s, input_precision=PRECISION)
        s = s * scale_log2
        keep = j_in[None, :]
        if ROW_MASK:
            keep = keep & (j[None, :] >= lo[:, None]) & (j[None, :] < n[:, None])
        s = tl.where(keep, s, float("-inf"))                         # [R, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        pv = p.to(v_cache_ptr.dtype.element_ty)                      # the dots' operand
        if DOT_F32:
            pv = pv.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        if SPLIT_D:
            acc_b = acc_b * alpha[:, None] + tl.dot(pv, v_b, input_precision=PRECISION)
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    return m, s_sum, acc, acc_b


@triton.jit
def normalized(acc, s_sum):
    """acc [R, W] / s_sum [R], 0 on rows with s_sum = 0 (no key, no sink: no NaN)."""
    return tl.where(s_sum[:, None] > 0, acc / tl.maximum(s_sum, 1e-30)[:, None], 0.0)
