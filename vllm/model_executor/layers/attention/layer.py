"""Paged causal attention for mixed prefill + decode batches: the ``Attention`` layer.

The layer owns its KV cache (bound by the model runner) and the backend implementation chosen
for that cache when it is bound (``registry.py``: the C kernel ``cpu_paged`` on CPU in
f32/bf16, the Triton kernels ``triton_paged`` on CUDA, else ``torch_sdpa``), which writes the
step's keys and values and attends. Without
metadata (a plain forward) the whole input is one causal sequence; with metadata but no cache
(a dummy/profiling run) each sequence attends only its own new tokens.

Options (keyword-only, any combination; none = plain causal attention):
- ``sliding_window=W``: the query at position p attends keys at (p - W, p] (HF's sliding-window
  causal mask). The cache still keeps every position (no ring buffer): the window only limits
  what is read.
- ``use_sinks``: a learned logit per query head (``self.sinks`` [Hq] f32, GPT-OSS) adds
  exp(sink_h) to the softmax denominator, with no value vector.
- ``kv_shared`` (MLA): the values are the keys. ``forward(q, k)`` with v None, the output is
  softmax(q K^T) K ([T, Hq * D]; the caller slices what it needs), and the cache holds one plane.

KV cache layout (``kv_cache_shape``): [P, num_blocks, block_size, num_kv_heads, head_dim],
P = 2 (0 = keys, 1 = values) or 1 (keys only) for ``kv_shared``; flat slot =
block_id * block_size + offset (``interface.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.model_executor.forward_context import get_attn_metadata
from vllm.model_executor.layers.attention.interface import AttentionImpl, AttentionOptions
from vllm.model_executor.layers.attention.registry import (AttentionQuery,
                                                           get_attention_backend,
                                                           select_attention_backend)
from vllm.model_executor.layers.attention.torch_sdpa import causal
from vllm.platforms import platform_for


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = "", *, sliding_window: int | None = None,
                 use_sinks: bool = False, kv_shared: bool = False):
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{prefix}: sliding_window={sliding_window} must be >= 1 or None")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.prefix = prefix
        self.options = AttentionOptions(sliding_window, use_sinks, kv_shared)
        if use_sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32),
                                      requires_grad=False)
        else:
            self.register_parameter("sinks", None)
        cfg = get_current_vllm_config()
        self.requested_backend = cfg.kernel_config.attention_backend if cfg is not None \
            else "auto"
        """The ``attention_backend`` of the config the layer was built under ("auto" without)."""
        if self.requested_backend != "auto":
            get_attention_backend(self.requested_backend)      # an unknown name fails at build
        self._kv_cache: torch.Tensor | None = None
        self.impl: AttentionImpl | None = None
        """The backend chosen for the bound cache; None while no cache is bound."""

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The cache this layer takes: (planes, num_blocks, block_size, num_kv_heads, head_dim),
        planes = 1 (keys only) when ``kv_shared``, else 2 (keys, values)."""
        return (self.options.planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """A tensor of ``kv_cache_shape``, or None. Binding a cache chooses the backend for it
        (once per binding); binding None clears both."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor | None) -> None:
        if cache is None:
            self._kv_cache, self.impl = None, None
            return
        if cache.dim() != 5 or tuple(cache.shape) != self.kv_cache_shape(*cache.shape[1:3]):
            raise ValueError(f"{self.prefix}: kv_cache {tuple(cache.shape)} is invalid: must be "
                             f"[{self.options.planes}, num_blocks, block_size, "
                             f"{self.num_kv_heads}, {self.head_dim}]")
        query = AttentionQuery(platform_for(cache.device), cache.dtype, self.head_dim,
                               cache.is_contiguous(), self.options.features)
        backend = select_attention_backend(query, self.requested_backend)
        self.impl = backend.make(self.num_heads, self.head_dim, self.num_kv_heads, self.scale,
                                 self.prefix, self.options)
        self._kv_cache = cache

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]; v is None exactly when ``kv_shared``."""
        if (v is None) != self.options.kv_shared:
            raise ValueError(f"{self.prefix}: v must be None exactly when kv_shared "
                             f"(kv_shared={self.options.kv_shared})")
        T, D = q.shape[0], self.head_dim
        q = q.view(T, self.num_heads, D)
        k = k.view(T, self.num_kv_heads, D)
        v = None if v is None else v.view(T, self.num_kv_heads, D)
        values = k if v is None else v                  # what the torch paths attend over
        window = self.options.sliding_window
        md = get_attn_metadata()
        if md is None:
            # No batch layout: the whole input is one sequence starting at position 0.
            return causal(q, k, values, self.scale, window, self.sinks).reshape(T, -1)
        starts = md.query_start_loc_cpu
        if starts[-1] != T:
            raise ValueError(f"{self.prefix}: metadata covers {starts[-1]} tokens, input has {T}")
        if self._kv_cache is None:
            # Dummy/profiling run without a cache: each sequence sees only its own new tokens.
            out = torch.empty_like(q)
            for s, e in zip(starts[:-1], starts[1:]):
                out[s:e] = causal(q[s:e], k[s:e], values[s:e], self.scale, window, self.sinks)
            return out.view(T, -1)
        return self.impl.forward(q, k, v, self._kv_cache, md, self.sinks).view(T, -1)

    def extra_repr(self) -> str:
        backend = self.impl.name if self.impl is not None else "unbound"
        o = self.options
        opts = (f", sliding_window={o.sliding_window}" if o.sliding_window is not None else "") \
            + (", sinks" if o.use_sinks else "") + (", kv_shared" if o.kv_shared else "")
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"num_kv_heads={self.num_kv_heads}{opts}, backend={backend}")
