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
EmptyPinned = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""(shape, dtype) -> an uninitialised page-locked host tensor (``Platform.empty_pinned``)."""

PIN_FAILED_MSG = ("Expert cache: could not page-lock the host expert store (out of lockable "
                  "host memory, or none on this system); falling back to pageable memory and "
                  "synchronous expert copies, which are slower.")


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
                     empty_pinned: EmptyPinned | None, name: str = "") -> "HostStore":
        """Build the store from a layer's loaded expert tensors (name -> [E, ...], ideally in host
        memory), processing one expert at a time straight into it. ``empty_pinned`` (the
        platform's, ``Platform.empty_pinned``): allocate it page-locked, pageable if that raises
        torch.OutOfMemoryError (any other error, a CUDA fault, propagates); None: pageable.
        ``name`` (the layer's) prefixes errors."""
        if not weights:
            raise ValueError(f"{name}: quant method declares no expert-indexed tensors "
                             "(expert_tensor_names() is empty)")
        loaded = {n: _host_tensor(t, n, name) for n, t in weights.items()}
        names = tuple(loaded)
        num_experts = _common_num_experts(loaded)
        one = process_expert({n: t[0] for n, t in loaded.items()})
        _check_processed(one, names, {}, 0)
        # Allocated once at its final size (and pinned there): no pageable copy to pin after.
        tensors, pinned = _allocate(num_experts, one, empty_pinned)
        for e in range(num_experts):
            if e:
                one = process_expert({n: t[e] for n, t in loaded.items()})
                _check_processed(one, names, tensors, e)
            for n in names:
                tensors[n][e].copy_(one[n])
        return cls(tensors, pinned)


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


def _allocate(num_experts: int, first: dict[str, torch.Tensor],
              empty_pinned: EmptyPinned | None) -> tuple[dict[str, torch.Tensor], bool]:
    """name -> uninitialised [E, *first[name].shape] host tensor (explicitly host memory, even
    under a ``with torch.device(...)`` context), and whether all of them are page-locked."""
    shapes = {n: ((num_experts, *t.shape), t.dtype) for n, t in first.items()}
    if empty_pinned is not None:
        try:
            return {n: empty_pinned(shape, dtype) for n, (shape, dtype) in shapes.items()}, True
        except torch.OutOfMemoryError as e:
            # Only a want of lockable memory falls back: another error is a CUDA fault (an
            # earlier kernel's, surfacing here) that a quiet pageable store would hide.
            # Pinned tensors made before the failure are freed with the comprehension.
            log_once(logger, logging.WARNING, PIN_FAILED_MSG)
            logger.debug("pinned allocation failed: %s", e)
    return {n: torch.empty(shape, dtype=dtype, device="cpu")
            for n, (shape, dtype) in shapes.items()}, False
