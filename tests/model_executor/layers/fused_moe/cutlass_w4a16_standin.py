"""A torch stand-in for the CUTLASS W4A16 grouped GEMM (``vllm.kernels.cuda.ops.w4a16_moe_mm``),
written from its documented contract only: for each group g, rows r in [off[g], off[g + 1]) of
``a``: d[r, n] = sum_k a[r, k] * W_g[n, k], W_g[n, k] = q_g[n, k] * scales[g, k // gs, n],
q_g[n, k] the signed int4 (-8..7) in byte w[g, n, k // 2], k even in the low nibble. W is made
in float32 and rounded to bf16 (the kernel's MMA operand type), the sums run in float32 one row
at a time (a row's value never depends on the rows beside it), and d is rounded to bf16. Rows
outside [off[0], off[G]) are not written. Host loops: CPU tests only."""
from __future__ import annotations

import torch

from vllm.kernels.cuda.ops import W4A16MoEOps

WORKSPACE_BYTES = 256


def decode_signed_nibbles(w: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] -> int32 [..., N, K] in -8..7: byte j holds k = 2j (low nibble) and
    k = 2j + 1 (high nibble), each a two's complement 4-bit integer."""
    b = w.to(torch.int32)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    q = torch.stack([lo, hi], dim=-1).reshape(*w.shape[:-1], 2 * w.shape[-1])
    return torch.where(q >= 8, q - 16, q)


def dequantize_group(w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """One group's W [N, K] in float32 (w [N, K/2], scales [K/gs, N])."""
    q = decode_signed_nibbles(w).float()                              # [N, K]
    k = torch.arange(q.shape[1])
    return q * scales.float()[k // group_size].t()                    # [N, K]


def _check(a, w, scales, d, expert_offsets, group_size):
    P, K = a.shape
    G, N = w.shape[0], w.shape[1]
    assert a.dtype == scales.dtype == d.dtype == torch.bfloat16
    assert w.dtype == torch.uint8 and expert_offsets.dtype == torch.int64
    assert tuple(w.shape) == (G, N, K // 2) and tuple(d.shape) == (P, N)
    assert tuple(scales.shape) == (G, K // group_size, N)
    assert tuple(expert_offsets.shape) == (G + 1,)
    assert K % 64 == 0 and N % 8 == 0 and (group_size == K or group_size % 64 == 0)
    for t in (a, w, scales, d, expert_offsets):
        assert t.is_contiguous()


def standin_mm(a, w, scales, d, expert_offsets, group_size, workspace) -> None:
    _check(a, w, scales, d, expert_offsets, group_size)
    assert workspace.dtype == torch.uint8 and workspace.numel() >= WORKSPACE_BYTES
    off = expert_offsets.cpu().tolist()
    assert all(x <= y for x, y in zip(off, off[1:])) and off[-1] <= a.shape[0]
    for g in range(w.shape[0]):
        if off[g] == off[g + 1]:
            continue
        W = dequantize_group(w[g].cpu(), scales[g].cpu(), group_size).to(torch.bfloat16).float()
        for r in range(off[g], off[g + 1]):
            d[r] = (W @ a[r].cpu().float()).to(torch.bfloat16).to(d.device)


def standin_workspace_bytes(num_groups: int, device: torch.device) -> int:
    return WORKSPACE_BYTES


def standin_ops() -> W4A16MoEOps:
    return W4A16MoEOps(standin_mm, standin_workspace_bytes)
