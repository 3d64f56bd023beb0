"""Prefill / mixed-step attention over the paged cache as one query-tiled Triton kernel (CUDA),
FlashAttention-2 style: one program per (query tile, kv head) for all the query heads of the kv
head, QK^T and PV on ``tl.dot``, keys read in place through the block table.

Run on an H100 (2026-11-26): its gpu tests passed, and it ran the decode benchmark's prefills.
Also checked under Triton's interpreter against a float64 torch reference
(tests/kernels/triton/test_triton_paged_prefill.py) and compiled for SM90 and SM120
(tests/build/test_triton_compile_paged_prefill.py).

Layouts and semantics are ``paged_attention``'s non-decode case (paged_attention.py): token t of
sequence b sits at position p = seq_lens[b] - (query_start_loc[b + 1] - t) and attends keys
[lo, p], lo = 0, or max(p + 1 - W, 0) with a sliding window W; sinks join the denominator with
no value; a row with no key (and no sink) writes zeros.

- The work list (``query_tiles``, built on the host: prefill and mixed steps are never captured
  in CUDA graphs): tile i covers tokens [start[i], min(start[i] + tile_m, query_start_loc[b + 1]))
  of sequence b = seq[i], int64 [n_tiles] device tensors; a sequence of L query tokens has
  cdiv(L, tile_m) tiles (none when L = 0), a decode one tile of one token.
- ``_prefill_kernel``, grid (n_tiles, Hkv * S): program (i, g * S + s) holds HEADS of the
  GROUP query heads of kv head g, heads [s * HEADS, (s + 1) * HEADS) (all of them, S = 1,
  unless one token's heads pass the rows target below: MLA's 128 heads of one kv head), in
  ROWS = max(16, next power of two of TILE_M * HEADS) rows, row r = query token r // HEADS of
  the tile, query head g * GROUP + s * HEADS + r % HEADS (rows past TILE_M * HEADS, past the
  group or past the sequence masked). It walks keys
  [k_lo, k_hi), k_lo = the first token's lo (the smallest in the tile), k_hi = the last token's
  p + 1 (the largest), KEYS keys per step in a tile of BLOCK_N = max(16, KEYS) rows; per row the
  causal / window mask, online softmax in fp32, base 2 (f32 scores times scale * log2(e), as
  paged_decode.py); with sinks the running (max, sum) start at (sink_h, 1).

Dot precision, as paged_decode.py: q is cast to the cache's dtype; 16-bit caches multiply on the
tensor cores with f32 accumulation (p cast to the cache's dtype for PV); fp32 caches use
``input_precision="ieee"`` (not TF32, tl.dot's fp32 default on GPUs: fp32 stays fp32-accurate).
Under the interpreter ``tl.dot`` reads bfloat16 tiles as their uint16 storage: there (only)
bf16 operands are widened to f32 before the dot.

Block sizes (``prefill_config``; not tuned, no GPU run yet; chosen by the register use
ptxas/cuobjdump report for the compiled kernels here, Triton 3.9, window and sinks on, on
compiles without the JIT's specialization, which overstate spills: as the JIT specializes a
launch, MHA at D = 128 with window and sinks has none under Triton 3.6 or 3.9, 240 and 219
registers). By the tiles' width W = D_A + D_B (``paged_tiles.tile_width``: the head dim's
column tiles, MLA's 576 = 512 + 64, next_power_of_2(D) where it is not split). 16-bit caches
ROWS (TILE_M * GROUP, padded) 128 for W <= 64, and up to 128 on SM90 (64 on SM120, which
spills at 128), 64 up to 256 (32 on SM120 for two column tiles past 128), 16 above (MLA),
KEYS 64 up to W = 128, 32 up to 576, 16 above, 8 warps when the [ROWS, W] f32 accumulators
hold more than 4K elements, else 4; fp32 caches ROWS 32 up to W = 128 (16 above), KEYS
64 / 32 / 16 at 64 / 128 / above, 8 warps at W <= 64; num_stages 2. TILE_M = target rows //
the next power of two of GROUP, at least 1; a GROUP over the target gets one token per tile
and HEADS = the target (``heads_per_program``). All within SM120's 99 KiB of shared memory:
D = 64, 128 and 256 compile for SM90 and SM120 in fp16, bf16 and fp32, D = 576 in 16-bit at
GQA 16:1, 64:1 and 128:1, D = 192 and 96 in 16-bit
(tests/build/test_triton_compile_paged_prefill.py); fp32 past D = 256 is sized against SM120 in
test_triton_compile_paged_attention.py (the registry refuses what does not fit there). SM90
16-bit tiles of 64+ rows lower to wgmma, SM120's to mma.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from vllm.kernels.triton import interpreting
from vllm.kernels.triton.paged_decode import checked_heads, head_rows, heads_per_program
from vllm.kernels.triton.paged_tiles import (attend_keys, head_cols, key_loop_consts, normalized,
                                             q_tiles, store_cols, tile_width)

LOG2E = 1.4426950408889634


class QueryTiles(NamedTuple):
    """The kernel's work list: tile i = up to ``tile_m`` tokens of sequence seq[i] from token
    start[i]; seq and start int64 [n_tiles] on the cache's device."""
    seq: torch.Tensor
    start: torch.Tensor
    tile_m: int


