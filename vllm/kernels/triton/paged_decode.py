"""Decode attention over the paged cache as two Triton kernels (CUDA): split over the context,
one program per (token, kv head, chunk) for all the query heads of a kv head (tensor cores),
then one program per (token, query head) combines the chunks.

Run on an H100 (2026-11-26): its gpu tests (in test_triton_paged_attention.py) passed, and it
ran the decode benchmark's steps. Also checked under Triton's interpreter against a float64
torch reference (tests/kernels/triton/test_triton_paged_decode.py) and compiled for SM90 and
SM120 (tests/build/test_triton_compile_paged_attention.py).

Layouts and semantics are ``paged_attention``'s decode case (paged_attention.py): token t is
sequence t and attends keys [lo, n), n = seq_lens[t], lo = max(n - W, 0) with a window W; a
row with n = 0 (and no sink) writes zeros.

- ``_decode_partial_kernel``, grid (T, Hkv * S, num_chunks): program (t, g * S + s, c) runs
  HEADS of the GROUP = Hq / Hkv query heads of kv head g, heads [s * HEADS, (s + 1) * HEADS)
  (``decode_heads``: all GROUP, S = 1, unless their rows would pass the shared memory: MLA's
  128 heads of one kv head at D = 576; rows padded to ROWS >= 16 for ``tl.dot``) over keys
  [c * chunk_t, (c + 1) * chunk_t) & [lo, n), ``block_n`` keys per step (a tile of max(16,
  block_n) rows), q cast to the cache's dtype for the dot, online softmax in base 2 from the
  f32 scores times scale * log2(e); it writes the chunk's running max m, sum l and acc [D]
  (f32) to scratch. A chunk with no keys writes (-inf, 0, 0). Its q, K/V and acc tiles hold
  the head dim in one or two power-of-two column tiles (``paged_tiles.head_split``: MLA's
  576 = 512 + 64, not 1024); the scratch keeps one [D] row per (token, head, chunk), which
  the reduce reads in one next_power_of_2(D) vector (a [D] row per program: no tile to save).
- ``_decode_reduce_kernel``, grid (T, Hq): M = max(m_c, sink), L = 2^(sink - M) + sum_c
  l_c 2^(m_c - M), out = sum_c acc_c 2^(m_c - M) / L, chunks added in order.

Batch invariance and CUDA graphs: the grid's num_chunks = ``decode_chunks(max_ctx, block_n)``
with max_ctx = block_tables.shape[1] * block_size, from shapes only; every length is read from
device memory. Each sequence's chunk size comes from its own length alone: chunk_t =
``sequence_chunk(n, base)`` = base * (the power of two that makes cdiv(n, chunk_t) <=
MAX_CHUNKS), base = max(MIN_CHUNK, block_n); it needs at most num_chunks chunks. So a
sequence's bits depend on its own rows only (empty chunks add exact zeros): not on the batch
size, the other rows, nor the table's width (an eager step's tables are as wide as its longest
sequence, a graph's as max_model_len).

Limits: an fp32 cache's f32 tiles grow with the head dim (one plane at D = 1024: 132 KB of
shared memory; D = 576: 75 KB), within SM90's 227 KiB; past SM120's 99 KiB the registry refuses
the backend there (``triton_paged.shared_memory_refusal``, ``fp32_tile_bytes``).

Under the interpreter ``tl.dot`` reads bfloat16 tiles as their uint16 storage: there (only)
bf16 operands are widened to f32 before the dot, exact for the products as on the tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton import interpreting
from vllm.kernels.triton.paged_tiles import (attend_keys, head_cols, key_loop_consts, q_tiles,
                                             store_cols, tile_width)

LOG2E = 1.4426950408889634
MIN_CHUNK = 256                        # keys per chunk of a sequence up to 16 * 256 keys
MAX_CHUNKS = 16                        # chunks per (token, kv head), at most
MAX_CHUNKS_C = tl.constexpr(MAX_CHUNKS)


@triton.jit
def _sequence_chunk(n, base):
    """base * the smallest power of two p with n <= base * p * MAX_CHUNKS (n < 2**40)."""
    p = n * 0 + 1
    for _ in tl.static_range(40):
        p = tl.where(base * p * MAX_CHUNKS_C < n, p * 2, p)
    return base * p


@triton.jit
def head_rows(pid, GROUP: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr,
              TILE_M: tl.constexpr):
    """Program ``pid`` of axis 1 = g * S + s, S = cdiv(GROUP, HEADS): kv head g and, per row r of
    ROWS, whether it is real (token r // HEADS < TILE_M of the tile, head j = s * HEADS +
    r % HEADS < GROUP) and its query head g * GROUP + j (clamped into kv head g's heads, so
    padding rows address a real head: their loads stay in bounds, their stores are masked)."""
    split = (GROUP + HEADS - 1) // HEADS
    g = pid // split
    r = tl.arange(0, ROWS)
    j = (pid % split) * HEADS + r % HEADS
    r_in = (r < TILE_M * HEADS) & (j < GROUP)
    return g, r, r_in, g * GROUP + tl.minimum(j, GROUP - 1)


# stride_bt (an eager step's table width) and num_chunks vary from step to step: specialising
# on their values (1, multiples of 16) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["num_chunks", "stride_bt"])
def _decode_partial_kernel(
        m_ptr, l_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        scale_log2, window, base, num_chunks, stride_qt, stride_qh, stride_bt,
        GROUP: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DB: tl.constexpr, SPLIT_D: tl.constexpr, BLOCK_N: tl.constexpr,
        KEYS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
        PRECISION: tl.constexpr, V_IS_K: tl.constexpr):
    """Program (t, g * S + s, c): (m, l, acc) of query heads g * GROUP + s * HEADS.. over chunk
    c's keys of row t; acc's columns in tiles A and B (paged_tiles.py)."""
    t = tl.program_id(0).to(tl.int64)
    g, r, r_in, h = head_rows(tl.program_id(1), GROUP, HEADS, ROWS, 1)
    c = tl.program_id(2)
    n = tl.load(seq_lens_ptr + t)
    lo = n * 0
    if HAS_WINDOW:
        lo = tl.maximum(n - window, 0)
    chunk = _sequence_chunk(n, base)
    c_lo = tl.maximum(lo, c.to(tl.int64) * chunk)                   # keys [c_lo, c_hi)
    c_hi = tl.minimum(n, (c + 1).to(tl.int64) * chunk)
    d, d_in, d_b, d_b_in = head_cols(HEAD_DIM, BLOCK_D, BLOCK_DB, SPLIT_D)
    q, q_b, acc, acc_b = q_tiles(q_ptr + t * stride_qt + h * stride_qh, r_in, d, d_in, d_b,
                                 d_b_in, k_cache_ptr.dtype.element_ty, ROWS, BLOCK_D, BLOCK_DB,
                                 DOT_F32, SPLIT_D)                   # [ROWS, BLOCK_D(B)]
    table = block_tables_ptr + t * stride_bt
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([ROWS], dtype=tl.float32)
    m, s_sum, acc, acc_b = attend_keys(
        q, q_b, m, s_sum, acc, acc_b, k_cache_ptr, v_cache_ptr, table, c_lo, c_hi, c_lo, c_hi,
        d, d_in, d_b, d_b_in, g * HEAD_DIM, scale_log2, BLOCK_N, KEYS, BLOCK_SIZE,
        NUM_KV_HEADS * HEAD_DIM, False, DOT_F32, PRECISION, V_IS_K, SPLIT_D)
    row = (t * (NUM_KV_HEADS * GROUP) + h) * num_chunks + c          # [ROWS] scratch rows
    tl.store(m_ptr + row, m, mask=r_in)
    tl.store(l_ptr + row, s_sum, mask=r_in)
    store_cols(acc_ptr + row * HEAD_DIM, r_in, d, d_in, d_b, d_b_in, acc, acc_b, SPLIT_D)


@triton.jit(do_not_specialize=["num_chunks"])
def _decode_reduce_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, sinks_ptr, num_chunks,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          HAS_SINKS: tl.constexpr):
    """Program (t, h): out[t, h] [D] from the num_chunks partial (m, l, acc), in chunk order."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row0 = (t * tl.num_programs(1) + h) * num_chunks
    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_DIM
    big_m = tl.load(m_ptr + row0)
    for c in range(1, num_chunks):
        big_m = tl.maximum(big_m, tl.load(m_ptr + row0 + c))
    s_sum = tl.load(l_ptr + row0) * 0.0                              # l >= 0: finite zero
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        big_m = tl.maximum(big_m, sink)
        s_sum = tl.exp2(sink - big_m)
    big_m = tl.where(big_m > float("-inf"), big_m, 0.0)             # no key, no sink: L = 0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for c in range(0, num_chunks):
        w = tl.exp2(tl.load(m_ptr + row0 + c) - big_m)              # empty chunk: exp2(-inf) = 0
        s_sum += tl.load(l_ptr + row0 + c) * w
        a = tl.load(acc_ptr + (row0 + c) * HEAD_DIM + d, mask=d_in, other=0.0)
        acc += a * w
    out = tl.where(s_sum > 0, acc / tl.maximum(s_sum, 1e-30), 0.0)
    tl.store(out_ptr + (t * tl.num_programs(1) + h) * HEAD_DIM + d,
             out.to(out_ptr.dtype.element_ty), mask=d_in)


