"""Pairs grouped by expert for the fused-MoE GEMMs (vLLM's ``moe_align_block_size``), in one
Triton launch where a step has at most ``KERNEL_MAX_PAIRS`` pairs (every decode step a CUDA graph
replays), else in torch ops.

The torch version (``moe_align_block_size_torch``) is about 30 small ops per MoE layer: on a GPU,
30 kernels of a few microseconds each, more than the layer's expert GEMMs at batch 1 and the
largest share of a decode step's launches. The kernel does the same work in one program:

  1. counts[e] over the pairs (one-hot [BLOCK_P, BLOCK_E] sums per chunk of pairs);
  2. each expert's group padded to a multiple of BLOCK_M; padded_end = cumsum; num_padded;
  3. sorted_ids filled with the sentinel P, block_expert[b] = #{e: padded_end[e] <= b * BLOCK_M}
     (torch.searchsorted right), -1 past the last expert;
  4. after a barrier, pair i goes to padded_start[e] + (its rank among expert e's pairs): the
     pairs before its chunk (a running [BLOCK_E] count) plus those before it in its chunk (a
     [BLOCK_P, BLOCK_P] triangular count); a pair's expert-indexed values are read through its
     one-hot row (no gather from registers).

Outputs equal the torch version's exactly (tests/kernels/triton/test_moe_align.py). No host
read; the launch depends on shapes only. Ran on an H100 (2026-11-26) inside the fused-MoE gpu
tests (passed) and the decode benchmark; it has no gpu test of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNEL_MAX_PAIRS = 4096
"""Steps with more pairs (T * K) take the torch version: one program walks the pairs in chunks,
which a long prefill would make slow; decode steps stay far below this."""
ONE_HOT_ELEMENTS = 2048   # BLOCK_P * BLOCK_E per one-hot tile (and BLOCK_FILL * BLOCK_E)
MAX_BLOCK_P = 32          # pairs per chunk: the rank count is a [BLOCK_P, BLOCK_P] tile
BLOCK_FILL = 256          # sorted_ids entries (and at most block_expert entries) per store
# Each tile element is an int64 held in registers: at 4 warps a 2048-element tile is 16 per
# thread (32 registers). The former 8192-element tiles, a [128, 128] rank tile at E <= 64 and
# a [256, BLOCK_E] block_expert tile, put the kernel at 255 registers with 576 (E = 64) to
# 2240 (E = 256) bytes of spills per thread under Triton 3.6, as the JIT specializes a decode
# launch (tests/build/test_triton_compile_moe_routing.py).


def _check(topk_ids: torch.Tensor, block_m: int, num_experts: int,
           max_ids: int | None = None) -> None:
    if max_ids is not None and max_ids < 0:
        raise ValueError(f"moe_align_block_size: max_ids={max_ids} must be >= 0 (or None)")
    if block_m < 1:
        raise ValueError(f"moe_align_block_size: block_m={block_m} must be >= 1")
    if num_experts < 1:
        raise ValueError(f"moe_align_block_size: num_experts={num_experts} must be >= 1")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"moe_align_block_size: topk_ids must be integer, not {topk_ids.dtype}")


def padded_size(P: int, E: int, block_m: int) -> int:
    """S: the worst-case padded pair count, fixed by the shapes alone."""
    return triton.cdiv(P + min(E, P) * (block_m - 1), block_m) * block_m


def groups(num_experts: int, max_ids: int | None) -> int:
    """How many expert groups the padding must allow for: at most ``max_ids`` distinct ids
    (``WaveIds.max_ids``, a caller's promise), else every expert."""
    return num_experts if max_ids is None else min(num_experts, max_ids)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                         max_ids: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, each group padded to a multiple of ``block_m``.

    topk_ids [T, K] (any int dtype; ids outside [0, num_experts) are skipped) -> (sorted_ids
    [S] int64: pair indices t * K + k, ascending within each expert, padding = the sentinel
    P = T * K; block_expert [S // block_m] int64: the expert of each block, -1 past the end;
    num_padded [1] int64: the padded pair count). S = ``padded_size(P, G, block_m)``, G =
    ``groups(E, max_ids)``: ``max_ids`` promises at most that many distinct ids, so a cache's
    last wave (one expert at N = E - 1) gets a short S and the GEMMs a short grid. A broken
    promise drops the pairs whose place falls past S (never a write out of bounds)."""
    P = topk_ids.numel()
    if not 0 < P <= KERNEL_MAX_PAIRS:
        return moe_align_block_size_torch(topk_ids, block_m, num_experts, max_ids)  # checks too
    _check(topk_ids, block_m, num_experts, max_ids)
    E, dev = num_experts, topk_ids.device
    flat = topk_ids.reshape(-1)
    flat = flat if flat.dtype == torch.int64 else flat.to(torch.int64)
    S = padded_size(P, groups(E, max_ids), block_m)
    sorted_ids = torch.empty(S, dtype=torch.int64, device=dev)
    block_expert = torch.empty(S // block_m, dtype=torch.int64, device=dev)
    num_padded = torch.empty(1, dtype=torch.int64, device=dev)
    block_e = triton.next_power_of_2(E)
    block_p, block_fill = launch_blocks(block_e)
    _align_kernel[(1,)](flat, sorted_ids, block_expert, num_padded, P, E, S,
                        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p,
                        BLOCK_FILL=block_fill)
    return sorted_ids, block_expert, num_padded


def launch_blocks(block_e: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_FILL) for BLOCK_E experts: tiles [BLOCK_P, BLOCK_E], [BLOCK_P, BLOCK_P]
    and [BLOCK_FILL, BLOCK_E] of ONE_HOT_ELEMENTS or fewer (16 rows at least: E = 512 makes
    8192). Results do not depend on them, only the loop trip counts."""
    rows = ONE_HOT_ELEMENTS // block_e
    return max(16, min(MAX_BLOCK_P, rows)), max(16, min(BLOCK_FILL, rows))


@triton.jit
def _one_hot(ids_ptr, start, P, E, e, BLOCK_P: tl.constexpr):
    """(i [BLOCK_P] pair indices, key [BLOCK_P], one-hot [BLOCK_P, BLOCK_E] int64) of a chunk;
    a skipped or absent pair has an all-zero row."""
    i = start + tl.arange(0, BLOCK_P)
    key = tl.load(ids_ptr + i, mask=i < P, other=-1)
    return i, key, ((key[:, None] == e[None, :]) & (e[None, :] < E)).to(tl.int64)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, P, E, S,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_FILL: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int64)
    for start in range(0, P, BLOCK_P):
        _, _, hot = _one_hot(ids_ptr, start, P, E, e, BLOCK_P)
        counts += tl.sum(hot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M                 # [BLOCK_E]
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for start in range(0, S, BLOCK_FILL):
        j = start + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ptr + j, tl.zeros([BLOCK_FILL], dtype=tl.int64) + P, mask=j < S)
    num_blocks = S // BLOCK_M
    for start in range(0, num_blocks, BLOCK_FILL):
        b = start + tl.arange(0, BLOCK_FILL)
        ended = (padded_end[None, :] <= (b * BLOCK_M)[:, None]) & (e[None, :] < E)
        owner = tl.sum(ended.to(tl.int64), axis=1)                      # searchsorted, right
        tl.store(block_expert_ptr + b, tl.where(owner < E, owner, -1), mask=b < num_blocks)
    tl.debug_barrier()              # every fill store precedes the scatter below
    seen = tl.zeros([BLOCK_E], dtype=tl.int64)                          # pairs placed so far
    r = tl.arange(0, BLOCK_P)
    for start in range(0, P, BLOCK_P):
        i, key, hot = _one_hot(ids_ptr, start, P, E, e, BLOCK_P)
        before = (key[:, None] == key[None, :]) & (r[None, :] < r[:, None])
        rank = tl.sum(before.to(tl.int64), axis=1) + tl.sum(hot * seen[None, :], axis=1)
        dest = tl.sum(hot * padded_start[None, :], axis=1) + rank
        tl.store(sorted_ptr + dest, i.to(tl.int64), mask=(tl.sum(hot, axis=1) > 0) & (dest < S))
        seen += tl.sum(hot, axis=0)


def moe_align_block_size_torch(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                               max_ids: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align_block_size`` in torch ops (any number of pairs; the kernel's reference)."""
    _check(topk_ids, block_m, num_experts, max_ids)
    E, dev = num_experts, topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)                     # [P]
    P = flat.numel()
    S = padded_size(P, groups(E, max_ids), block_m)
    key = torch.where((flat >= 0) & (flat < E), flat, E)            # [P] skipped pairs -> E
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, key, torch.ones_like(key))
    counts = counts[:E]                                             # [E] pairs per expert
    padded = (counts + block_m - 1) // block_m * block_m            # [E]
    padded_end = padded.cumsum(0)                                   # [E] inclusive ends
    order = torch.argsort(key, stable=True)                         # [P] pairs by expert
    sorted_key = key[order]                                         # [P]
    e = sorted_key.clamp(max=E - 1)
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[e]   # [P] rank in group
    dest = torch.where(sorted_key < E, padded_end[e] - padded[e] + rank, S)   # S = dropped
    dest = dest.clamp(max=S)                                        # past S: max_ids broken
    sorted_ids = torch.full((S + 1,), P, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, dest, order)
    block_start = torch.arange(0, S, block_m, device=dev)           # [S // block_m]
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < E, block_expert, -1)
    return sorted_ids[:S], block_expert, padded_end[-1:].clone()
