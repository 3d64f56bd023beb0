"""Device slots: N expert-sized rows per expert-indexed tensor, owned by the provider.

The slot tensors keep the names of the layer's expert tensors, so the quant method's kernel
reads them unchanged, with slot ids in place of expert ids.
"""
from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore


def allocate_slots(store: HostStore, num_slots: int,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """name -> [num_slots, ...] device tensor, same per-expert shape and dtype as the store.

    Zero-filled: an empty slot is never read (no pair is routed to it), but zeros keep the
    contents deterministic. These are the only expert-sized allocations on ``device``.
    """
    if not 1 <= num_slots <= store.num_experts:
        raise ValueError(f"moe_expert_cache_size={num_slots} is invalid for a layer with "
                         f"{store.num_experts} experts: must be in [1, {store.num_experts}]")
    return {n: as_parameter(torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, device=device))
            for n, t in store.tensors.items()}


def as_parameter(t: torch.Tensor) -> nn.Parameter:
    """``t`` as a frozen Parameter (itself if it is one). Providers hand the layer Parameter
    objects, so the layer can register the very objects they own (``module.to`` then updates
    both in place)."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
