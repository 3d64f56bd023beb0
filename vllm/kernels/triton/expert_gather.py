"""The expert cache's miss copy as one Triton launch per tensor (CUDA), reading the pinned host
store in place: for each plan entry i with valid[i], dst[slots[i]] = src[experts[i]].

Run on an H100 (2026-11-26): its three ``gpu`` tests passed (they read a pinned host store
and capture the copy in a CUDA graph). Also checked under Triton's interpreter against a torch
reference (``tests/kernels/triton/test_triton_expert_gather.py``) and compiled for SM90 / SM120
(``tests/build/test_triton_compile_expert_gather.py``).

The contract is ``UvaCopyKernel``'s (``expert_cache/copy.py``), the same as the CUDA build's
``vllm._C`` op (``csrc/moe/expert_gather.cu``), which the CUDA platform prefers where it exists:
  * src [E, ...] contiguous, pinned host memory (or on dst's device); dst [N, ...] contiguous
    CUDA, same dtype and row shape; experts, slots [n] int64 and valid [n] bool on dst's device,
    n <= 65535 (``gather_checks.MAX_ENTRIES``). Valid entries name distinct slots, and src and
    dst do not overlap: programs of two entries writing one slot would race, with no defined
    winner on a GPU (the residency step's plans never do).
  * Pinned host memory is read in place over the link: Triton hands a kernel the device address
    of a pinned (UVA-mapped) host tensor (``cuPointerGetAttribute(DEVICE_POINTER)`` in its
    launcher; triton-lang/triton#1197), so there is no staging copy.
  * No host read of the plan and a grid fixed by the shapes (min(n, ``ENTRY_ROWS``) x row
    chunks, each program looping over its entries), so a launch can be captured in a CUDA graph
    and replayed with new plan contents. Invalid entries cost one byte load (a program reads
    its row's flags together first, and stops there when none is valid), without reading
    their (garbage, possibly -1) expert or slot ids, let alone a row.
  * Out-of-range ids (expert outside [0, E) or slot outside [0, N)) on a valid entry are
    SKIPPED: a kernel cannot raise, and reading or writing out of bounds is worse. The CUDA
    build's kernel traps on them instead; the residency step never produces them.
Rows move as raw bytes, reinterpreted as the widest word (int64, int32, int16, else uint8) that
divides the row's byte count and both base addresses, so any dtype (float8, packed int4 in int32,
bool...) copies bit for bit. Offsets are int64: E * row bytes passes 2^31 for real experts.
Bad input raises ValueError naming the value.
"""
from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from vllm.kernels.gather_checks import check_plan, check_rows, fail
from vllm.kernels.triton import interpreting

BLOCK = 1024        # words per load of a program (8 per thread at 4 warps)
ITERS = 8           # loads per program: a chunk is BLOCK * ITERS words (64 KiB of int64)
ENTRY_ROWS = 8
"""The grid's rows of plan entries: program (c, y) copies chunk c of entries y, y + 8, ...; a
step that hits everywhere launches min(n, 8) rows of programs that read their flags and exit,
not n (csrc/moe/expert_gather.cu has the arithmetic)."""
_ROWS = tl.constexpr(ENTRY_ROWS)
NUM_WARPS = 4
LAUNCH_OPTIONS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}
"""Compile options of every launch (no floating point here: enable_fp_fusion is set only so
Triton does not warn that its default changes; tests/build compiles with these)."""
WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
"""(bytes, dtype) a row may move as, widest first."""


def flags_per_row(n: int) -> int:
    """FLAGS of a launch over n entries: a power of two >= the entries of one row."""
    return triton.next_power_of_2(triton.cdiv(n, min(n, ENTRY_ROWS)))


@triton.jit
def _gather_chunk(src_ptr, dst_ptr, start, W, experts_ptr, slots_ptr, valid_ptr, n, E, N,
                  BLOCK: tl.constexpr, ITERS: tl.constexpr, FLAGS: tl.constexpr):
    """This program's row of plan entries, i = program_id(1), + num_programs(1), ...: for each
    valid one in range, words [start, start + BLOCK * ITERS) of row experts[i] of src [E, W]
    into row slots[i] of dst [N, W] (both kernels' entry walk). The row's FLAGS flags are read
    together first: with none valid (a step that hits everywhere) the program stops there,
    instead of after one dependent load per entry."""
    # [FLAGS] this row's entries (and some past n): rows are ENTRY_ROWS apart whenever a row
    # has more than one entry (n >= ENTRY_ROWS; else FLAGS is 1).
    f = tl.program_id(1) + _ROWS * tl.arange(0, FLAGS)
    if tl.max(tl.load(valid_ptr + f, mask=f < n, other=0), axis=0) != 0:
        _walk_entries(src_ptr, dst_ptr, start, W, experts_ptr, slots_ptr, valid_ptr, n, E, N,
                      BLOCK, ITERS)


