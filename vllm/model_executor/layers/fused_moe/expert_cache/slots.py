"""Device slots: N expert-sized rows per expert-indexed tensor, installed as the layer's params.

The slot tensors take the names of the layer's expert parameters, so the quant method's
``apply_pairs`` reads them unchanged, with slot ids in place of expert ids.
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
    return {n: torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, device=device)
            for n, t in store.tensors.items()}


def install_slots(layer: nn.Module, slots: dict[str, torch.Tensor]) -> None:
    """Replace the layer's expert params (host, [E, ...]) by the slot tensors ([N, ...])."""
    for name, t in slots.items():
        if name in layer._buffers:  # e.g. an integer g_idx registered as a buffer stays one
            layer.register_buffer(name, t)
        else:
            # A Parameter under an existing name replaces the [E, ...] one in _parameters.
            setattr(layer, name, nn.Parameter(t, requires_grad=False))
