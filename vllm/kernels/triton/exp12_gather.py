"""The expert cache's miss copy from an ``exp12`` host store (CUDA), decoding on the way: for
each plan entry i with valid[i], slot ``slots[i]`` of the bf16 dst receives expert
``experts[i]`` decoded bit for bit from its planes (the layout and its torch reference:
``expert_cache/link_codec.py``). One launch per tensor; the planes are read in place from pinned
host memory (as ``expert_gather.py`` reads a plain store), 1.5 bytes per weight instead of 2.

Grid (chunks + 1, min(n, ENTRY_ROWS)), the plan walk of ``expert_gather.py`` (a program reads
its row's flags together and stops when none is valid; out-of-range ids on a valid entry are
skipped): program (c, y) with c < chunks decodes weights [c * CHUNK, (c + 1) * CHUNK) of its
entries, blocks of 128 weights as rows of a [ROWS, 128] tile (their codes two to a byte, split
and interleaved in registers; their block's base exponent broadcast along the row), and skips
the escaped weights; program (chunks, y) writes the escaped weights' bits. The two sets of
writes are disjoint, so no program waits on another. No host read; the grid depends on shapes
only, so a launch can be captured in a CUDA graph.

Compiled for SM90 and SM120 under Triton 3.9 and 3.6, the GPU image's
(``tests/build/test_triton_compile_exp12_gather.py``; 3.6 with ``PYTHONPATH`` on a
``pip install --target`` of it): 64 registers, no spills; the planes load as 16- and 8-byte vectors, the weights store as predicated 2-byte
stores, since the escape mask varies per weight: a decode launch followed by a patch launch
would store unmasked vectors, at one more launch per tensor). Checked under Triton's
interpreter against the original bf16 tensor (``tests/kernels/triton/test_exp12_gather.py``);
not yet run on a GPU, so its speed is not known.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from vllm.kernels.gather_checks import check_plan, fail
from vllm.kernels.triton.expert_gather import ENTRY_ROWS, _check_interpreted, flags_per_row

WHO = "triton exp12_gather"
BLOCK = 128          # weights per base exponent (link_codec.BLOCK)
ROWS = 16            # blocks per tile: [16, 128] weights, 2,048 per load
ITERS = 8            # tiles per program: a chunk is 16,384 weights (32 KiB of bf16)
ESC_BLOCK = 256      # escape entries per load
_ROWS_C = tl.constexpr(ENTRY_ROWS)
LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _decode_tile(lo_row, code_row, base_row, dst_row, b0, nb):
    """Blocks [b0, b0 + ROWS) (of nb) of one expert, decoded into dst_row (int16)."""
    r = b0 + tl.arange(0, 16)                                   # [ROWS] block ids
    k = tl.arange(0, 128)
    rmask = r < nb
    w = r[:, None].to(tl.int64) * 128 + k[None, :]                # [ROWS, 128] weight ids
    m2 = rmask[:, None] & (k[None, :] < 128)
    lo = tl.load(lo_row + w, mask=m2, other=0).to(tl.int32)
    j = r[:, None].to(tl.int64) * 64 + tl.arange(0, 64)[None, :]
    cb = tl.load(code_row + j, mask=rmask[:, None], other=0).to(tl.int32)
    code = tl.interleave(cb & 15, cb >> 4)                        # [ROWS, 128]
    base = tl.load(base_row + r, mask=rmask, other=0).to(tl.int32)
    exp = tl.where(code == 14, 0, base[:, None] - code)
    bits = ((lo & 0x80) << 8) | ((exp & 0xFF) << 7) | (lo & 0x7F)
    bits = tl.where(bits >= 0x8000, bits - 0x10000, bits).to(tl.int16)
    tl.store(dst_row + w, bits, mask=m2 & (code != 15))


@triton.jit
def _patch_escapes(idx_row, bits_row, dst_row, X, ESC_BLOCK: tl.constexpr):
    for start in range(0, X, ESC_BLOCK):
        x = start + tl.arange(0, ESC_BLOCK)
        idx = tl.load(idx_row + x, mask=x < X, other=-1)
        val = tl.load(bits_row + x, mask=x < X, other=0)
        tl.store(dst_row + idx.to(tl.int64), val, mask=idx >= 0)


@triton.jit
def _exp12_gather_kernel(lo_ptr, code_ptr, base_ptr, idx_ptr, bits_ptr, dst_ptr, experts_ptr,
                         slots_ptr, valid_ptr, n, E, N, NW, X, CHUNKS,
                         ITERS: tl.constexpr, FLAGS: tl.constexpr, ESC_BLOCK: tl.constexpr):
    """NW weights per expert (a multiple of 128); X escape entries per expert."""
    f = tl.program_id(1) + _ROWS_C * tl.arange(0, FLAGS)
    if tl.max(tl.load(valid_ptr + f, mask=f < n, other=0), axis=0) == 0:
        return
    c = tl.program_id(0)
    nb = NW // 128
    for i in range(tl.program_id(1), n, tl.num_programs(1)):
        if tl.load(valid_ptr + i) != 0:
            e = tl.load(experts_ptr + i)
            s = tl.load(slots_ptr + i)
            if (e >= 0) & (e < E) & (s >= 0) & (s < N):     # out of range: skipped
                dst_row = dst_ptr + s * NW
                if c < CHUNKS:
                    for t in tl.static_range(ITERS):
                        b0 = (c * ITERS + t) * 16
                        _decode_tile(lo_ptr + e * NW, code_ptr + e * (NW // 2),
                                     base_ptr + e * nb, dst_row, b0, nb)
                else:
                    _patch_escapes(idx_ptr + e * X, bits_ptr + e * X, dst_row, X, ESC_BLOCK)


def exp12_gather(planes: tuple[torch.Tensor, ...], dst: torch.Tensor, experts: torch.Tensor,
                 slots: torch.Tensor, valid: torch.Tensor) -> None:
    """For each i with valid[i]: dst[slots[i]] = the bf16 decode of expert experts[i] of
    ``planes`` (``Exp12.planes``: lo, codes, base, esc_index, esc_bits), one launch on the
    current stream of dst's device, no host sync."""
    lo, codes, base, esc_index, esc_bits = planes
    E = lo.shape[0]
    if dst.dtype != torch.bfloat16 or not dst.is_contiguous():
        fail(WHO, f"dst must be a contiguous bfloat16 tensor, got {dst.dtype} "
                  f"{tuple(dst.shape)}")
    NW = dst[0].numel() if dst.shape[0] else 0
    want = {"lo": (lo, torch.uint8, NW), "codes": (codes, torch.uint8, NW // 2),
            "base": (base, torch.uint8, NW // BLOCK), "esc_index": (esc_index, torch.int32, None),
            "esc_bits": (esc_bits, torch.int16, None)}
    for name, (t, dtype, width) in want.items():
        if t.dtype != dtype or t.dim() != 2 or t.shape[0] != E or not t.is_contiguous() or \
                (width is not None and t.shape[1] != width):
            fail(WHO, f"{name} must be a contiguous [{E}, {width or 'X'}] {dtype} tensor for "
                      f"{NW} weights per expert, got {t.dtype} {tuple(t.shape)}")
    if NW % BLOCK or esc_index.shape != esc_bits.shape:
        fail(WHO, f"{NW} weights per expert (need a multiple of {BLOCK}) or escape shapes "
                  f"{tuple(esc_index.shape)} vs {tuple(esc_bits.shape)}")
    _check_interpreted(lo, dst, WHO)
    n = check_plan(WHO, dst, experts, slots, valid)
    N = dst.shape[0]
    if n == 0 or E == 0 or N == 0 or NW == 0:
        return
    chunks = triton.cdiv(NW // BLOCK, ROWS * ITERS)
    grid = (chunks + 1, min(n, ENTRY_ROWS))
    guard = torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext()
    with guard:
        _exp12_gather_kernel[grid](
            lo, codes, base, esc_index, esc_bits, dst.view(torch.int16), experts, slots,
            valid.view(torch.uint8), n, E, N, NW, esc_index.shape[1], chunks, ITERS=ITERS,
            FLAGS=flags_per_row(n), ESC_BLOCK=ESC_BLOCK, **LAUNCH_OPTIONS)
