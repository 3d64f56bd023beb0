"""``expert_gather`` for every expert tensor of a layer (weights, scales, zeros...) in one
launch: the Triton twin of the CUDA build's ``expert_gather_many`` (csrc/moe/expert_gather.cu),
for CUDA without ``vllm._C``. Checked under Triton's interpreter against a torch reference and
compiled for SM90 / SM120. On an H100 (2026-11-26) its gpu test failed: the first launch synced
the host. Fixed since, not re-run.

Contract (``ops.expert_gather_many``'s): for each plan entry i with valid[i] and each t,
dsts[t][slots[i]] = srcs[t][experts[i]]; every src [E, ...] (pinned host memory or on the dsts'
device), every dst [N, ...] on one CUDA device; no host read of the plan.

The tensors reach the kernel as a table [T, 4] int64 of (src address, dst address, words per
row, first chunk) on the device, made once per set of tensors and kept (``_TABLES``): a
captured graph replays with it. A pinned host tensor's address is its device address under
unified addressing (every 64-bit CUDA platform: cudaHostAlloc memory is mapped at the same
address). Tensors move as the widest word every one of a launch's rows and bases allows, so
tensors are grouped by word size: one launch per group (one for every layer the engine makes).
A table missing during a graph capture (uploading it would break the capture) falls back to
one ``expert_gather`` launch per tensor.
"""
from __future__ import annotations

import contextlib
import itertools
import math

import torch
import triton
import triton.language as tl

from vllm.kernels.gather_checks import check_many
from vllm.kernels.triton.expert_gather import (BLOCK, ENTRY_ROWS, ITERS, LAUNCH_OPTIONS,
                                               _check_interpreted, _gather_chunk, _word,
                                               expert_gather, flags_per_row)

MAX_TENSORS = 16
"""Tensors per launch (rows of one table)."""
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
"""(device, (src address, dst address, words) per tensor) -> (its pinned host rows, kept until
the copy is surely done, and its table on the device)."""
_WORD_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


@triton.jit
def _expert_gather_many_kernel(table_ptr, experts_ptr, slots_ptr, valid_ptr, n, E, N, T,
                               WORD: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                               FLAGS: tl.constexpr):
    """Grid (chunks of all T rows, min(n, ENTRY_ROWS)): program (c, y) copies chunk c of the
    tensors' rows laid end to end (tensor t's row: chunks [first[t], first[t + 1])) of row
    experts[i] into row slots[i], for the entries i = y, y + ENTRY_ROWS, ...; invalid or
    out-of-range entries copy nothing (as ``_expert_gather_kernel``)."""
    c = tl.program_id(0).to(tl.int64)
    t = c * 0                                          # the tensor of chunk c (first is sorted)
    for r in range(1, T):
        t += (c >= tl.load(table_ptr + r * 4 + 3)).to(tl.int64)
    row = table_ptr + t * 4
    W = tl.load(row + 2)                               # words per row of tensor t
    start = (c - tl.load(row + 3)) * (BLOCK * ITERS)
    src = tl.load(row).to(tl.pointer_type(WORD), bitcast=True)
    dst = tl.load(row + 1).to(tl.pointer_type(WORD), bitcast=True)
    _gather_chunk(src, dst, start, W, experts_ptr, slots_ptr, valid_ptr, n, E, N, BLOCK, ITERS,
                  FLAGS)


def _table(rows: list[tuple[int, int, int]], first: list[int],
           device: torch.device) -> torch.Tensor | None:
    """The [T, 4] table of (src address, dst address, words, first chunk) rows on ``device``,
    made once; None where it is missing and the current stream is capturing."""
    key = (str(device), tuple(rows))
    table = _TABLES.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        # Pinned and copied without blocking: making a table must not sync the host either.
        host = torch.tensor([[*r, f] for r, f in zip(rows, first)], dtype=torch.int64,
                            pin_memory=device.type == "cuda")
        table = host.to(device, non_blocking=True)
        _TABLES[key] = (host, table)           # the host rows outlive their copy
        return table
    return table[1]


def expert_gather_many(srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                       experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
    """For each i with valid[i] and each t: dsts[t][slots[i]] = srcs[t][experts[i]], one launch
    per word size (module docstring)."""
    who = "triton expert_gather_many"
    n = check_many(who, srcs, dsts, experts, slots, valid, cpu_ok=True)
    _check_interpreted(srcs[0], dsts[0], who)         # the dsts share one device (check_many)
    E, N, device = srcs[0].shape[0], dsts[0].shape[0], dsts[0].device
    if n == 0 or E == 0 or N == 0:
        return
    groups: dict[int, list[int]] = {}                  # word bytes -> tensor indices
    for t, (src, dst) in enumerate(zip(srcs, dsts)):
        row_bytes = math.prod(src.shape[1:]) * src.element_size()
        if row_bytes:
            groups.setdefault(_word(row_bytes, src, dst)[0], []).append(t)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        for size, members in groups.items():
            for b in range(0, len(members), MAX_TENSORS):
                _launch([srcs[t] for t in members[b:b + MAX_TENSORS]],
                        [dsts[t] for t in members[b:b + MAX_TENSORS]], size, experts, slots,
                        valid, n)


def _launch(srcs: list[torch.Tensor], dsts: list[torch.Tensor], size: int,
            experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, n: int) -> None:
    """One launch for tensors whose rows and bases all divide into ``size``-byte words."""
    rows = [(s.data_ptr(), d.data_ptr(), math.prod(s.shape[1:]) * s.element_size() // size)
            for s, d in zip(srcs, dsts)]
    first = list(itertools.accumulate((triton.cdiv(words, BLOCK * ITERS) for *_, words in rows),
                                      initial=0))     # [T + 1] chunk offsets
    table = _table(rows, first, dsts[0].device)
    if table is None:                          # capturing, no table yet: per-tensor launches
        for src, dst in zip(srcs, dsts):
            expert_gather(src, dst, experts, slots, valid)
        return
    _expert_gather_many_kernel[(first[-1], min(n, ENTRY_ROWS))](
        table, experts, slots, valid.view(torch.uint8), n, srcs[0].shape[0], dsts[0].shape[0],
        len(rows), WORD=_WORD_TYPES[size], BLOCK=BLOCK, ITERS=ITERS, FLAGS=flags_per_row(n),
        **LAUNCH_OPTIONS)
