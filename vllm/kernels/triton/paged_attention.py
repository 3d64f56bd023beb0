"""Paged attention as Triton kernels (CUDA): the KV write (vLLM's ``reshape_and_cache``) and the
attention of every query token of a step, decodes and prefill chunks alike, over its context
read in place from the paged cache.

What runs where: ``write_kv_cache`` -> ``_write_kv_kernel``; ``paged_attention`` with
``decode_only`` -> ``paged_decode.paged_decode`` (split-context kernels, all the query heads of
a kv head per program on ``tl.dot``, then a reduce over the chunks); otherwise (mixed or prefill
steps) -> ``paged_prefill.paged_prefill`` (one program per (query tile, kv head), FlashAttention-2
style on ``tl.dot``, over a work list of query tiles built on the host), or with ``tiled=False``
-> ``_paged_attention_kernel`` below, one program per (token, query head) on CUDA cores (the
reference path the tests compare against).

Run on an H100 (2026-11-26): the gpu tests of test_triton_paged_attention.py and
test_triton_paged_prefill.py passed, and the kernels ran in the decode benchmark. Also checked
under Triton's interpreter against a torch reference (tests/kernels/triton/
test_triton_paged_attention.py, test_triton_paged_decode.py, test_triton_paged_prefill.py) and
compiled for SM90 and SM120 (tests/build/test_triton_compile_paged_attention.py,
test_triton_compile_paged_prefill.py).

Layouts (``model_executor/layers/attention/interface.py``, ``forward_context.py``):
- cache [P, num_blocks, block_size, Hkv, D], contiguous; plane 0 = keys, plane 1 = values, or
  P = 1 (``kv_shared``: V = K). Flat slot = block_id * block_size + offset.
- q [T, Hq, D] (last stride 1); query head h reads kv head h // (Hq / Hkv).
- the batch: sequences' tokens contiguous, decodes first; token t of sequence b sits at position
  seq_lens[b] - (query_start_loc[b + 1] - t) and attends keys [lo, position], lo = 0, or
  position + 1 - W with a sliding window W (keys in (p - W, p]).

CUDA graphs: every length is read from device memory inside the kernels (the loops over a
token's keys have device-loaded bounds). With ``decode_only`` token t is sequence t and attends
seq_lens[t] keys; the grids (T, Hkv, num_chunks) and (T, Hq) and the chunk size depend on T and
the buffers' shapes only (paged_decode.py), so a decode step captured for T rows replays for
new lengths and block tables, each row's bits independent of the other rows. Otherwise
(never captured: prefill and mixed steps run eagerly) the tiled kernel's grid is the work list's
length, a host-built list of query tiles (``paged_prefill.query_tiles``; the backend builds it
once per step from the metadata's host lists); without one, ``paged_attention`` builds it from
``query_start_loc`` with ONE host read (a sync). Entries of query_start_loc past the real
sequences must be >= T (e.g. a padded buffer filled with T): they get no tiles. The per-token
kernel (``tiled=False``) finds each token's sequence on the device by counting the
query_start_loc[1:] entries <= t, with no host read. A row of length 0 writes zeros (no NaN).

Softmax: online, in fp32, base 2 (here q is pre-scaled by scale * log2(e); the decode and
prefill kernels scale the f32 scores); with sinks the running max and sum start at (sink_h, 1),
i.e. exp(sink_h) joins the denominator with no value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.paged_decode import paged_decode
from vllm.kernels.triton.paged_prefill import QueryTiles, paged_prefill

PAD_SLOT_ID = tl.constexpr(-1)       # forward_context.PAD_SLOT_ID, as a constexpr
LOG2E = 1.4426950408889634
NUM_WARPS = 4
BLOCK_B = 64                          # query_start_loc entries per step of a token's row search
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_slots,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_V: tl.constexpr):
    """Program (t, h): k[t, h] (and v[t, h]) -> slot slot_mapping[t] of the cache planes, unless
    the slot is PAD_SLOT_ID (or outside the cache: a launch cannot raise)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    # [BLOCK_D] copies of the slot: the interpreter mis-types a vector & scalar mask.
    slot = tl.load(slot_ptr + t) + tl.zeros([BLOCK_D], dtype=tl.int64)
    mask = (d < HEAD_DIM) & (slot != PAD_SLOT_ID) & (slot >= 0) & (slot < num_slots)
    dst = (slot * NUM_KV_HEADS + h) * HEAD_DIM + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if HAS_V:
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_context(t, qsl_ptr, seq_lens_ptr, B, DECODE_ONLY: tl.constexpr,
                   BLOCK_B: tl.constexpr):
    """(row, n): token t's sequence (block-table row) and how many keys it attends (its
    position + 1), both from device memory."""
    if DECODE_ONLY:
        row = t
        n = tl.load(seq_lens_ptr + t)
    else:
        row = t * 0
        for b0 in range(0, B, BLOCK_B):                 # row = #{b < B: qsl[b + 1] <= t}
            b = b0 + tl.arange(0, BLOCK_B)
            ends = tl.load(qsl_ptr + 1 + b, mask=b < B, other=0)
            row += tl.sum(((b < B) & (ends <= t)).to(tl.int64), axis=0)
        n = tl.load(seq_lens_ptr + row) - (tl.load(qsl_ptr + row + 1) - t) + 1
    return row, n


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        sinks_ptr, scale_log2, window, B, stride_qt, stride_qh, stride_bt,
        GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_B: tl.constexpr, DECODE_ONLY: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    """Program (t, h): out[t, h] [D] = softmax over keys [lo, n) of token t's sequence."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row, n = _token_context(t, qsl_ptr, seq_lens_ptr, B, DECODE_ONLY, BLOCK_B)
    lo = n * 0
    if HAS_WINDOW:
        lo = tl.maximum(n - window, 0)
    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=d_in, other=0.0)
    q = q.to(tl.float32) * scale_log2                              # [BLOCK_D], log2 units
    head_off = (h // GROUP) * HEAD_DIM
    if HAS_SINKS:
        m = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        s_sum = scale_log2 * 0.0 + 1.0                             # exp2(sink - m) = 1
    else:
        m = scale_log2 * 0.0 - float("inf")
        s_sum = scale_log2 * 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + row * stride_bt
    for start in range(lo, n, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)                          # key positions
        j_in = j < n
        block = tl.load(table + j // BLOCK_SIZE, mask=j_in, other=0)
        off = (block * BLOCK_SIZE + j % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + head_off
        kv_mask = j_in[:, None] & d_in[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)         # [BLOCK_N]
        s = tl.where(j_in, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))                   # finite: j_in[0] holds
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        s_sum = s_sum * alpha + tl.sum(p, axis=0)
        m = m_new
    out = tl.where(s_sum > 0, acc / tl.maximum(s_sum, 1e-30), 0.0)
    tl.store(out_ptr + (t * tl.num_programs(1) + h) * HEAD_DIM + d,
             out.to(out_ptr.dtype.element_ty), mask=d_in)


def _fail(what: str, t: torch.Tensor, want: str) -> ValueError:
    return ValueError(f"triton paged_attention: {what} must be {want}, got {t.dtype} "
                      f"{tuple(t.shape)} stride {t.stride()} on {t.device}")


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] not in (1, 2) or not kv_cache.is_contiguous() \
            or kv_cache.dtype not in DTYPES:
        raise _fail("kv_cache", kv_cache, "a contiguous [1 or 2, num_blocks, block_size, Hkv, D] "
                    "float16/bfloat16/float32 tensor")


def _check_rows(x: torch.Tensor, what: str, kv_cache: torch.Tensor) -> None:
    """x [T, H, D] on the cache's device with its last stride 1 (rows may be strided)."""
    if x.dim() != 3 or x.shape[2] != kv_cache.shape[4] or x.stride(2) != 1 \
            or x.device != kv_cache.device or x.dtype not in DTYPES:
        raise _fail(what, x, f"a [T, H, {kv_cache.shape[4]}] float tensor on {kv_cache.device} "
                    "with last stride 1")


