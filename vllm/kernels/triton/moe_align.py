"""Pairs grouped by expert for the fused-MoE GEMMs (vLLM's ``moe_align_block_size``), in one
Triton launch where a step has at most ``KERNEL_MAX_PAIRS`` pairs (every decode step a CUDA graph
replays), else in torch ops.

The torch version (``moe_align_block_size_torch``) is about 30 small ops per MoE layer: on a GPU,
30 kernels of a few microseconds each, more than the layer's expert GEMMs at batch 1 and the
largest share of a decode step's launches. The kernel does the same work in one program that
holds every pair at once (BLOCK_P >= P lanes, one load of the ids), in int32 (cast on store):

  1. sorted_ids filled with the sentinel P; the pairs whose id is in [0, E) counted; none (a
     cache's empty wave, all ids -1): block_expert all -1, num_padded 0, and nothing else;
  2. counts[e] by ``tl.histogram``; pad[e] = counts[e] rounded up to BLOCK_M, minus counts[e];
     num_padded = #valid + sum(pad); pad_before = exclusive cumsum of pad;
  3. keys expert * BLOCK_P + pair index (skipped pairs get expert E) sorted by tl.sort's
     bitonic network (``_sort``): place j then holds the j-th valid pair in (expert, pair)
     order, which goes to j + pad_before[expert] (``tl.gather`` from the [BLOCK_E] vector);
  4. block_expert: -1 from block num_padded // BLOCK_M on; every other block starts with a
     pair (groups start at multiples of BLOCK_M, pad only at their ends), so the pair placed at
     b * BLOCK_M writes its expert to block_expert[b] (torch.searchsorted right in the torch
     version); after a barrier (the fill precedes it), each pair writes sorted_ids[place].

Compiled for SM90 under Triton 3.6 (E = 64, BLOCK_M 16): at 8 pairs one warp, 358 PTX
instructions (straight-line but for the fill loops) and 3 barriers; at 256 pairs four warps,
845 and 33 barriers (the sort's 36 compare-exchange steps mostly in registers and shuffles;
docs/benchmarks.md has the command), where the one-hot version it replaces ran two loops of
P / 32 chunks in int64 with a few barriers each.
Outputs equal the torch version's exactly (tests/kernels/triton/test_moe_align.py, under the
interpreter); it compiles for SM90 / SM120 without spills (tests/build). No host read; the
launch depends on shapes only. This design is not yet run on a GPU (the one-hot version ran on
an H100, 2026-11-26: 6.4 us at 8 pairs, 39 us at 256, E = 64).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNEL_MAX_PAIRS = 4096
"""Steps with more pairs (T * K) take the torch version: the kernel holds every pair in one
program (a [BLOCK_P] sort), which a long prefill would make slow; decode steps stay far below."""
KERNEL_MAX_EXPERTS = 1024
"""More experts take the torch version too: the kernel's [BLOCK_E] counts and offsets spill past
that (E = 4096 at 4096 pairs: 1.2 KB of stack per thread under Triton 3.6); the sort keys,
expert * BLOCK_P + pair < 2 ** 30, would fit up to E = 2 ** 18 - 1."""
# Pairs at least: one per lane of a warp, so that no lane holds a copy of another's pair
# (tl.histogram's ballots would count the copy; Triton 3.6 divides copies back out, but the
# kernel does not rely on it).
MIN_BLOCK_P = 32
MIN_BLOCK_E = 32          # histogram bins at least: one per lane of a warp
FILL_PER_THREAD = 8       # int64 entries each thread stores per fill iteration (4 x 16 bytes)


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
    E = num_experts
    if not 0 < P <= KERNEL_MAX_PAIRS or E > KERNEL_MAX_EXPERTS:
        return moe_align_block_size_torch(topk_ids, block_m, num_experts, max_ids)  # checks too
    _check(topk_ids, block_m, num_experts, max_ids)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)             # int32 / int64 read as they are (no cast launch)
    flat = flat if flat.dtype in (torch.int64, torch.int32) else flat.to(torch.int64)
    S = padded_size(P, groups(E, max_ids), block_m)
    sorted_ids = torch.empty(S, dtype=torch.int64, device=dev)
    block_expert = torch.empty(S // block_m, dtype=torch.int64, device=dev)
    num_padded = torch.empty(1, dtype=torch.int64, device=dev)
    block_p, block_e, block_fill, num_warps = launch_blocks(P, E)
    _align_kernel[(1,)](flat, sorted_ids, block_expert, num_padded, P, E, S,
                        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p,
                        BLOCK_FILL=block_fill, num_warps=num_warps)
    return sorted_ids, block_expert, num_padded


def launch_blocks(P: int, E: int) -> tuple[int, int, int, int]:
    """(BLOCK_P, BLOCK_E, BLOCK_FILL, num_warps) for P pairs and E experts. One warp up to 64
    pairs (its reductions, scans and sort exchange nothing across warps: 3 barriers in all),
    then 1 to 8 sort keys per thread (4 warps to 512 pairs, 8 to 2048, 16 at 4096): compiled
    for SM90 under Triton 3.6, 16 keys per thread double each warp's instructions (2048 pairs:
    about 6,700 on 4 warps, 3,350 on 8, with as many barriers) and spill a register (128
    registers; 4096 pairs on 8 warps too). Results do not depend on them."""
    block_p = max(MIN_BLOCK_P, triton.next_power_of_2(P))
    num_warps = 1 if block_p <= 64 else 4 if block_p <= 512 else 8 if block_p <= 2048 else 16
    block_e = max(MIN_BLOCK_E, triton.next_power_of_2(E))
    return block_p, block_e, FILL_PER_THREAD * 32 * num_warps, num_warps


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def _bit(N_DIMS: tl.constexpr, d: tl.constexpr):
    """[2] * N_DIMS (broadcast): 1 where bit d (from the innermost axis) of the index is set."""
    return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - d - 1) + [2] + [1] * d)


@triton.jit
def _exchange(h, N_DIMS: tl.constexpr, stage: tl.constexpr, d: tl.constexpr):
    """One compare-exchange step of the bitonic network on h [2] * N_DIMS, across axis d (from
    the innermost): each element's partner is (the sum over the axis) - itself (tl.sort takes
    an xor_sum: the same size-2 reduction on a GPU, but the interpreter runs a sum in numpy and
    an xor_sum in Python per element, 28 s instead of 1 at 4096 pairs). A pair keeps the smaller
    key on its left, unless its run of 2 ** stage is a descending one (bit `stage` set) that
    the next stage merges."""
    partner = tl.sum(h, axis=N_DIMS - 1 - d, keep_dims=True) - h
    right = _bit(N_DIMS, d)
    if stage < N_DIMS:
        right = right ^ _bit(N_DIMS, stage)
    return tl.where((h > partner) != (right == 1), partner, h)


@triton.jit
def _sort(x, N_DIMS: tl.constexpr):
    """x [2 ** N_DIMS] int32 (distinct, below 2 ** 30: a pair's sum fits) sorted ascending by
    tl.sort's bitonic network: N_DIMS * (N_DIMS + 1) / 2 exchange steps."""
    h = tl.reshape(x, [2] * N_DIMS)
    for stage in tl.static_range(1, N_DIMS + 1):
        for k in tl.static_range(stage):
            h = _exchange(h, N_DIMS, stage, stage - 1 - k)
    return tl.reshape(h, [2 ** N_DIMS])


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, P, E, S,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_FILL: tl.constexpr):
    LOG_P: tl.constexpr = _log2(BLOCK_P)
    i = tl.arange(0, BLOCK_P)                                   # [BLOCK_P] pair index
    raw = tl.load(ids_ptr + i, mask=i < P, other=-1)            # absent lanes: skipped
    # Every slot starts as padding (whatever the ids); the barrier below orders these stores
    # before the scatter's.
    for start in range(0, S, BLOCK_FILL):
        s = start + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ptr + s, tl.zeros([BLOCK_FILL], dtype=tl.int64) + P, mask=s < S)
    valid = (raw >= 0) & (raw < E)                              # [BLOCK_P]
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    num_blocks = S // BLOCK_M
    if n_valid == 0:
        num_padded = n_valid            # an empty wave (every id -1): the fills alone
    else:
        x = tl.where(valid, raw, E).to(tl.int32)                # [BLOCK_P] expert, E: skipped
        counts = tl.histogram(tl.where(valid, x, 0), BLOCK_E, mask=valid)   # [BLOCK_E] int32
        pad = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M - counts          # [BLOCK_E]
        pad_before = tl.cumsum(pad, axis=0) - pad                           # [BLOCK_E]
        num_padded = n_valid + tl.sum(pad, axis=0)
        # [BLOCK_P] by expert, then by pair index (stable), skipped pairs last
        key = _sort(x * BLOCK_P + i, LOG_P)
        xs = key // BLOCK_P                                     # [BLOCK_P] expert of place j
        placed = xs < E
        j = tl.arange(0, BLOCK_P)
        dest = j + tl.gather(pad_before, tl.where(placed, xs, 0), 0)       # [BLOCK_P]
        ok = placed & (dest < S)                                # past S: max_ids broken
        first = ok & (dest % BLOCK_M == 0)                      # a block's first place
        tl.store(block_expert_ptr + dest // BLOCK_M, xs.to(tl.int64), mask=first)
        tl.debug_barrier()              # every fill store precedes the scatter below
        tl.store(sorted_ptr + dest, (key % BLOCK_P).to(tl.int64), mask=ok)
    tl.store(num_padded_ptr, num_padded.to(tl.int64))
    for start in range(0, num_blocks, BLOCK_FILL):              # blocks past the groups
        b = start + tl.arange(0, BLOCK_FILL)
        tl.store(block_expert_ptr + b, tl.full([BLOCK_FILL], -1, tl.int64),
                 mask=(b < num_blocks) & (b * BLOCK_M >= num_padded))


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
