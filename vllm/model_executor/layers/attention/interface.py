"""The contract of an attention backend's implementation (``registry.py`` says which runs).

One instance per layer, made when the layer's KV cache is bound. ``forward`` gets the step's
new tokens already split into heads, writes their keys and values into the paged cache and
returns the attention of every query token over its sequence's context.

KV cache layout (allocated by the model runner): [2, num_blocks, block_size, num_kv_heads,
head_dim], index 0 = keys, 1 = values, flat slot = block_id * block_size + offset. Query head h
uses kv head ``h // (num_heads // num_kv_heads)`` (HF ``repeat_kv`` order).
"""
from __future__ import annotations

import torch

from vllm.model_executor.forward_context import AttentionMetadata


class AttentionImpl:
    name = ""
    """The registered backend name (``registry.py``)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = ""):
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.prefix = prefix

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (the step's new tokens, laid out by ``md``) -> [T, Hq, D].
        Writes k/v to their ``md.slot_mapping`` slots of ``kv_cache`` first, so each new token
        also attends itself and the step's earlier tokens of its sequence."""
        raise NotImplementedError
