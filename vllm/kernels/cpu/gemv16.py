"""Matrix products of a few tokens with 16-bit weight rows read in place (``gemv16.c``): what a
GPU machine's CPU runs for the unquantized experts it computes from the host store
(``moe_expert_cpu_compute``)."""
from __future__ import annotations

import torch

from vllm.kernels.cpu.exp12 import Exp12Rows
from vllm.kernels.cpu.graph import launch

WEIGHT_TYPES = {torch.bfloat16: 0, torch.float16: 1}
"""Weight dtypes ``gemv16`` reads, and the C side's code for each."""


def _tokens(who: str, x: torch.Tensor, R: int, C: int, bf16_weights: bool
            ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """x [T, C] checked -> (x as bf16 for the pair chain, bf16 tokens with bf16 weights only,
    else None; x as f32 (the column tail and the widening chain read it); y [T, R] f32)."""
    if x.dim() != 2 or x.shape[1] != C or x.device.type != "cpu" or not x.is_floating_point():
        raise ValueError(f"{who}: x {tuple(x.shape)} {x.dtype} on {x.device} must be a float "
                         f"[T, {C}] tensor on the CPU")
    xb = x.contiguous() if x.dtype == torch.bfloat16 and bf16_weights else None
    return xb, x.to(torch.float32).contiguous(), torch.empty(x.shape[0], R, dtype=torch.float32)


def gemv16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, C] (a float dtype, on the CPU) -> float32 [T, R] = x @ w^T, w [R, C] bf16 or f16
    on the CPU with unit column stride (rows may be apart: a view of a store's rows): f32
    sums. bf16 tokens with bf16 weights multiply exact pair products (vdpbf16ps where the
    build has it); other pairings widen the weights to f32 for an fma with f32 tokens. Needs
    the CPU kernels (callers ask ``vllm.platforms.native_kernels`` first)."""
    if w.dtype not in WEIGHT_TYPES or w.dim() != 2 or w.device.type != "cpu" or \
            (w.shape[1] > 1 and w.stride(1) != 1):
        raise ValueError(f"gemv16: w {tuple(w.shape)} {w.dtype} on {w.device} with strides "
                         f"{tuple(w.stride())} must be a 2-D bf16 or float16 CPU tensor with "
                         "unit column stride")
    R, C = w.shape
    xb, x32, y = _tokens("gemv16", x, R, C, w.dtype == torch.bfloat16)
    if not y.numel():
        return y
    rc = launch("gemv16", WEIGHT_TYPES[w.dtype], w.data_ptr(), w.stride(0) if R > 1 else C,
                x32.data_ptr(), None if xb is None else xb.data_ptr(), y.data_ptr(), x.shape[0],
                R, C)
    if rc:
        raise RuntimeError(f"gemv16 failed (code {rc})")
    return y


def gemv16_exp12(x: torch.Tensor, w: Exp12Rows) -> torch.Tensor:
    """``gemv16`` on the bf16 W that ``w``'s exp12 planes hold, read as planes (12 bits a weight
    from memory instead of 16) and decoded a few rows at a time in the core's cache: the same
    bits as ``gemv16(x, exp12_decode(w))``. Needs the CPU kernels."""
    w.check("gemv16_exp12")
    R, C = w.shape
    xb, x32, y = _tokens("gemv16_exp12", x, R, C, True)
    if not y.numel():
        return y
    rc = launch("gemv16_exp12", *w.pointers(), x32.data_ptr(),
                None if xb is None else xb.data_ptr(), y.data_ptr(), x.shape[0], R, C)
    if rc:
        raise RuntimeError(f"gemv16_exp12 failed (code {rc}: -2 is out of memory)")
    return y