def query_tiles(query_lens: list[int], tile_m: int, device: torch.device | str,
                skip: int = 0, upload: Callable[[torch.Tensor, torch.device], torch.Tensor]
                | None = None) -> QueryTiles:
    """Tiles of up to ``tile_m`` consecutive query tokens of one sequence, from the host list of
    query lengths per sequence (tokens of a sequence contiguous, in sequence order, the first
    at token 0); the first ``skip`` sequences (decodes run elsewhere) get none. ``upload``
    moves the host work list to ``device`` (the platform's ``Platform.upload``, which knows
    where pinning is allowed: not under WSL); default ``_upload``, which pins for any GPU."""
    if tile_m < 1:
        raise ValueError(f"triton paged_prefill: tile_m={tile_m} must be >= 1")
    seq: list[int] = []
    start: list[int] = []
    first = sum(query_lens[:skip])
    for b, n in enumerate(query_lens[skip:], start=skip):
        tiles = range(first, first + n, tile_m)
        seq += [b] * len(tiles)
        start += tiles
        first += n
    both = (upload or _upload)(torch.tensor([seq, start], dtype=torch.int64),
                               torch.device(device))                 # [2, n_tiles], one copy
    return QueryTiles(both[0], both[1], tile_m)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ``t`` on ``device``; to a GPU through pinned memory without blocking (a plain copy
    of a host list would drain the stream in the middle of the step's layers)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def query_tiles_from_device(query_start_loc: torch.Tensor, num_tokens: int,
                            tile_m: int, skip: int = 0) -> QueryTiles:
    """``query_tiles`` from the device's query_start_loc [B + 1]: ONE host read (a sync). Entries
    past the real sequences (>= T, a padded buffer) are clamped to T: no tiles; nor do the first
    ``skip`` sequences get any (decodes the caller runs elsewhere)."""
    starts = query_start_loc.clamp(max=num_tokens).tolist()
    lens = [max(e - s, 0) for s, e in zip(starts[:-1], starts[1:])]
    return query_tiles(lens, tile_m, query_start_loc.device, skip)


