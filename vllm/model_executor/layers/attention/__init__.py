"""Paged causal attention: the ``Attention`` layer (``layer.py``) and the registry that chooses
its backend when a KV cache is bound (``registry.py``; built in: ``cpu_paged.py``, the C
kernel, ``triton_paged.py``, the Triton kernels, and ``torch_sdpa.py``, the torch reference)."""
from vllm.model_executor.layers.attention.interface import AttentionImpl, AttentionOptions
from vllm.model_executor.layers.attention.layer import Attention
from vllm.model_executor.layers.attention.registry import (AttentionBackend, AttentionQuery,
                                                           attention_backend_names,
                                                           get_attention_backend,
                                                           register_attention_backend,
                                                           select_attention_backend)

__all__ = ["Attention", "AttentionBackend", "AttentionImpl", "AttentionOptions",
           "AttentionQuery", "attention_backend_names", "get_attention_backend",
           "register_attention_backend", "select_attention_backend"]
