"""Argument checks of the expert gathers (the miss copy: for each plan entry i with valid[i],
dst[slots[i]] = src[experts[i]]), shared by the Triton kernels (``triton/expert_gather.py``,
``triton/expert_gather_many.py``) and the CUDA build's ops (``cuda/ops.py``).

The compiled ops check again in C++, but bad input is refused here first, in Python, as
ValueError naming the value: on the H100 image a C++ check's exception crashed the process
(a segmentation fault, cause not yet known) instead of reaching Python.
"""
from __future__ import annotations

from typing import Sequence

import torch

MAX_ENTRIES = 65535
"""Plan entries per call, the gathers' contract (the CUDA op refuses more too). It was the launch
grid's y dimension; the grids now have min(n, 8) rows of blocks walking the entries, so it is a
limit kept, not one the launch imposes."""


def fail(who: str, msg: str) -> None:
    raise ValueError(f"{who}: {msg}")


def describe(t: torch.Tensor) -> str:
    return (f"{t.dtype} {tuple(t.shape)} on {t.device}"
            f"{'' if t.is_contiguous() else ' (non-contiguous)'}")


def check_plan(who: str, dst: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
               valid: torch.Tensor) -> int:
    """The number of plan entries n, after checking experts, slots [n] int64, valid [n] bool."""
    for t, dtype, what in ((experts, torch.int64, "experts"), (slots, torch.int64, "slots"),
                           (valid, torch.bool, "valid")):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 \
                or not t.is_contiguous() or t.device != dst.device:
            got = describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
            fail(who, f"{what} must be a contiguous 1-D {dtype} tensor on {dst.device} "
                      f"(dst's device), got {got}")
    n = experts.shape[0]
    if slots.shape[0] != n or valid.shape[0] != n:
        fail(who, f"experts, slots and valid must have one entry each per plan entry, got "
                  f"{n}, {slots.shape[0]}, {valid.shape[0]}")
    if n > MAX_ENTRIES:
        fail(who, f"at most {MAX_ENTRIES} plan entries per call, got {n}")
    return n


def check_rows(who: str, src: torch.Tensor, dst: torch.Tensor, cpu_ok: bool = False) -> None:
    """src [E, ...] and dst [N, ...]: contiguous, same dtype and row shape (so same row bytes),
    dst on CUDA (or, with ``cpu_ok``, both on the CPU), src pinned host memory or on dst's
    device."""
    for t, what in ((src, "src"), (dst, "dst")):
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or not t.is_contiguous():
            got = describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
            fail(who, f"{what} must be a contiguous tensor of rows [rows, ...], got {got}")
    if src.dtype != dst.dtype:
        fail(who, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    if src.shape[1:] != dst.shape[1:]:
        fail(who, f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must have the same row "
                  f"shape (the same bytes per row)")
    if dst.is_cuda:
        if src.is_cuda and src.device != dst.device:
            fail(who, f"src on {src.device} but dst on {dst.device}")
        # A zero-byte src has nothing to read (the gathers return before launching), and
        # torch may not call its empty storage pinned.
        if src.device.type == "cpu" and src.numel() > 0 and not src.is_pinned():
            fail(who, "a host src must be pinned (page-locked) to be read from the device, got "
                      "an unpinned cpu tensor")
        if src.device.type not in ("cpu", "cuda"):
            fail(who, f"src on {src.device}: must be pinned host memory or on {dst.device}")
    elif not (cpu_ok and dst.device.type == "cpu" and src.device.type == "cpu"):
        fail(who, f"dst on {dst.device}, src on {src.device}: dst must be a CUDA tensor"
                  + (" (or both on the CPU)" if cpu_ok else ""))


def check_many(who: str, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor],
               experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
               cpu_ok: bool = False) -> int:
    """``check_rows`` for each (srcs[t], dsts[t]), which must all have tensor 0's expert and
    slot counts and device; then ``check_plan``. Returns the number of plan entries."""
    if len(srcs) != len(dsts) or not srcs:
        fail(who, f"needs as many srcs as dsts, at least one: got {len(srcs)} and {len(dsts)}")
    for t, (src, dst) in enumerate(zip(srcs, dsts)):
        check_rows(who, src, dst, cpu_ok)
        if (src.shape[0], dst.shape[0], dst.device) != (srcs[0].shape[0], dsts[0].shape[0],
                                                        dsts[0].device):
            fail(who, f"tensor {t} has {src.shape[0]} experts and {dst.shape[0]} slots on "
                      f"{dst.device}; tensor 0 has {srcs[0].shape[0]} and {dsts[0].shape[0]} "
                      f"on {dsts[0].device}")
    return check_plan(who, dsts[0], experts, slots, valid)
