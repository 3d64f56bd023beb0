"""The plain torch expert computation: the reference every backend and the cache are checked against.

Layout (vLLM's): w13 [E, 2N, K] (gate rows then up rows), w2 [E, K, N]; K = hidden, N = intermediate.
Results are produced per (token, k) pair and reduced over k afterwards, so a computation split
into waves of experts (the expert cache) reduces in exactly the same order as an unsplit one.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation


def _present_experts(flat_ids: torch.Tensor, num_experts: int):
    """Expert rows to visit. Eager: only experts that occur (one read of a tiny [E] tensor).
    Under torch.compile: all rows, so the graph has no data-dependent control flow."""
    if torch.compiler.is_compiling():
        return range(num_experts)
    counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=num_experts)
    return counts.nonzero().flatten().tolist()


def expert_pairs_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                     activation: str | MoEActivation = "silu", b13: torch.Tensor | None = None,
                     b2: torch.Tensor | None = None) -> None:
    """Write ``out[t, k] = topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for pairs whose id is
    >= 0; pairs with a negative id are left untouched.

    x [T, K_h]; w13 [E', 2N, K_h]; w2 [E', K_h, N]; topk_* [T, top_k]; out [T, top_k, K_h];
    optional biases b13 [E', 2N], b2 [E', K_h]. A non-gated activation (``relu2_no_mul``) has
    N rows in w13 and b13 (the up projection alone).
    Each expert sees its tokens in ascending token order, so a pair's value does not depend on
    which other experts are computed in the same call.
    """
    expert_pairs_loop(x, w13.shape[0], lambda e: (w13[e], w2[e]), topk_weights, topk_ids, out,
                      activation, b13, b2)


def expert_pairs_loop(x: torch.Tensor, num_rows: int,
                      expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                      activation: str | MoEActivation = "silu", b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None, mlp: Callable | None = None) -> None:
    """``expert_pairs_ref`` with each present row's (w13 [2N, K_h], w2 [K_h, N]) given by
    ``expert_weights(row)`` (quantized formats dequantize the row there); rows in [0, num_rows).
    Biases (b13 [num_rows, 2N], b2 [num_rows, K_h]) are read per row in x's dtype. ``mlp``:
    what computes one expert (``expert_mlp``'s signature; default ``expert_mlp``)."""
    mlp = mlp or expert_mlp
    act = MoEActivation.of(activation)
    T, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)                      # [T * top_k]
    flat_w = topk_weights.reshape(-1).to(x.dtype)
    out_flat = out.view(T * top_k, out.shape[-1])  # explicit: T may be 0
    for e in _present_experts(flat_ids, num_rows):
        pair = (flat_ids == e).nonzero().squeeze(1)      # [P] ascending pair indices
        w13, w2 = expert_weights(e)
        y = mlp(x[pair // top_k], w13, w2, act, None if b13 is None else b13[e].to(x.dtype),
                None if b2 is None else b2[e].to(x.dtype))
        out_flat.index_copy_(0, pair, y * flat_w[pair, None])


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               activation: str | MoEActivation = "silu", b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None) -> torch.Tensor:
    """One expert: x [P, K] -> [P, K]; w13 [2N, K], w2 [K, N], optional b13 [2N], b2 [K].
    A bias is a separate add after the product (not F.linear's fused bias), as the grouped
    backend adds it and as transformers' GPT-OSS does."""
    gate_up = F.linear(x, w13)
    if b13 is not None:
        gate_up = gate_up + b13
    y = F.linear(MoEActivation.of(activation)(gate_up), w2)
    return y if b2 is None else y + b2


def combine_pairs(out: torch.Tensor) -> torch.Tensor:
    """[T, top_k, K] -> [T, K], summed in k order."""
    return out.sum(dim=1)


def fused_experts_ref(x, w13, w2, topk_weights, topk_ids, activation: str = "silu"):
    out = x.new_zeros(topk_ids.shape[0], topk_ids.shape[1], x.shape[-1])
    expert_pairs_ref(x, w13, w2, topk_weights, topk_ids, out, activation)
    return combine_pairs(out)
