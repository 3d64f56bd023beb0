"""Sync-free expert computation with ``torch._grouped_mm``: one grouped GEMM per projection.

Pairs (token, k) are sorted by expert id (stable, so each expert sees its tokens in ascending
token order, exactly like the loop in ``torch_ref``), gathered, multiplied group by group, and
scattered back. Group sizes stay on the device (``offs``), so there is no host synchronisation and
no data-dependent control flow: the whole layer traces with ``torch.compile(fullgraph=True)``.
On CPU, ``_grouped_mm`` computes each group with the same GEMM as ``F.linear``, so results are
bitwise equal to ``torch_ref.expert_pairs_ref`` (tested).
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.platforms import Platform


def grouped_mm_refusal(hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                       platform: Platform) -> str | None:
    """Why ``_grouped_mm`` cannot run this layer (None: it can). It needs 16-byte aligned row
    strides, and on CUDA bf16 (the platform's SM is checked by the registry)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    elem = torch.finfo(dtype).bits // 8
    for what, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if (size * elem) % 16:
            return f"{what}={size} rows are not 16-byte aligned in {dtype}"
    if platform.name == "cuda" and dtype != torch.bfloat16:
        return f"on cuda it takes bfloat16 only, not {dtype}"
    return None


def expert_pairs_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                         activation: str | MoEActivation = "silu",
                         b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> None:
    """Same contract as ``torch_ref.expert_pairs_ref``: out[t, k] = w[t, k] * expert(x[t]) for pairs
    with topk_ids >= 0 (ids index w13/w2's leading dim, and the optional biases b13 [G, 2N],
    b2 [G, H]); other pairs are left untouched."""
    T, top_k = topk_ids.shape
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and not (topk_ids >= 0).any():
        # An empty wave of the expert cache. torch's CPU _grouped_mm runs one GEMM per group even
        # for empty groups; a device grouped GEMM skips them. Reading a CPU tensor is no device
        # sync, and compiled graphs (and CUDA) never take this branch.
        return
    groups = w13.shape[0]
    flat = topk_ids.reshape(-1)                                        # [P], P = T * top_k
    valid = (flat >= 0) & (flat < groups)                              # out of range = skipped
    key = torch.where(valid, flat, groups)                             # skipped pairs sort last
    order = torch.argsort(key, stable=True)                            # [P] grouped pair indices
    counts = torch.zeros(groups + 1, dtype=torch.int32, device=x.device)
    counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = counts[:groups].cumsum(0, dtype=torch.int32)                # [G] group end offsets
    rows = x[order // top_k]                                           # [P, H]
    # Each sorted pair's bias row (skipped pairs read row 0; their results are discarded).
    bias_row = torch.where(valid, flat, 0)[order]                      # [P]
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # [P, 2N]
    if b13 is not None:
        gate_up = gate_up + b13.to(x.dtype)[bias_row]
    y = torch._grouped_mm(MoEActivation.of(activation)(gate_up), w2.transpose(1, 2),
                          offs=offs)                                   # [P, H]
    if b2 is not None:
        y = y + b2.to(x.dtype)[bias_row]
    y = y * topk_weights.reshape(-1).to(x.dtype)[order, None]
    out_flat = out.view(T * top_k, out.shape[-1])  # explicit: T may be 0
    # Rows past the last offset (skipped pairs) are garbage from _grouped_mm: keep old values.
    out_flat[order] = torch.where(valid[order, None], y, out_flat[order])
