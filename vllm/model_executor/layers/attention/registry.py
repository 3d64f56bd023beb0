"""Attention backends: what each supports, and the one function that picks one.

A backend declares the platforms, cache dtypes and cache layout it handles, the optional layer
features it implements (sliding window, sinks, a shared K=V cache: ``AttentionOptions``) and
whether it needs the platform's compiled kernels (``AttentionBackend``);
``select_attention_backend`` matches a layer's ``AttentionQuery`` (made when its KV cache is
bound, with the layer's features) against them. "auto" tries the platform's preference order
(``Platform.attention_backends``), then any other registered backend; a forced name that cannot
run the query is an error that names the reason and the backends that would. The choice is logged once per distinct decision.

Built in: ``cpu_paged`` (the C kernel, ``cpu_paged.py``: CPU, f32/bf16, contiguous cache),
``triton_paged`` (``triton_paged.py``: the Triton kernels; CUDA, or CPU under TRITON_INTERPRET=1;
f16/bf16/f32, contiguous cache) and ``torch_sdpa`` (``torch_sdpa.py``: every platform, dtype and
layout); all implement every feature. ``flashinfer_paged`` (``flashinfer_paged.py``:
FlashInfer's paged prefill/decode wrappers; CUDA with flashinfer-python, fp16/bf16, head_dim
64/128/256, sliding window and a shared K=V cache, sinks refused with the reason) has never run
on a GPU: it is registered with ``auto=False``, so only a forced name selects it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm.kernels.cpu.ops import KERNEL_DTYPES
from vllm.model_executor.layers.attention.cpu_paged import CpuPagedAttention
from vllm.model_executor.layers.attention.flashinfer_paged import (FLASHINFER_DTYPES,
                                                                   UNSUPPORTED,
                                                                   FlashInferPagedAttention,
                                                                   flashinfer_paged_refusal)
from vllm.model_executor.layers.attention.interface import (ATTENTION_FEATURES, AttentionImpl,
                                                            AttentionOptions)
from vllm.model_executor.layers.attention.torch_sdpa import TorchSdpaAttention
from vllm.model_executor.layers.attention.triton_paged import (TritonPagedAttention,
                                                                triton_paged_refusal)
from vllm.model_executor.layers.backend_registry import BackendRegistry
from vllm.platforms import Platform


@dataclass(frozen=True)
class AttentionQuery:
    """What a backend is chosen for: one layer's KV cache on its platform."""
    platform: Platform
    dtype: torch.dtype
    """The KV cache's dtype."""
    head_dim: int
    contiguous: bool
    """Whether the KV cache tensor is contiguous (kernels read it through one base pointer)."""
    features: frozenset[str] = frozenset()
    """The layer's optional features (``AttentionOptions.features``)."""

    def describe(self) -> str:
        layout = "contiguous" if self.contiguous else "non-contiguous"
        with_ = f" with {', '.join(sorted(self.features))}" if self.features else ""
        return (f"a {layout} {self.dtype} KV cache on {self.platform.name} "
                f"(head_dim={self.head_dim}){with_}")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    impl: type[AttentionImpl]
    """Made per layer: impl(num_heads, head_dim, num_kv_heads, scale, prefix, options)."""
    platforms: tuple[str, ...] | None = None
    """Platform names; None = every platform."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """KV cache dtypes; None = any."""
    needs_contiguous_cache: bool = False
    needs_native_kernels: bool = False
    """The platform's compiled kernels must be loaded and take the cache dtype."""
    features: frozenset[str] = frozenset()
    """The optional layer features it implements (of ``ATTENTION_FEATURES``)."""
    check: Callable[[AttentionQuery], str | None] | None = None
    """Further requirement (a package, the device type): the reason it fails, or None."""
    unsupported: tuple[tuple[str, str], ...] = ()
    """(feature, why it is not implemented): the reason a refusal gives for that feature."""
    auto: bool = True
    """False: "auto" never picks it (not yet run where it matters); only a forced name does."""

    def refusal(self, q: AttentionQuery) -> str | None:
        """Why this backend cannot run the query (the first requirement that fails), or None."""
        if self.platforms is not None and q.platform.name not in self.platforms:
            return f"it runs on {list(self.platforms)}, not {q.platform.name!r}"
        if self.dtypes is not None and q.dtype not in self.dtypes:
            return f"it takes KV cache dtypes {[str(d) for d in self.dtypes]}, not {q.dtype}"
        if self.needs_contiguous_cache and not q.contiguous:
            return "it needs a contiguous KV cache, this one is not"
        if q.features - self.features:
            why = "".join(f"; {f}: {r}" for f, r in self.unsupported if f in q.features)
            return f"it does not implement {sorted(q.features - self.features)}{why}"
        if self.needs_native_kernels and not q.platform.has_native_kernels(q.dtype):
            return (f"the {q.platform.name} kernels are not built or do not take {q.dtype} "
                    "(no C compiler, or VLLM_CPU_KERNELS=0)")
        return self.check(q) if self.check is not None else None

    def make(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
             prefix: str = "", options: AttentionOptions = AttentionOptions()) -> AttentionImpl:
        return self.impl(num_heads, head_dim, num_kv_heads, scale, prefix, options)


_REGISTRY: BackendRegistry[AttentionBackend] = BackendRegistry("attention", "attention_backend")


def register_attention_backend(backend: AttentionBackend) -> AttentionBackend:
    return _REGISTRY.register(backend)


def attention_backend_names() -> tuple[str, ...]:
    return _REGISTRY.names()


def get_attention_backend(name: str) -> AttentionBackend:
    return _REGISTRY.get(name)


def select_attention_backend(q: AttentionQuery, requested: str = "auto") -> AttentionBackend:
    """The backend for ``q``: ``requested`` if it can run it (else ValueError with the reason and
    the backends that would), or for "auto" the first in the platform's order that can."""
    return _REGISTRY.select(q, requested, q.platform.attention_backends)


register_attention_backend(AttentionBackend(
    "cpu_paged", CpuPagedAttention, platforms=("cpu",), dtypes=tuple(KERNEL_DTYPES),
    needs_contiguous_cache=True, needs_native_kernels=True, features=ATTENTION_FEATURES))
register_attention_backend(AttentionBackend(
    "triton_paged", TritonPagedAttention, dtypes=(torch.float16, torch.bfloat16, torch.float32),
    needs_contiguous_cache=True, features=ATTENTION_FEATURES,
    check=lambda q: triton_paged_refusal(q.platform, q.dtype, q.head_dim,
                                         1 if "kv_shared" in q.features else 2)))
register_attention_backend(AttentionBackend("torch_sdpa", TorchSdpaAttention,
                                            features=ATTENTION_FEATURES))
# Forced only (auto=False): never run on a GPU yet. ``make`` imports flashinfer; the registry
# reaches it only after selecting the backend on CUDA.
register_attention_backend(AttentionBackend(
    "flashinfer_paged", FlashInferPagedAttention, platforms=("cuda",), dtypes=FLASHINFER_DTYPES,
    needs_contiguous_cache=True, features=ATTENTION_FEATURES - UNSUPPORTED.keys(),
    check=lambda q: flashinfer_paged_refusal(q.head_dim, q.platform.device_type),
    unsupported=tuple(UNSUPPORTED.items()), auto=False))
