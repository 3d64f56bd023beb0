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
        return state["last_use"].double()


class LFUPolicy(EvictionPolicy):
    """Least frequently used (all-time counts)."""
    name = "lfu"

    def init_state(self, num_experts, device):
        return {"freq": torch.zeros(num_experts, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        state["freq"].add_(used.long())

    def keep_score(self, state, clock):
        return state["freq"].double()


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
        return state["freq"].double() / (clock - state["last_use"] + 1).double()


class LRFUPolicy(EvictionPolicy):
    """Ours: exponentially decayed frequency blended with recency.

    keep_score = rate + w / (dt + 1), dt = clock - last_use, rate = crf * g**dt * (1 - g), where
    crf is the decayed access count as of last_use (g = 0.5 ** (1 / half_life)): an expert used
    often in the last ~half_life plans outranks one used once, and a just-used expert keeps a
    recency bonus. Decay is lazy (stored at last_use) so plans with no accesses change nothing.
    Tuned on the even-indexed sequences of the DeepSeek-V2-Lite trace (half_life 30, w 0.2);
    see docs/expert-cache-policies.md for held-out numbers.
    """
    name = "lrfu"

    def __init__(self, half_life: float = 30.0, recency_weight: float = 0.2):
        if half_life <= 0 or recency_weight < 0:
            raise ValueError(f"lrfu half_life={half_life}, recency_weight={recency_weight} are "
                             f"invalid: need half_life > 0 and recency_weight >= 0")
        self.decay, self.recency_weight = 0.5 ** (1.0 / half_life), recency_weight

    def init_state(self, num_experts, device):
        # float64: scores of rarely-tied experts must order the same on every device.
        return {"crf": torch.zeros(num_experts, dtype=torch.float64, device=device),
                "last_use": torch.zeros(num_experts, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        dt = (clock - state["last_use"]).double()
        decayed = state["crf"] * torch.pow(self.decay, dt)
        state["crf"].copy_(torch.where(used, decayed + 1.0, state["crf"]))
        state["last_use"].copy_(torch.where(used, clock, state["last_use"]))

    def keep_score(self, state, clock):
        dt = (clock - state["last_use"]).double()
        rate = state["crf"] * torch.pow(self.decay, dt) * (1.0 - self.decay)
        return rate + self.recency_weight / (dt + 1.0)


_REGISTRY: dict[str, EvictionPolicy] = {}


def register_policy(policy: EvictionPolicy) -> EvictionPolicy:
    _REGISTRY[policy.name] = policy
    return policy


for _p in (LRUPolicy(), LFUPolicy(), LFRUPolicy(), LRFUPolicy()):
    register_policy(_p)

DEFAULT_POLICY = "lrfu"
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