@triton.jit
def _walk_entries(src_ptr, dst_ptr, start, W, experts_ptr, slots_ptr, valid_ptr, n, E, N,
                  BLOCK: tl.constexpr, ITERS: tl.constexpr):
    for i in range(tl.program_id(1), n, tl.num_programs(1)):
        if tl.load(valid_ptr + i) != 0:
            e = tl.load(experts_ptr + i)                  # int64: e * W is an int64 offset
            s = tl.load(slots_ptr + i)
            if (e >= 0) & (e < E) & (s >= 0) & (s < N):   # out of range: skipped
                src_row = src_ptr + e * W
                dst_row = dst_ptr + s * W
                for k in tl.static_range(ITERS):
                    w = start + k * BLOCK + tl.arange(0, BLOCK)
                    inb = w < W
                    tl.store(dst_row + w, tl.load(src_row + w, mask=inb), mask=inb)


@triton.jit
def _expert_gather_kernel(src_ptr, dst_ptr, experts_ptr, slots_ptr, valid_ptr, n, E, N, W,
                          BLOCK: tl.constexpr, ITERS: tl.constexpr, FLAGS: tl.constexpr):
    """Grid (cdiv(W, BLOCK * ITERS), min(n, ENTRY_ROWS)): program (c, y) copies words
    [c * BLOCK * ITERS, ...) of row experts[i] of src [E, W] into row slots[i] of dst [N, W]
    (words, not elements) for the entries i = y, y + ENTRY_ROWS, ... that are valid."""
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    _gather_chunk(src_ptr, dst_ptr, start, W, experts_ptr, slots_ptr, valid_ptr, n, E, N,
                  BLOCK, ITERS, FLAGS)


WHO = "triton expert_gather"


def _check_interpreted(src: torch.Tensor, dst: torch.Tensor, who: str = WHO) -> None:
    """After ``gather_checks``' checks with ``cpu_ok``: CPU tensors only under the interpreter."""
    if dst.device.type == "cpu" and not interpreting():
        fail(who, f"dst on {dst.device}, src on {src.device}: runs on CUDA dst, or on CPU tensors "
                  f"only under TRITON_INTERPRET=1")


def _as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """Contiguous [R, ...] -> [R, row_bytes / word size] of ``word``, the same memory."""
    return t.view(t.shape[0], -1).view(torch.uint8).view(word)


def _word(row_bytes: int, *tensors: torch.Tensor) -> tuple[int, torch.dtype]:
    """(bytes, dtype) of the widest word dividing the row's bytes and every tensor's base
    address and storage offset (``Tensor.view(dtype)`` needs the latter)."""
    for size, dtype in WORDS:
        if row_bytes % size == 0 and all(
                t.data_ptr() % size == 0 and t.storage_offset() * t.element_size() % size == 0
                for t in tensors):
            return size, dtype
    return 1, torch.uint8


def expert_gather(src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor,
                  slots: torch.Tensor, valid: torch.Tensor) -> None:
    """For each i with valid[i]: dst[slots[i]] = src[experts[i]], in one launch on the current
    stream of dst's device, without a host sync (the module docstring has the contract)."""
    check_rows(WHO, src, dst, cpu_ok=True)
    _check_interpreted(src, dst)
    n = check_plan(WHO, dst, experts, slots, valid)
    E, N = src.shape[0], dst.shape[0]
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    if n == 0 or E == 0 or N == 0 or row_bytes == 0:
        return                               # nothing in range to copy: launch nothing
    size, word = _word(row_bytes, src, dst)
    W = row_bytes // size                    # words per row
    grid = (triton.cdiv(W, BLOCK * ITERS), min(n, ENTRY_ROWS))
    guard = torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext()
    with guard:                              # Triton launches on the current device
        _expert_gather_kernel[grid](
            _as_words(src, word), _as_words(dst, word), experts, slots, valid.view(torch.uint8),
            n, E, N, W, BLOCK=BLOCK, ITERS=ITERS, FLAGS=flags_per_row(n), **LAUNCH_OPTIONS)
