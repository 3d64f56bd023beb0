"""The C attention backend (``cpu_paged``, ``vllm/kernels/cpu/paged_attention.c``): every query
token of the step, decodes and prompt tokens alike, in one kernel call that reads the paged
cache in place; the KV write is one call too (padding rows at PAD_SLOT_ID are skipped). A
sliding window starts each query's loop at its window's first key; sinks seed the online
softmax; a one-plane (``kv_shared``) cache is read as keys and values.

A ctypes call cannot be traced by torch.compile: while a graph is being traced this backend runs
the torch backend's code instead (the same results, within the kernel's tested tolerance).
"""
from __future__ import annotations

import torch

from vllm.kernels.cpu.ops import paged_attention, write_kv_cache
from vllm.model_executor.forward_context import AttentionMetadata
from vllm.model_executor.layers.attention.interface import AttentionImpl, AttentionOptions
from vllm.model_executor.layers.attention.torch_sdpa import TorchSdpaAttention
from vllm.platforms import native_kernels


class CpuPagedAttention(AttentionImpl):
    name = "cpu_paged"
    cuda_graph_safe = True
    """Two C calls per step reading lengths from ``seq_lens`` (a decode-only step's
    ``token_rows_and_lens``), PAD_SLOT_ID rows skipped: what CPU graphs record, and what the CUDA
    decode graphs' eager capturer replays in the CPU tests (it never runs on CUDA)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = "", options: AttentionOptions = AttentionOptions()):
        super().__init__(num_heads, head_dim, num_kv_heads, scale, prefix, options)
        self._traced = TorchSdpaAttention(num_heads, head_dim, num_kv_heads, scale, prefix,
                                          options)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, md: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not native_kernels(kv_cache.dtype, kv_cache.device):     # being traced
            return self._traced.forward(q, k, v, kv_cache, md, sinks)
        self.write_cache(k, v, md.slot_mapping, kv_cache)
        rows, lens = md.token_rows_and_lens
        return paged_attention(q, kv_cache, md.block_tables, lens, self.scale, self.num_kv_heads,
                               rows, self.prefix, window=self.options.sliding_window,
                               sinks=sinks)

    def write_cache(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor,
                    kv_cache: torch.Tensor) -> None:
        write_kv_cache(k, v, slot_mapping, kv_cache, self.prefix)