def decode_block_n(head_dim: int) -> int:
    """Default keys per step: K and V tiles [BLOCK_N, D_A + D_B] of up to 8K elements, a power
    of two in [16, 64]. By ``tile_width`` (the columns the tiles hold since the head-dim split,
    what their shared memory scales with), not next_power_of_2(D): 8192 // 1024 at D = 576
    was sized for zero columns no tile holds any more."""
    return min(64, max(16, 1 << ((8192 // tile_width(head_dim)).bit_length() - 1)))


def decode_chunks(max_ctx: int, block_n: int, min_chunk: int = MIN_CHUNK) -> tuple[int, int]:
    """(num_chunks, base): base = max(min_chunk, block_n), num_chunks = cdiv(max_ctx, base)
    clamped to [1, MAX_CHUNKS], enough for ``sequence_chunk`` of any length <= max_ctx."""
    for name, x in (("block_n", block_n), ("min_chunk", min_chunk)):
        if x < 1 or x & (x - 1):
            raise ValueError(f"triton paged_decode: {name}={x} must be a power of two")
    if max_ctx < 0:
        raise ValueError(f"triton paged_decode: max_ctx={max_ctx} must be >= 0")
    base = max(min_chunk, block_n)
    return min(MAX_CHUNKS, max(1, triton.cdiv(max_ctx, base))), base


def sequence_chunk(n: int, base: int) -> int:
    """A sequence of n keys is split into chunks of this many keys (``_sequence_chunk``): base
    times the smallest power of two that leaves at most MAX_CHUNKS chunks."""
    p = 1
    while base * p * MAX_CHUNKS < n:
        p *= 2
    return base * p


def decode_launch(head_dim: int, f32_cache: bool) -> dict:
    """Launch options: 4 warps up to a tile width (``tile_width``, D_A + D_B: the f32
    accumulators' columns, what sets their registers per thread) of 128, 8 above; f32 caches
    above 128 unpipelined (1 stage: their cp.async K/V stages would pass SM120's 99 KiB of
    shared memory), else Triton's 3 stages."""
    wide = tile_width(head_dim) > 128
    return dict(num_warps=8 if wide else 4, num_stages=1 if wide and f32_cache else 3)


def heads_per_program(group: int, rows: int) -> int:
    """Query heads of one kv head per program: all ``group`` where their rows (padded to a power
    of two) fit the target ``rows``, else ``rows`` (a power of two: the group is split over
    cdiv(group, rows) programs, each reading the kv head's keys)."""
    return group if triton.next_power_of_2(group) <= rows else rows


def checked_heads(who: str, heads: int, group: int) -> int:
    """``heads`` per program, or ValueError naming ``who`` where it is not in [1, group]."""
    if not 1 <= heads <= group:
        raise ValueError(f"triton {who}: heads={heads} per program must be in [1, {group}] "
                         "(the query heads per kv head)")
    return heads


def decode_heads(group: int, head_dim: int, f32_cache: bool) -> int:
    """``heads_per_program`` for the partial kernel: rows of [ROWS, D_A + D_B] q and
    accumulator tiles (``tile_width``: their registers and shared memory) up to 128 at widths
    <= 128, 64 up to 256, 16 above (MLA's D = 576: 128 heads in one program would need over
    SM90's 227 KiB of shared memory); fp32 caches 32, 16 above 128."""
    width = tile_width(head_dim)
    if f32_cache:
        rows = 32 if width <= 128 else 16
    else:
        rows = 128 if width <= 128 else 64 if width <= 256 else 16
    return heads_per_program(group, rows)


def partial_consts(group: int, num_kv_heads: int, head_dim: int, block_size: int, block_n: int,
                   *, f32_cache: bool, has_window: bool, dot_f32: bool = False,
                   heads: int | None = None, v_is_k: bool = False) -> dict:
    """``_decode_partial_kernel``'s constexprs (also what the compile test builds); ``heads``
    per program, default ``decode_heads``; ``v_is_k`` for a one-plane cache."""
    heads = checked_heads("paged_decode", decode_heads(group, head_dim, f32_cache)
                          if heads is None else heads, group)
    return dict(GROUP=group, HEADS=heads, ROWS=max(16, triton.next_power_of_2(heads)),
                NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size, HAS_WINDOW=has_window,
                **key_loop_consts(head_dim, block_n, f32_cache, dot_f32, v_is_k))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, *, window: int | None = None,
                 sinks: torch.Tensor | None = None, block_n: int | None = None,
                 min_chunk: int = MIN_CHUNK, out: torch.Tensor | None = None,
                 heads: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] (q's dtype): token t attends row t of ``block_tables`` and
    ``seq_lens`` (module docstring). Arguments as checked by ``paged_attention`` (which calls
    this with ``decode_only``, and for a mixed step's decodes); ``block_n`` keys per step
    (default ``decode_block_n(D)``), ``min_chunk`` the smallest chunk (tests pass small ones);
    ``out``: a contiguous [T, Hq, D] tensor to write (e.g. the decodes' rows of a mixed step's
    result), else a new one; ``heads``: query heads per program (default ``decode_heads``).
    No host read: graph-safe."""
    T, Hq, D = q.shape
    Hkv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"triton paged_decode: q has {Hq} heads, not a multiple of the "
                         f"cache's {Hkv} kv heads")
    block_n = decode_block_n(D) if block_n is None else block_n
    num_chunks, base = decode_chunks(block_tables.shape[1] * block_size, block_n, min_chunk)
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"triton paged_decode: out must be a contiguous {q.dtype} "
                         f"{tuple(q.shape)} tensor, got {out.dtype} {tuple(out.shape)}")
    if T == 0:
        return out
    dev = kv_cache.device
    m = torch.empty((T, Hq, num_chunks), dtype=torch.float32, device=dev)     # [T, Hq, C]
    s_sum = torch.empty((T, Hq, num_chunks), dtype=torch.float32, device=dev)
    acc = torch.empty((T, Hq, num_chunks, D), dtype=torch.float32, device=dev)  # [T, Hq, C, D]
    consts = partial_consts(Hq // Hkv, Hkv, D, block_size, block_n,
                            f32_cache=kv_cache.dtype == torch.float32,
                            has_window=window is not None,
                            dot_f32=kv_cache.dtype == torch.bfloat16 and interpreting(),
                            heads=heads, v_is_k=kv_cache.shape[0] == 1)
    launch = decode_launch(D, kv_cache.dtype == torch.float32)
    split = triton.cdiv(Hq // Hkv, consts["HEADS"])
    _decode_partial_kernel[(T, Hkv * split, num_chunks)](
        m, s_sum, acc, q, kv_cache[0], kv_cache[-1], block_tables, seq_lens, scale * LOG2E,
        window or 0, base, num_chunks, q.stride(0), q.stride(1), block_tables.stride(0),
        **consts, **launch)
    _decode_reduce_kernel[(T, Hq)](
        out, m, s_sum, acc, sinks if sinks is not None else m, num_chunks, HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D), HAS_SINKS=sinks is not None,
        num_warps=launch["num_warps"])
    return out