def prefill_config(head_dim: int, group: int, f32_cache: bool, sm: int = 90) -> dict:
    """Default tile shape and launch options for D = ``head_dim``, GROUP query heads per kv head,
    compute capability ``sm`` (90, 120; module docstring): TILE_M tokens per tile, HEADS query
    heads per program, ROWS, KEYS per step, num_warps, num_stages. Chosen so ptxas spills no
    registers at GQA 1:1 to 8:1. Sized by the tiles' real width ``tile_width`` (D_A + D_B
    columns since the head-dim split, paged_tiles.py), which sets their registers and shared
    memory: at D = 576 the [ROWS, 576] accumulators, not [ROWS, 1024]."""
    width = tile_width(head_dim)
    if f32_cache:                                     # f32 Q/K/V tiles: fewer rows and keys
        rows = 32 if width <= 128 else 16
        keys = 64 if width <= 64 else 32 if width <= 128 else 16
        warps = 8 if width <= 64 else 4
    else:
        # SM120 (64K registers per SM, no wgmma) spills at 128 rows x 128 dims, and at 64 rows
        # of two column tiles past 128 (D = 192: 255 registers, 120 B spilled).
        split = width & (width - 1) != 0
        rows = 128 if width <= 64 or (width <= 128 and sm < 100) else \
            64 if width <= 256 and not (split and width > 128 and sm >= 100) else \
            32 if width <= 256 else 16
        # K/V tiles [KEYS, width]: at MLA's 576 columns 32 keys (36 KB in 16 bit, about the
        # [16, 1024] tile the padded head dim had; 16 keys there spill on SM120).
        keys = 64 if width <= 128 else 32 if width <= 576 else 16
        warps = 8 if rows * width > 4096 else 4          # powers of two: >= 8192
    heads = heads_per_program(group, rows)
    tile_m = max(1, rows // triton.next_power_of_2(heads))
    rows = max(16, triton.next_power_of_2(tile_m * heads))
    return dict(TILE_M=tile_m, HEADS=heads, ROWS=rows, KEYS=keys, num_warps=warps,
                num_stages=2)


@functools.cache
def _sm(device: torch.device) -> int:
    """The device's compute capability as 90, 120, ...; 90 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def prefill_tile_m(head_dim: int, group: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> int:
    """Tokens per tile of the default config on ``device``: what ``query_tiles`` must be built
    with."""
    return prefill_config(head_dim, group, dtype == torch.float32,
                          _sm(torch.device(device)))["TILE_M"]


@triton.jit
def _tile_rows(tile_seq_ptr, tile_start_ptr, qsl_ptr, seq_lens_ptr, window,
               GROUP: tl.constexpr, HEADS: tl.constexpr, TILE_M: tl.constexpr,
               ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Tile program_id(0), heads program_id(1): the kv head g, the sequence b; per row [ROWS]
    the token t, query head h, whether the row is real (r_in) and its keys [lo, n) (n = 0 for a
    padded row); the tile's keys [k_lo, k_hi), k_lo = its first token's lo (the smallest),
    k_hi = its last token's n."""
    b = tl.load(tile_seq_ptr + tl.program_id(0))
    t0 = tl.load(tile_start_ptr + tl.program_id(0))                 # int64: the first token
    q_end = tl.load(qsl_ptr + b + 1)                                  # one past b's last token
    ctx = tl.load(seq_lens_ptr + b)
    g, r, r_in, h = head_rows(tl.program_id(1), GROUP, HEADS, ROWS, TILE_M)   # h < Hq
    t = t0 + r // HEADS                                               # [ROWS] tokens
    r_in = r_in & (t < q_end)
    n = tl.where(r_in, ctx - (q_end - t) + 1, 0)                      # position + 1
    k_hi = ctx - (q_end - tl.minimum(t0 + TILE_M, q_end))
    lo = n * 0
    k_lo = ctx * 0
    if HAS_WINDOW:
        lo = tl.maximum(n - window, 0)
        k_lo = tl.maximum(ctx - (q_end - t0) + 1 - window, 0)
    return g, b, t, h, r_in, lo, n, k_lo, k_hi


# stride_bt (the step's widest table) varies from step to step: specialising on its value
# (1, multiples of 16) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        tile_seq_ptr, tile_start_ptr, sinks_ptr, scale_log2, window, stride_qt, stride_qh,
        stride_bt, GROUP: tl.constexpr, HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DB: tl.constexpr, SPLIT_D: tl.constexpr, TILE_M: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, KEYS: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_F32: tl.constexpr,
        PRECISION: tl.constexpr, V_IS_K: tl.constexpr):
    """Program (i, g * S + s): out rows of tile i's tokens x HEADS query heads of kv head g
    (module docstring), columns in tiles A and B (paged_tiles.py)."""
    g, b, t, h, r_in, lo, n, k_lo, k_hi = _tile_rows(tile_seq_ptr, tile_start_ptr, qsl_ptr,
                                                     seq_lens_ptr, window, GROUP, HEADS, TILE_M,
                                                     ROWS, HAS_WINDOW)
    d, d_in, d_b, d_b_in = head_cols(HEAD_DIM, BLOCK_D, BLOCK_DB, SPLIT_D)
    q, q_b, acc, acc_b = q_tiles(q_ptr + t * stride_qt + h * stride_qh, r_in, d, d_in, d_b,
                                 d_b_in, k_cache_ptr.dtype.element_ty, ROWS, BLOCK_D, BLOCK_DB,
                                 DOT_F32, SPLIT_D)                   # [ROWS, BLOCK_D(B)]
    if HAS_SINKS:
        m = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        s_sum = tl.full([ROWS], 1.0, dtype=tl.float32)               # exp2(sink - m) = 1
    else:
        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        s_sum = tl.zeros([ROWS], dtype=tl.float32)
    table = block_tables_ptr + b * stride_bt
    m, s_sum, acc, acc_b = attend_keys(
        q, q_b, m, s_sum, acc, acc_b, k_cache_ptr, v_cache_ptr, table, k_lo, k_hi, lo, n, d,
        d_in, d_b, d_b_in, g * HEAD_DIM, scale_log2, BLOCK_N, KEYS, BLOCK_SIZE,
        NUM_KV_HEADS * HEAD_DIM, True, DOT_F32, PRECISION, V_IS_K, SPLIT_D)
    dst = out_ptr + (t * (NUM_KV_HEADS * GROUP) + h) * HEAD_DIM      # [ROWS] pointers, int64
    store_cols(dst, r_in, d, d_in, d_b, d_b_in,
               normalized(acc, s_sum).to(out_ptr.dtype.element_ty),
               normalized(acc_b, s_sum).to(out_ptr.dtype.element_ty), SPLIT_D)


