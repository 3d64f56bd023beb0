"""Eviction policies for the expert cache (interface + registry; implementations TBD).

A policy is stateless code over a small per-layer state dict of device tensors, so it runs
with no host synchronisation and under torch.compile(fullgraph=True).
"""
from __future__ import annotations

import torch


class EvictionPolicy:
    name: str = ""

    def init_state(self, num_experts: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-layer policy state; tensors indexed by expert id ([E]) and/or scalars."""
        raise NotImplementedError

    def on_access(self, state: dict[str, torch.Tensor], used: torch.Tensor,
                  clock: torch.Tensor) -> None:
        """Update state in place. used: [E] bool, experts needed by this step (or wave).
        clock: int64 scalar tensor, the layer's step counter (before increment)."""
        raise NotImplementedError

    def keep_score(self, state: dict[str, torch.Tensor], clock: torch.Tensor) -> torch.Tensor:
        """[E] float: how much each expert is worth keeping; the lowest resident ones are evicted."""
        raise NotImplementedError


_REGISTRY: dict[str, EvictionPolicy] = {}


def register_policy(policy: EvictionPolicy) -> EvictionPolicy:
    _REGISTRY[policy.name] = policy
    return policy


def policy_names() -> tuple[str, ...]:
    return ("lru", "lfu", "lfru") + tuple(n for n in _REGISTRY if n not in ("lru", "lfu", "lfru"))


def get_policy(name: str) -> EvictionPolicy:
    if name not in _REGISTRY:
        raise ValueError(f"moe_expert_cache_policy={name!r} is invalid: must be one of "
                         f"{list(policy_names())}")
    return _REGISTRY[name]
