"""Paged causal attention for mixed prefill + decode batches: the ``Attention`` layer.

The layer owns its KV cache (bound by the model runner) and the backend implementation chosen
for that cache when it is bound (``registry.py``: the C kernel ``cpu_paged`` on CPU in
f32/bf16, else ``torch_sdpa``), which writes the step's keys and values and attends. Without
metadata (a plain forward) the whole input is one causal sequence; with metadata but no cache
(a dummy/profiling run) each sequence attends only its own new tokens.

KV cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim], index 0 = keys,
1 = values, flat slot = block_id * block_size + offset (``interface.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.model_executor.forward_context import get_attn_metadata
from vllm.model_executor.layers.attention.interface import AttentionImpl
from vllm.model_executor.layers.attention.registry import (AttentionQuery,
                                                           get_attention_backend,
                                                           select_attention_backend)
from vllm.model_executor.layers.attention.torch_sdpa import causal
from vllm.platforms import platform_for


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = ""):
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.prefix = prefix
        cfg = get_current_vllm_config()
        self.requested_backend = cfg.kernel_config.attention_backend if cfg is not None \
            else "auto"
        """The ``attention_backend`` of the config the layer was built under ("auto" without)."""
        if self.requested_backend != "auto":
            get_attention_backend(self.requested_backend)      # an unknown name fails at build
        self._kv_cache: torch.Tensor | None = None
        self.impl: AttentionImpl | None = None
        """The backend chosen for the bound cache; None while no cache is bound."""

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """[2, num_blocks, block_size, num_kv_heads, head_dim], or None. Binding a cache chooses
        the backend for it (once per binding); binding None clears both."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor | None) -> None:
        if cache is None:
            self._kv_cache, self.impl = None, None
            return
        if cache.dim() != 5 or cache.shape[0] != 2 or \
                tuple(cache.shape[3:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"{self.prefix}: kv_cache {tuple(cache.shape)} is invalid: must be "
                             f"[2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}]")
        query = AttentionQuery(platform_for(cache.device), cache.dtype, self.head_dim,
                               cache.is_contiguous())
        backend = select_attention_backend(query, self.requested_backend)
        self.impl = backend.make(self.num_heads, self.head_dim, self.num_kv_heads, self.scale,
                                 self.prefix)
        self._kv_cache = cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""
        T, D = q.shape[0], self.head_dim
        q = q.view(T, self.num_heads, D)
        k = k.view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        md = get_attn_metadata()
        if md is None:
            # No batch layout: the whole input is one sequence starting at position 0.
            return causal(q, k, v, self.scale).reshape(T, -1)
        starts = md.query_start_loc_cpu
        if starts[-1] != T:
            raise ValueError(f"{self.prefix}: metadata covers {starts[-1]} tokens, input has {T}")
        if self._kv_cache is None:
            # Dummy/profiling run without a cache: each sequence sees only its own new tokens.
            out = torch.empty_like(q)
            for s, e in zip(starts[:-1], starts[1:]):
                out[s:e] = causal(q[s:e], k[s:e], v[s:e], self.scale)
            return out.view(T, -1)
        return self.impl.forward(q, k, v, self._kv_cache, md).view(T, -1)

    def extra_repr(self) -> str:
        backend = self.impl.name if self.impl is not None else "unbound"
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"num_kv_heads={self.num_kv_heads}, backend={backend}")
