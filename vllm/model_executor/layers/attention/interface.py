"""The contract of an attention backend's implementation (``registry.py`` says which runs).

One instance per layer, made when the layer's KV cache is bound. ``forward`` gets the step's
new tokens already split into heads, writes their keys (and values) into the paged cache and
returns the attention of every query token over its sequence's context.

KV cache layout (allocated by the model runner from ``Attention.kv_cache_shape``):
[P, num_blocks, block_size, num_kv_heads, head_dim], P = 2 planes (0 = keys, 1 = values), or
P = 1 for a ``kv_shared`` layer (MLA: the values are the keys, stored once; backends read V
from plane 0). Flat slot = block_id * block_size + offset. Query head h uses kv head
``h // (num_heads // num_kv_heads)`` (HF ``repeat_kv`` order).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.model_executor.forward_context import AttentionMetadata


ATTENTION_FEATURES = frozenset({"sliding_window", "sinks", "kv_shared"})
"""The names of ``AttentionOptions.features``, what a backend may declare it implements."""


@dataclass(frozen=True)
class AttentionOptions:
    """The optional behaviours of one layer, fixed at build (``Attention``'s keyword options)."""
    sliding_window: int | None = None
    """Query position p attends keys at positions in (p - W, p] only (HF's
    ``kv_idx > q_idx - sliding_window`` with causality); None = all of p's prefix."""
    use_sinks: bool = False
    """One learned logit per query head joins the softmax denominator, with no value (GPT-OSS);
    the logits come with each ``forward`` call."""
    kv_shared: bool = False
    """Values are the keys (MLA): one cache plane, ``forward`` gets v=None."""

    @property
    def features(self) -> frozenset[str]:
        """The names a backend must support (``AttentionBackend.features``)."""
        return frozenset(name for name, on in (("sliding_window", self.sliding_window is not None),
                                               ("sinks", self.use_sinks),
                                               ("kv_shared", self.kv_shared)) if on)

    @property
    def planes(self) -> int:
        """KV cache planes: 1 (keys only) when shared, else 2."""
        return 1 if self.kv_shared else 2


class AttentionImpl:
    name = ""
    """The registered backend name (``registry.py``)."""
    cuda_graph_safe: bool = False
    """Its forward enqueues the same kernels with the same shapes for every decode-only step of a
    given batch size, reading lengths only from device tensors (``seq_lens``, ``block_tables``,
    ``slot_mapping``; never the host lists ``seq_lens_cpu`` / ``query_lens_cpu``, which a
    captured step fixes to placeholders) and skipping ``PAD_SLOT_ID`` rows in its KV write: safe
    to capture in a decode graph (``worker/cuda_graphs.py``)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = "", options: AttentionOptions = AttentionOptions()):
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.prefix = prefix
        self.options = options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, md: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (the step's new tokens, laid out by ``md``; v None when
        ``options.kv_shared``) -> [T, Hq, D]. ``sinks`` [Hq] f32: the sink logits when
        ``options.use_sinks``, else None. Writes k (and v) to their ``md.slot_mapping`` slots of
        ``kv_cache`` first, so each new token also attends itself and the step's earlier tokens
        of its sequence."""
        raise NotImplementedError