def _check_index(x: torch.Tensor, what: str, dims: int, device: torch.device) -> None:
    if x.dtype != torch.int64 or x.dim() != dims or x.device != device \
            or x.stride(-1) != 1:
        raise _fail(what, x, f"an int64 {dims}-d tensor on {device} with last stride 1")


def write_kv_cache(k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor,
                   kv_cache: torch.Tensor) -> None:
    """k/v [T, Hkv, D] -> the cache at ``slot_mapping`` [T] int64; PAD_SLOT_ID rows are skipped.
    v None: keys only (any P; a one-plane cache takes no v)."""
    _check_cache(kv_cache)
    _check_rows(k, "k", kv_cache)
    if v is not None:
        _check_rows(v, "v", kv_cache)
        if kv_cache.shape[0] != 2 or v.shape != k.shape:
            raise _fail("v", v, f"None for a one-plane cache, else shaped like k {tuple(k.shape)}")
    _check_index(slot_mapping, "slot_mapping", 1, kv_cache.device)
    T, Hkv, D = k.shape
    if Hkv != kv_cache.shape[3] or slot_mapping.shape[0] != T:
        raise ValueError(f"triton write_kv_cache: k {tuple(k.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not match the cache "
                         f"{tuple(kv_cache.shape)} (need [T, {kv_cache.shape[3]}, {D}] and [T])")
    if T == 0:
        return
    vv = k if v is None else v
    _write_kv_kernel[(T, Hkv)](
        k, vv, kv_cache[0], kv_cache[-1], slot_mapping, kv_cache.shape[1] * kv_cache.shape[2],
        k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), NUM_KV_HEADS=Hkv, HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D), HAS_V=v is not None, num_warps=NUM_WARPS)


