"""Softmax top-k routing in one Triton launch (CUDA): the "softmax" scoring of
``fused_moe/router.py`` without expert groups, correction bias or routed scaling, with the
semantics of the CPU C kernel (``vllm/kernels/cpu/router.c``):

  scores = softmax(logits[t]) in f32; ids[t] = the k largest scores, largest first, ties to the
  lower expert id; weights[t] = scores[ids[t]], divided by their sum when ``renormalize``.

The torch path is six kernels per MoE layer (cast, softmax, topk, gather, sum, divide); this is
one program per token over its [E] logits (k rounds of argmax, each masking its winner). The
choice is made on the logits, which order the experts as the scores do. Weights can differ from
torch's in the last bits (exp and the sum's order), the ids not (tests/kernels/triton/
test_triton_router.py). No host read. Ran on an H100 (2026-11-26) inside the Qwen3-MoE decode
benchmark (the same greedy tokens at every cache size); it has no gpu test of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_t, K: tl.constexpr,
                         RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))                       # [BLOCK_E]; 0 past E
    total = tl.sum(p, axis=0)
    j = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for r in tl.static_range(K):
        best = tl.argmax(x, axis=0, tie_break_left=True)    # the lower id among equals
        w = tl.where(j == r, tl.sum(tl.where(e == best, p, 0.0), axis=0) / total, w)
        ids = tl.where(j == r, best.to(tl.int64), ids)
        x = tl.where(e == best, float("-inf"), x)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    tl.store(weights_ptr + t * K + j, w, mask=j < K)
    tl.store(ids_ptr + t * K + j, ids, mask=j < K)


def topk_softmax(logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (f16/bf16/f32, rows contiguous) -> (weights [T, top_k] f32, ids [T, top_k]
    int64), largest score first; weights renormalised to sum 1 when ``renormalize``."""
    if logits.dim() != 2 or logits.dtype not in DTYPES or logits.stride(-1) != 1:
        raise ValueError(f"triton topk_softmax: logits must be a [T, E] f16/bf16/f32 tensor with "
                         f"contiguous rows, got {logits.dtype} {tuple(logits.shape)} stride "
                         f"{logits.stride()}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"triton topk_softmax: top_k={top_k} is invalid: must be in [1, {E}]")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _topk_softmax_kernel[(T,)](logits, weights, ids, E, logits.stride(0), K=top_k,
                                   RENORM=bool(renormalize),
                                   BLOCK_E=triton.next_power_of_2(E),
                                   BLOCK_K=triton.next_power_of_2(top_k))
    return weights, ids
