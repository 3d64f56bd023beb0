"""HostStore: every expert of one MoE layer in host memory, after post-load processing.

The set of tensors is whatever the quant method declares expert-indexed
(``expert_tensor_names()``): weights, scales, zero points, g_idx, biases all move with their
expert, and nothing here knows their names. Each expert is run through
``quant_method.prepare_expert`` on the host, one at a time, straight into the store, so
post-load processing never materialises all experts on the compute device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from vllm.logger import init_logger, log_once

logger = init_logger(__name__)

ProcessExpert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

PIN_FAILED_MSG = ("Expert cache: could not pin the host expert store (pin_memory raised); falling "
                  "back to pageable memory and synchronous expert copies, which are slower.")


@dataclass
class HostStore:
    tensors: dict[str, torch.Tensor]
    """name -> [E, ...] host tensor (processed layout), in ``expert_tensor_names()`` order."""
    pinned: bool
    """True when every tensor is in page-locked memory (asynchronous copies are safe)."""

    @property
    def num_experts(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def bytes_per_expert(self) -> int:
        """Bytes one expert occupies, summed over all its expert-indexed tensors."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    @classmethod
    def from_experts(cls, weights: dict[str, torch.Tensor], process_expert: ProcessExpert,
                     pin: bool, name: str = "") -> "HostStore":
        """Build the store from a layer's loaded expert tensors (name -> [E, ...], ideally in host
        memory), processing one expert at a time. ``pin``: try page-locked memory. ``name``
        (the layer's) prefixes errors."""
        if not weights:
            raise ValueError(f"{name}: quant method declares no expert-indexed tensors "
                             "(expert_tensor_names() is empty)")
        loaded = {n: _host_tensor(t, n, name) for n, t in weights.items()}
        names = tuple(loaded)
        num_experts = _common_num_experts(loaded)
        tensors: dict[str, torch.Tensor] = {}
        for e in range(num_experts):
            one = process_expert({n: t[e] for n, t in loaded.items()})
            _check_processed(one, names, tensors, e)
            if not tensors:
                # Explicitly host memory, even under a ``with torch.device(...)`` context.
                tensors = {n: torch.empty((num_experts, *one[n].shape), dtype=one[n].dtype,
                                          device="cpu") for n in names}
            for n in names:
                tensors[n][e].copy_(one[n])
        return cls(*_maybe_pin(tensors, pin))


def _host_tensor(t: torch.Tensor, tensor_name: str, layer_name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{layer_name}: declared expert tensor {tensor_name!r} is not a tensor "
                         f"of the layer (got {type(t).__name__})")
    if t.device.type != "cpu":
        # Still correct, but the full expert set was already materialised on the device.
        log_once(logger, logging.WARNING, f"Expert cache: {tensor_name} was loaded on "
                 f"{t.device}, not in host memory; the device already held every expert while "
                 "loading.")
    return t.detach()


def _common_num_experts(loaded: dict[str, torch.Tensor]) -> int:
    sizes = {n: (t.shape[0] if t.dim() else None) for n, t in loaded.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"expert-indexed tensors disagree on the leading expert dim: {sizes}")
    return next(iter(sizes.values()))


def _check_processed(one: dict[str, torch.Tensor], names: tuple[str, ...],
                     first: dict[str, torch.Tensor], expert: int) -> None:
    if set(one) != set(names):
        raise ValueError(f"process_expert returned tensors {sorted(one)} for expert {expert}; "
                         f"must return exactly the declared names {sorted(names)}")
    for n in names if first else ():
        want = (tuple(first[n].shape[1:]), first[n].dtype)
        got = (tuple(one[n].shape), one[n].dtype)
        if got != want:
            raise ValueError(f"process_expert gave {n} of (shape, dtype) {got} for expert "
                             f"{expert}, but {want} for expert 0; it must be the same for all")


def _maybe_pin(tensors: dict[str, torch.Tensor], pin: bool) -> tuple[dict[str, torch.Tensor], bool]:
    if not pin:
        return tensors, False
    try:
        for n in tensors:  # in place, one at a time: each pageable copy is freed once pinned
            tensors[n] = tensors[n].pin_memory()
    except RuntimeError:
        # Possibly a mix of pinned and pageable tensors: treated as pageable (synchronous copies).
        log_once(logger, logging.WARNING, PIN_FAILED_MSG)
        return tensors, False
    return tensors, True