def block_n_for(head_dim: int) -> int:
    """Keys per loop step: a [BLOCK_N, BLOCK_D] tile of about 8K elements (4 warps)."""
    return min(64, max(8, 8192 // triton.next_power_of_2(head_dim)))


def _tiled_step(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, window, sinks,
                tiles: QueryTiles | None, block_m: int | None, block_n: int | None,
                num_decodes: int) -> torch.Tensor:
    """A mixed or prefill step: its decodes on the split-context decode kernels (one tile of one
    token each would walk a long context alone), the rest on the tiled kernel."""
    dev, nd = kv_cache.device, num_decodes
    if tiles is not None:
        _check_index(tiles.seq, "tiles.seq", 1, dev)
        _check_index(tiles.start, "tiles.start", 1, dev)
        if tiles.seq.shape != tiles.start.shape:
            raise ValueError(f"triton paged_attention: tiles.seq {tuple(tiles.seq.shape)} and "
                             f"tiles.start {tuple(tiles.start.shape)} must have one entry each "
                             "per tile")
    if block_m is not None and block_m < 1:
        raise ValueError(f"triton paged_attention: block_m={block_m} must be >= 1")
    if not 0 <= nd <= min(q.shape[0], query_start_loc.shape[0] - 1):
        raise ValueError(f"triton paged_attention: num_decodes={nd} must be in [0, "
                         f"{min(q.shape[0], query_start_loc.shape[0] - 1)}]")
    out = paged_prefill(q, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                        window=window, sinks=sinks, tiles=tiles, block_m=block_m,
                        block_n=block_n, skip=nd)
    if nd:
        paged_decode(q[:nd], kv_cache, block_tables[:nd], seq_lens[:nd], scale, window=window,
                     sinks=sinks, block_n=block_n, out=out[:nd])
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    decode_only: bool, window: int | None = None,
                    sinks: torch.Tensor | None = None, block_n: int | None = None,
                    tiles: QueryTiles | None = None, block_m: int | None = None,
                    tiled: bool = True, num_decodes: int = 0) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] (q's dtype) over the paged cache (module docstring).

    block_tables [B, max_blocks], seq_lens [B], query_start_loc [B + 1]: int64 device tensors
    (their sizes may exceed the step's sequences, padded; with ``decode_only`` each of the T
    tokens is its own sequence, B >= T, and query_start_loc is not read). ``window`` W >= 1 or
    None; ``sinks`` [Hq] float32 or None; ``block_n``: keys per loop step, a power of two
    (default ``paged_decode.decode_block_n(D)`` with ``decode_only``, else
    ``paged_prefill.prefill_config``, or ``block_n_for(D)`` with ``tiled=False``; tests pass
    small ones to cross many steps). With ``decode_only``: no host read, safe to capture in a
    CUDA graph. Otherwise ``tiles`` is the tiled kernel's work list
    (``paged_prefill.query_tiles`` with ``block_m`` tokens per tile, default
    ``paged_prefill.prefill_tile_m``); None: built from ``query_start_loc`` with one host read.
    ``num_decodes``: the first sequences are that many one-token decodes (tokens 0..nd-1): they
    run the split-context decode kernels, as in a decode-only step, and ``tiles`` need not cover
    them. ``tiled=False`` runs the per-token reference kernel instead (no host read)."""
    _check_cache(kv_cache)
    _check_rows(q, "q", kv_cache)
    dev = kv_cache.device
    _check_index(block_tables, "block_tables", 2, dev)
    _check_index(seq_lens, "seq_lens", 1, dev)
    _check_index(query_start_loc, "query_start_loc", 1, dev)
    T, Hq, D = q.shape
    Hkv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    B = query_start_loc.shape[0] - 1
    if Hq % Hkv:
        raise ValueError(f"triton paged_attention: q has {Hq} heads, not a multiple of the "
                         f"cache's {Hkv} kv heads")
    if seq_lens.shape[0] < (T if decode_only else B) or block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"triton paged_attention: seq_lens {tuple(seq_lens.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)} do not cover T={T} tokens")
    if block_n is not None and (block_n < 1 or block_n & (block_n - 1)):
        raise ValueError(f"triton paged_attention: block_n={block_n} must be a power of two")
    if window is not None and window < 1:
        raise ValueError(f"triton paged_attention: window={window} must be >= 1 or None")
    if sinks is not None and (sinks.shape != (Hq,) or sinks.dtype != torch.float32
                              or sinks.device != dev):
        raise _fail("sinks", sinks, f"a float32 [{Hq}] tensor on {dev}")
    if decode_only:
        return paged_decode(q, kv_cache, block_tables, seq_lens, scale, window=window,
                            sinks=sinks, block_n=block_n)
    if tiled:
        return _tiled_step(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, window,
                           sinks, tiles, block_m, block_n, num_decodes)
    block_n = block_n_for(D) if block_n is None else block_n
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=dev)
    if T == 0:
        return out
    _paged_attention_kernel[(T, Hq)](
        out, q, kv_cache[0], kv_cache[-1], block_tables, seq_lens, query_start_loc,
        sinks if sinks is not None else q, scale * LOG2E, window or 0, B, q.stride(0),
        q.stride(1), block_tables.stride(0), GROUP=Hq // Hkv, NUM_KV_HEADS=Hkv, HEAD_DIM=D,
        BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n,
        BLOCK_B=BLOCK_B, DECODE_ONLY=decode_only, HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, num_warps=NUM_WARPS)
    return out