def prefill_consts(group: int, num_kv_heads: int, head_dim: int, block_size: int, *,
                   tile_m: int, keys: int, f32_cache: bool, has_window: bool, has_sinks: bool,
                   dot_f32: bool = False, heads: int | None = None,
                   v_is_k: bool = False) -> dict:
    """``_prefill_kernel``'s constexprs (also what the compile test builds); ``heads`` per
    program, default all ``group``; ``v_is_k`` for a one-plane cache."""
    heads = checked_heads("paged_prefill", group if heads is None else heads, group)
    return dict(GROUP=group, HEADS=heads, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size,
                TILE_M=tile_m, ROWS=max(16, triton.next_power_of_2(tile_m * heads)),
                HAS_WINDOW=has_window, HAS_SINKS=has_sinks,
                **key_loop_consts(head_dim, keys, f32_cache, dot_f32, v_is_k))


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                  window: int | None = None, sinks: torch.Tensor | None = None,
                  tiles: QueryTiles | None = None, block_m: int | None = None,
                  block_n: int | None = None, skip: int = 0,
                  heads: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] (q's dtype), arguments as checked by ``paged_attention``
    (which calls this for non-decode steps). ``tiles``: the work list, built with ``block_m``
    tokens per tile (default ``prefill_tile_m``); None builds it from ``query_start_loc`` with
    one host read, without tiles for the first ``skip`` sequences (their rows of the result are
    then left unwritten). ``block_n``: keys per step, a power of two; ``heads``: query heads
    per program (defaults: ``prefill_config``)."""
    T, Hq, D = q.shape
    Hkv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    f32 = kv_cache.dtype == torch.float32
    config = prefill_config(D, Hq // Hkv, f32, _sm(q.device))
    tile_m = config["TILE_M"] if block_m is None else block_m
    if tiles is None:
        tiles = query_tiles_from_device(query_start_loc, T, tile_m, skip)
    if tiles.tile_m != tile_m or tile_m < 1:
        raise ValueError(f"triton paged_prefill: tiles built for tile_m={tiles.tile_m}, the "
                         f"kernel runs tile_m={tile_m}")
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0 or tiles.seq.numel() == 0:
        return out.zero_()
    consts = prefill_consts(Hq // Hkv, Hkv, D, block_size, tile_m=tile_m,
                            keys=config["KEYS"] if block_n is None else block_n, f32_cache=f32,
                            has_window=window is not None, has_sinks=sinks is not None,
                            dot_f32=kv_cache.dtype == torch.bfloat16 and interpreting(),
                            heads=config["HEADS"] if heads is None else heads,
                            v_is_k=kv_cache.shape[0] == 1)
    split = triton.cdiv(Hq // Hkv, consts["HEADS"])
    _prefill_kernel[(tiles.seq.numel(), Hkv * split)](
        out, q, kv_cache[0], kv_cache[-1], block_tables, seq_lens, query_start_loc, tiles.seq,
        tiles.start, sinks if sinks is not None else q, scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), block_tables.stride(0), **consts,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out
