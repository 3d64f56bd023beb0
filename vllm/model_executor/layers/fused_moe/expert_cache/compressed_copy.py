"""A miss copy that moves ``exp12`` planes over the link (``link_codec.py``): each bf16
expert-indexed tensor of the store is encoded once into planes in pinned host memory, and a miss
is decoded into its slot by the platform's ``exp12_copy_kernel``, one launch per tensor, no host
read. Tensors exp12 cannot hold (not bf16, a size not a multiple of 128) go through the
platform's plain gather. The slots, and so the expert kernels and every output, are unchanged:
the decode is exact.

Used by ``CachedWeightProvider.enable_link_compression``: the engine's
``moe_expert_link_compression="exp12"`` releases the encoded bf16 tensors (``release``), so host
memory holds the planes only (a quarter less), and misses computed on the CPU read the planes
(``host_weights``); the offload benchmark's exp12 designs keep the store, which its other
designs share. Not yet run on a GPU.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import (Exp12, decode, encode,
                                                                          refusal)
from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
from vllm.platforms import platform_for


def link_compression_refusal(store: HostStore, device: torch.device) -> str | None:
    """Why misses from ``store`` into slots on ``device`` cannot move as exp12, or None."""
    device = torch.device(device)
    if platform_for(device).exp12_copy_kernel() is None:
        return (f"the {device.type} platform has no exp12 copy kernel (CUDA with the 'triton' "
                "package has one)")
    reasons = {refusal(t) for t in store.tensors.values()}
    if None not in reasons:
        return f"no expert tensor can be stored as exp12 ({'; '.join(sorted(reasons))})"
    return None


class Exp12Copy:
    """``CopyMisses`` over exp12 planes (module docstring)."""
    cpu_graph_node = False
    sync_free = True
    """Both kernels read the plan on the device: a decode graph may capture the copy."""

    def __init__(self, store: HostStore, device: torch.device,
                 empty: Callable[..., torch.Tensor] = torch.empty):
        """``empty(shape, dtype=)`` allocates the planes: pinned for a CUDA device."""
        why = link_compression_refusal(store, device)
        if why is not None:
            raise ValueError(f"exp12 link compression: {why}")
        platform = platform_for(device)
        self.kernel = platform.exp12_copy_kernel()
        self.plain_kernel = platform.expert_copy_kernel()
        self.planes: dict[str, Exp12] = {}
        for n, t in store.tensors.items():
            c = encode(t, empty) if refusal(t) is None else None
            # Escape rows are padded to the largest count: an expert full of outliers can make
            # the planes bigger than bf16, and then the tensor moves as it is.
            if c is not None and c.bytes_per_expert < t[0].numel() * t.element_size():
                self.planes[n] = c
        self.plain = {n: t for n, t in store.tensors.items() if n not in self.planes}
        if self.plain and self.plain_kernel is None:
            raise ValueError(f"exp12 link compression: tensors {list(self.plain)} need the "
                             "plain gather, which this platform lacks")

    @classmethod
    def for_store(cls, store: HostStore, device: torch.device) -> "Exp12Copy":
        """Planes in pinned memory where the store is pinned (the kernel reads them in place
        over the link), else pageable."""
        device = torch.device(device)
        empty = partial(platform_for(device).empty_pinned, device=device) if store.pinned \
            else torch.empty
        return cls(store, device, empty)

    @property
    def bytes_per_expert(self) -> int:
        """What one expert's copy reads over the link, all its tensors."""
        return sum(c.bytes_per_expert for c in self.planes.values()) + \
            sum(t[0].numel() * t.element_size() for t in self.plain.values())

    def host_weights(self, store: HostStore, planes: bool = False
                     ) -> dict[str, torch.Tensor | Exp12]:
        """What the CPU computes misses from (``moe_expert_cpu_compute``): the store's tensors,
        except those ``release`` freed: the expert weights as their planes (``Exp12``, whose
        experts ``gemv16_exp12`` reads in place), any other tensor (a bias) decoded once.
        ``planes``: the encoded expert weights as planes even where the store keeps them (the
        offload benchmark, whose designs share the store, reads as the engine does)."""
        out: dict = {}
        for name, t in store.tensors.items():
            weight = name in ("w13_weight", "w2_weight") and len(t.shape) == 3
            if not t.is_meta and not (planes and weight and name in self.planes):
                out[name] = t
            elif weight:
                out[name] = self.planes[name]
            else:
                out[name] = decode(self.planes[name])
        return out

    def release(self, store: HostStore) -> None:
        """The store's encoded tensors become meta tensors (shape and dtype kept, memory freed:
        the planes hold those experts now); nothing may read their data after (CPU compute)."""
        for name in self.planes:
            t = store.tensors[name]
            store.tensors[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")

    def __call__(self, slots: dict[str, torch.Tensor], plan: LoadPlan) -> None:
        for name, c in self.planes.items():
            self.kernel(c.planes, slots[name], plan.experts, plan.slots, plan.valid)
        for name, src in self.plain.items():
            self.plain_kernel(src, slots[name], plan.experts, plan.slots, plan.valid)

