"""Eviction policies for the expert cache: interface, the built-in policies and the registry.

A policy is stateless code over a small per-layer state dict of device tensors, so it runs
with no host synchronisation and under torch.compile(fullgraph=True).

The built-in policies also run inside the fused residency step (``residency_step.py``: a C kernel
on CPU, a Triton kernel on CUDA), which must reach the same decisions bit for bit. So their
arithmetic is written with IEEE-exact operations only (+, -, *, / and integer ops, no fused
multiply-add; ``pow`` is a lookup in a table made once on the host), in the order the kernels
repeat, and their state uses the names the kernels take: ``freq`` and ``last_use`` (int64 [E]),
``crf`` (float64 [E]); ``lrfu_next`` adds ``weight`` (float64 [E, E]), ``bias`` (float64 [E]) and
``prev`` (bool [E]). ``kernel_code`` names the policy to the kernels (None: the policy has no
kernel and its layers run the torch reference step).
"""
from __future__ import annotations

import math

import torch


class EvictionPolicy:
    name: str = ""
    kernel_code: int | None = None
    """The fused residency step's code for this policy (0 lru, 1 lfu, 2 lfru, 3 lrfu,
    4 lrfu_next); None when no kernel implements it."""

    def kernel_params(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(params float64 [2] = [recency_weight, 1 - decay] (``lrfu_next``: [4], then
        next_weight, learning_rate), decay_pow float64 [D]) for the kernels; policies without
        those constants give zeros and a one-entry table."""
        return _constants(device, (0.0, 0.0), 0.5, 1)

    def init_state(self, num_experts: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-layer policy state; tensors indexed by expert id ([E]) and/or scalars."""
        raise NotImplementedError

    def on_access(self, state: dict[str, torch.Tensor], used: torch.Tensor,
                  clock: torch.Tensor) -> None:
        """Update state in place. used: [E] bool, experts needed by this step (or wave).
        clock: int64 scalar tensor, the layer's step counter (before increment)."""
        raise NotImplementedError

    def keep_score(self, state: dict[str, torch.Tensor], clock: torch.Tensor) -> torch.Tensor:
        """[E] float: how much each expert is worth keeping; the lowest resident ones are
        evicted."""
        raise NotImplementedError

    def wave_keep_score(self, state: dict[str, torch.Tensor], clock: torch.Tensor,
                        needed: torch.Tensor) -> torch.Tensor:
        """The keep scores ``Residency`` ranks victims by when it plans (or loads) ``needed``
        [E] bool; a policy that predicts from the wave being planned overrides this. It must not
        change ``state`` (a prefetch's load and an empty wave leave the policy as it was)."""
        return self.keep_score(state, clock)

# Shapes: policies are written elementwise so state [..., E] may carry leading batch dims (one row
# per layer in the replay benchmark); ``clock`` then has shape [..., 1] and broadcasts.


class LRUPolicy(EvictionPolicy):
    """Least recently used: keep the experts used last."""
    name = "lru"
    kernel_code = 0

    def init_state(self, num_experts, device):
        return {"last_use": torch.full((num_experts,), -1, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        state["last_use"].copy_(torch.where(used, clock, state["last_use"]))

    def keep_score(self, state, clock):
        return state["last_use"].double()


class LFUPolicy(EvictionPolicy):
    """Least frequently used (all-time counts)."""
    name = "lfu"
    kernel_code = 1

    def init_state(self, num_experts, device):
        return {"freq": torch.zeros(num_experts, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        state["freq"].add_(used.long())

    def keep_score(self, state, clock):
        return state["freq"].double()


class LFRUPolicy(EvictionPolicy):
    """The upstream seed's LFRU: score = freq / (clock - last_use + 1)."""
    name = "lfru"
    kernel_code = 2

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

    g**dt is ``decay_pow[min(dt, D - 1)]``, a table of torch.pow(g, i) made once per device:
    every device then uses the same bits (a pow kernel differs between CPU vector code, CUDA
    and C libraries in the last place). D - 1 = floor(1075 * half_life) + 1, where g**(D-1) <
    2**-1075 already rounds to 0.0, so the clamp changes nothing. The bonus is
    ``reciprocal(dt + 1) * w`` (two roundings, as torch computes ``w / tensor``).
    """
    name = "lrfu"
    kernel_code = 3

    def __init__(self, half_life: float = 30.0, recency_weight: float = 0.2):
        if half_life <= 0 or recency_weight < 0:
            raise ValueError(f"lrfu half_life={half_life}, recency_weight={recency_weight} are "
                             f"invalid: need half_life > 0 and recency_weight >= 0")
        self.decay, self.recency_weight = 0.5 ** (1.0 / half_life), recency_weight
        self.table_len = math.floor(1075 * half_life) + 2

    def kernel_params(self, device):
        return _constants(device, (self.recency_weight, 1.0 - self.decay), self.decay,
                          self.table_len)

    def _decay_pow(self, dt: torch.Tensor) -> torch.Tensor:
        """g ** dt for int64 dt >= 0 (same shape, float64)."""
        table = self.kernel_params(dt.device)[1]
        return table[dt.clamp(max=self.table_len - 1)]

    def init_state(self, num_experts, device):
        # float64: scores of rarely-tied experts must order the same on every device.
        return {"crf": torch.zeros(num_experts, dtype=torch.float64, device=device),
                "last_use": torch.zeros(num_experts, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        decayed = state["crf"] * self._decay_pow(clock - state["last_use"])
        state["crf"].copy_(torch.where(used, decayed + 1.0, state["crf"]))
        state["last_use"].copy_(torch.where(used, clock, state["last_use"]))

    def keep_score(self, state, clock):
        dt = clock - state["last_use"]
        rate = state["crf"] * self._decay_pow(dt) * (1.0 - self.decay)
        return rate + torch.reciprocal(dt.double() + 1.0) * self.recency_weight


_FIX_ONE = float(2 ** 32)
_FIX_MAX = float(2 ** 40)
"""``lrfu_next`` keeps its weights as integers (units of 2**-32, |w| <= 2**40, i.e. 256) in float64:
a sum of up to 2**12 of them stays below 2**53, so it is exact in any order (a matmul on any
device, FMA or not) and the predictions are the same bits everywhere."""


class LRFUNextPolicy(LRFUPolicy):
    """``lrfu`` plus an online-learned prediction of which experts the next plan uses.

    wave_keep_score = lrfu's keep_score + next_weight * p, with p [E] a linear predictor of
    "expert j is used by the next plan", given the experts of the plan being made (its wave):
    p[j] = bias[j] + sum over i in the wave of weight[i, j]. Victims are chosen after the layer's
    routing is known, so the wave is the best evidence of what the next token of this layer needs.
    The predictor learns online from the layer's own plans by normalised LMS: at each non-empty
    plan ``used``, with ``prev`` the last non-empty plan's experts,
        err = used - p(prev),  delta = round(err * learning_rate / (|prev| + 1) * 2**32)
        bias += delta,  weight[i, :] += delta for i in prev  (then clamped to +-2**40)
    weight/bias hold integers (units of 2**-32, see ``_FIX_MAX``) and the update is elementwise
    IEEE arithmetic (``round`` is round-half-to-even), so every device reaches the same bits.
    Nothing is trained offline: the predictor starts at zero (plain ``lrfu``) on any model.
    Needs E <= 4096.

    Parameters (named, tuned on the even-indexed DeepSeek-V2-Lite sequences only, see
    docs/expert-cache-policies.md): half_life 30 and recency_weight 0.2 (``lrfu``'s),
    next_weight 1.0 (p is a probability; lrfu's scores are ~0.05-1), learning_rate 0.03.
    State per layer: lrfu's ``crf``/``last_use``, ``weight`` float64 [E, E], ``bias`` float64
    [E], ``prev`` bool [E]. Cost per plan: two [E] x [E, E] products and an [E, E] update (no
    host read). The fused residency steps implement it (``kernel_code`` 4, constants
    ``kernel_params`` = [recency_weight, 1 - decay, next_weight, learning_rate]); they sum only
    the rows of the wave / of ``prev``, which the exact integer sums allow.
    """
    name = "lrfu_next"
    kernel_code = 4

    def __init__(self, half_life: float = 30.0, recency_weight: float = 0.2,
                 next_weight: float = 1.0, learning_rate: float = 0.03):
        super().__init__(half_life, recency_weight)
        if next_weight < 0 or not 0 < learning_rate < 1:
            raise ValueError(f"lrfu_next next_weight={next_weight}, learning_rate="
                             f"{learning_rate} are invalid: need next_weight >= 0 and "
                             f"0 < learning_rate < 1")
        self.next_weight, self.learning_rate = next_weight, learning_rate

    def kernel_params(self, device):
        return _constants(device, (self.recency_weight, 1.0 - self.decay, self.next_weight,
                                   self.learning_rate), self.decay, self.table_len)

    def init_state(self, num_experts, device):
        if num_experts > 4096:
            raise ValueError(f"lrfu_next supports num_experts <= 4096, got {num_experts}")
        state = super().init_state(num_experts, device)
        f64 = dict(dtype=torch.float64, device=device)
        state.update(weight=torch.zeros(num_experts, num_experts, **f64),
                     bias=torch.zeros(num_experts, **f64),
                     prev=torch.zeros(num_experts, dtype=torch.bool, device=device))
        return state

    @staticmethod
    def predict(state: dict[str, torch.Tensor], given: torch.Tensor) -> torch.Tensor:
        """given [..., E] bool -> p [..., E] float64 (an exact integer sum, times 2**-32)."""
        rows = (given.double().unsqueeze(-2) @ state["weight"]).squeeze(-2)     # [..., E]
        return (state["bias"] + rows) / _FIX_ONE

    def on_access(self, state, used, clock):
        prev = state["prev"]                                                     # [..., E]
        any_used = used.any(-1, keepdim=True)                                    # [..., 1]
        err = used.double() - self.predict(state, prev)
        norm = prev.sum(-1, keepdim=True).double() + 1.0
        delta = torch.round(err * self.learning_rate / norm * _FIX_ONE)
        delta = delta * any_used.double()                       # an empty plan learns nothing
        state["bias"].copy_((state["bias"] + delta).clamp(-_FIX_MAX, _FIX_MAX))
        step = prev.double().unsqueeze(-1) * delta.unsqueeze(-2)                 # [..., E, E]
        state["weight"].copy_((state["weight"] + step).clamp(-_FIX_MAX, _FIX_MAX))
        state["prev"].copy_(torch.where(any_used, used, prev))
        super().on_access(state, used, clock)

    def keep_score(self, state, clock):
        """With no wave given, the prediction is made from the last plan's experts."""
        return self.wave_keep_score(state, clock, state["prev"])

    def wave_keep_score(self, state, clock, needed):
        lrfu = super().keep_score(state, clock)
        return lrfu + self.predict(state, needed) * self.next_weight


_CONSTANTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device, params: tuple[float, float], decay: float,
               table_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(params, decay_pow) on ``device``, made once per (device, values) and shared by every
    layer (their pointers are recorded in CPU graphs, so they must stay alive and unchanged)."""
    key = (str(torch.device(device)), params, decay, table_len)
    if key not in _CONSTANTS:
        table = torch.pow(decay, torch.arange(table_len, dtype=torch.float64))
        _CONSTANTS[key] = (torch.tensor(params, dtype=torch.float64).to(device), table.to(device))
    return _CONSTANTS[key]


_REGISTRY: dict[str, EvictionPolicy] = {}


def register_policy(policy: EvictionPolicy) -> EvictionPolicy:
    _REGISTRY[policy.name] = policy
    return policy


for _p in (LRUPolicy(), LFUPolicy(), LFRUPolicy(), LRFUPolicy(), LRFUNextPolicy()):
    register_policy(_p)

DEFAULT_POLICY = "lrfu_next"
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
