"""Eviction policies for the expert cache: interface, the built-in policies and the registry.

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

# Shapes: policies are written elementwise so state [..., E] may carry leading batch dims (one row
# per layer in the replay benchmark); ``clock`` then has shape [..., 1] and broadcasts.


class LRUPolicy(EvictionPolicy):
    """Least recently used: keep the experts used last."""
    name = "lru"

    def init_state(self, num_experts, device):
        return {"last_use": torch.full((num_experts,), -1, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        state["last_use"].copy_(torch.where(used, clock, state["last_use"]))

    def keep_score(self, state, clock):
        return state["last_use"].float()


class LFUPolicy(EvictionPolicy):
    """Least frequently used (all-time counts)."""
    name = "lfu"

    def init_state(self, num_experts, device):
        return {"freq": torch.zeros(num_experts, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        state["freq"].add_(used.long())

    def keep_score(self, state, clock):
        return state["freq"].float()


class LFRUPolicy(EvictionPolicy):
    """The upstream seed's LFRU: score = freq / (clock - last_use + 1)."""
    name = "lfru"

    def init_state(self, num_experts, device):
        return {"freq": torch.zeros(num_experts, dtype=torch.int64, device=device),
                "last_use": torch.zeros(num_experts, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        state["freq"].add_(used.long())
        state["last_use"].copy_(torch.where(used, clock, state["last_use"]))

    def keep_score(self, state, clock):
        return state["freq"].float() / (clock - state["last_use"] + 1).float()


_REGISTRY: dict[str, EvictionPolicy] = {}


def register_policy(policy: EvictionPolicy) -> EvictionPolicy:
    _REGISTRY[policy.name] = policy
    return policy


for _p in (LRUPolicy(), LFUPolicy(), LFRUPolicy()):
    register_policy(_p)

DEFAULT_POLICY = "lru"
"""What ``policy="auto"`` resolves to (measured: docs/expert-cache-policies.md)."""


def policy_names() -> tuple[str, ...]:
    return ("lru", "lfu", "lfru") + tuple(n for n in _REGISTRY if n not in ("lru", "lfu", "lfru"))


def get_policy(name: str) -> EvictionPolicy:
    """Registered policy by name; "auto" resolves to ``DEFAULT_POLICY``."""
    if name == "auto":
        name = DEFAULT_POLICY
    if name not in _REGISTRY:
        raise ValueError(f"moe_expert_cache_policy={name!r} is invalid: must be one of "
                         f"{list(policy_names())}")
    return _REGISTRY[name]
