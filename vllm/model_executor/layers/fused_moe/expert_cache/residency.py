"""Residency: which expert sits in which slot of one MoE layer (the cache's "block manager").

Everything here is fixed-shape tensor code on the slots' device: no host synchronisation, no
branching on tensor values, so ``plan``/``remap``/``split_waves`` run under
``torch.compile(fullgraph=True)`` and inside CUDA graphs.

A ``Residency`` may hold a batch of independent layers (``layers=L``): every per-layer tensor then
gains a leading ``[L]`` dim. The engine uses the unbatched case (one per FusedMoE); the replay
benchmark uses ``layers=L`` so one ``plan`` call advances all L layers of a step at once. The two
are the same code: the unbatched case is the batched one with an empty batch shape.

Invariants (per layer):
  slot_of_expert[e] == s >= 0  <=>  expert_of_slot[s] == e
  at most N experts are resident; an expert needed by a plan() is resident when it returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.policy import EvictionPolicy


@dataclass
class LoadPlan:
    """Copies one plan() asks for (the miss list); entry i means "copy expert experts[i] into
    slot slots[i]" when valid[i]. Fixed shape [..., N]; valid entries come first, invalid ones
    are padding with slots and experts -1."""
    slots: torch.Tensor       # [..., N] int64 (-1 where not valid)
    experts: torch.Tensor     # [..., N] int64 (-1 where not valid)
    valid: torch.Tensor       # [..., N] bool

    @property
    def num_loads(self) -> torch.Tensor:
        """[...] int64: how many experts the plan copies."""
        return self.valid.sum(-1)

    def head(self, n: int) -> "LoadPlan":
        """The first ``n`` entries (views): the whole plan when ``n`` is at least the number of
        loads, since valid entries come first."""
        return LoadPlan(self.slots[..., :n], self.experts[..., :n], self.valid[..., :n])


def num_waves(num_experts: int, max_needed: int, num_slots: int) -> int:
    """Static wave count: a step of T tokens x top-k needs at most min(E, T*k) distinct experts."""
    if num_slots < 1:
        raise ValueError(f"num_slots={num_slots} is invalid: must be >= 1")
    return max(1, -(-min(num_experts, max_needed) // num_slots))


def wave_capacity(num_experts: int, max_needed: int, num_slots: int, wave: int) -> int:
    """Static bound on the distinct experts (so slots, and loads) of ``wave``: the needed
    experts, at most D = min(E, T*k), are ranked and cut into chunks of ``num_slots``, so wave w
    holds ranks [w N, (w + 1) N) of them: min(N, D - w N). Below N only for a last wave (at
    N = E - 1 and T*k >= E: one expert), whose grids the expert kernels size by it."""
    waves = num_waves(num_experts, max_needed, num_slots)
    if not 0 <= wave < waves:
        raise ValueError(f"wave={wave} is invalid: this step has waves 0..{waves - 1}")
    return min(num_slots, min(num_experts, max_needed) - wave * num_slots)


def wave_index(needed: torch.Tensor, slot_of_expert: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[..., E] int64: which wave each needed expert runs in (-1 = not needed).

    Needed experts are ordered resident-first, then by expert id, and cut into chunks of
    ``num_slots``; so if any wave has a miss, every resident needed expert is in wave 0 (hits are
    never deferred behind loads) and later waves hold only misses.
    """
    num_experts = needed.shape[-1]
    ids = torch.arange(num_experts, device=needed.device)
    # key: resident needed < non-resident needed < not needed; ties by expert id.
    key = torch.where(needed, torch.where(slot_of_expert >= 0, 0, 1), 2) * num_experts + ids
    order = torch.argsort(key, dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, ids.expand_as(order).contiguous())
    return torch.where(needed, rank // num_slots, -1)


def split_waves(needed: torch.Tensor, slot_of_expert: torch.Tensor, num_slots: int,
                max_needed: int) -> list[torch.Tensor]:
    """Split needed [..., E] bool into ``num_waves(E, max_needed, num_slots)`` masks [..., E] bool,
    each with at most ``num_slots`` experts (trailing ones may be empty; plan() of an empty wave is
    a no-op). ``max_needed`` is a static bound on distinct experts, normally T * top_k.
    ``slot_of_expert`` must be the residency *before* the first wave is planned."""
    count = num_waves(needed.shape[-1], max_needed, num_slots)
    if count == 1:          # static: at most num_slots distinct experts can be needed
        return [needed]
    waves = wave_index(needed, slot_of_expert, num_slots)
    return [waves == w for w in range(count)]


COUNTERS = ("clock", "hits", "misses", "evictions", "last_hits", "last_misses", "waves",
            "step_waves")
"""The int64 counters of a Residency, in the order of its ``counters`` tensor (the fused
residency step writes them by index): the plan clock (plans that needed an expert); cumulative
hits, misses (= experts copied), evictions and non-empty waves; the last non-empty plan's hits
and misses; and the current step's count of non-empty waves (written when its wave 0 is
planned by the residency step)."""


class Residency:
    """Slot maps + policy state + counters for one MoE layer (or a batch of ``layers``)."""

    def __init__(self, num_experts: int, num_slots: int, policy: EvictionPolicy,
                 device: torch.device | str | None = None, layers: int | None = None):
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots={num_slots} is invalid: must be in [1, num_experts="
                             f"{num_experts}]")
        if layers is not None and layers < 1:
            raise ValueError(f"layers={layers} is invalid: must be >= 1 or None")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_experts, self.num_slots, self.policy = num_experts, num_slots, policy
        self.batch_shape: tuple[int, ...] = () if layers is None else (layers,)
        b = self.batch_shape
        i64 = dict(dtype=torch.int64, device=device)
        self.slot_of_expert = torch.full((*b, num_experts), -1, **i64)   # [..., E], -1 = absent
        self.expert_of_slot = torch.full((*b, num_slots), -1, **i64)     # [..., N], -1 = empty
        self.wave_of_expert = torch.full((*b, num_experts), -1, **i64)
        """[..., E] the current step's wave of each needed expert (-1: not needed); written by
        the residency step at wave 0 (``residency_step.py``)."""
        self.counters = torch.zeros(*b, len(COUNTERS), **i64)               # [..., 8]
        # Views of ``counters``. Clock broadcasts against [..., E]: a scalar unbatched, [L, 1]
        # batched.
        self.clock = self.counters[..., 0:1] if b else self.counters[0]
        (self.hits, self.misses, self.evictions, self.last_hits, self.last_misses, self.waves,
         self.step_waves) = (self.counters[..., i] for i in range(1, len(COUNTERS)))
        self.policy_state = {k: v.expand(*b, *v.shape).clone()
                             for k, v in policy.init_state(num_experts, device).items()}
        self._ids_e = torch.arange(num_experts, device=device)
        self._ids_n = torch.arange(num_slots, device=device)

    def plan(self, needed: torch.Tensor) -> LoadPlan:
        """Make needed [..., E] bool resident (precondition: needed.sum(-1) <= N).

        Hits stay in their slots; each miss (in expert-id order) takes a victim slot among slots
        not holding a needed expert: empty slots first (by slot index), then the lowest policy
        keep score (``wave_keep_score`` of this wave), ties broken by the lower expert id. An
        empty ``needed`` is an exact no-op (maps, clock, policy state and every counter
        unchanged).
        """
        clock = self.clock
        resident = self.slot_of_expert >= 0
        plan, num_miss, evicted = self._place(needed)
        # Policy sees the wave after the victim choice; empty waves change nothing.
        self.policy.on_access(self.policy_state, needed, clock)
        hits = (needed & resident).sum(-1)
        any_needed = needed.any(-1)
        self.last_hits.copy_(torch.where(any_needed, hits, self.last_hits))
        self.last_misses.copy_(torch.where(any_needed, num_miss, self.last_misses))
        self.hits.add_(hits)
        self.misses.add_(num_miss)
        self.evictions.add_(evicted.sum(-1))
        self.waves.add_(any_needed)
        self.clock.add_(any_needed.unsqueeze(-1) if self.batch_shape else any_needed)
        return plan

    def load(self, wanted: torch.Tensor) -> LoadPlan:
        """Make wanted [..., E] bool resident as ``plan`` would (same victims: never a wanted
        expert), but as no access: policy state, clock and every counter stay as they are, so
        only the router's real requests teach the policy and count as hits or misses. The
        prefetcher's entry point (``prefetch.py``); precondition wanted.sum(-1) <= N."""
        return self._place(wanted)[0]

    def _place(self, needed: torch.Tensor) -> tuple[LoadPlan, torch.Tensor, torch.Tensor]:
        """Choose victims for the non-resident ``needed`` experts and update both maps.
        Returns (the plan, misses [...] int64, evicted [..., N] bool: valid entries that
        replaced an expert)."""
        n, e = self.num_slots, self.num_experts
        miss = needed & (self.slot_of_expert < 0)
        num_miss = miss.sum(-1)                                              # [...]
        score = self.policy.wave_keep_score(self.policy_state, self.clock, needed)  # [..., E]
        # Rank experts by (score, expert id): a stable sort over ids already in order.
        by_score = torch.sort(score, dim=-1, stable=True).indices
        rank = torch.empty_like(by_score).scatter_(
            -1, by_score, self._ids_e.expand_as(by_score).contiguous())     # [..., E]
        held = self.expert_of_slot.clamp(min=0)
        slot_key = torch.gather(rank, -1, held)                              # [..., N]
        slot_needed = torch.gather(needed, -1, held) & (self.expert_of_slot >= 0)
        slot_key = torch.where(self.expert_of_slot < 0, -1, slot_key)        # empty first
        slot_key = torch.where(slot_needed, e, slot_key)                     # needed never
        victims = torch.sort(slot_key, dim=-1, stable=True).indices          # [..., N]
        # Miss experts in id order, first N of them (at most N misses by the precondition).
        miss_key = torch.where(miss, 0, 1) * e + self._ids_e
        miss_experts = torch.argsort(miss_key, dim=-1)[..., :n]              # [..., N]
        valid = self._ids_n < num_miss.unsqueeze(-1)                         # [..., N]
        experts = torch.where(valid, miss_experts, -1)
        slots = torch.where(valid, victims, -1)
        old = torch.gather(self.expert_of_slot, -1, victims)                 # [..., N]
        evicted = valid & (old >= 0)
        self._apply(slots, experts, valid, old, evicted)
        return LoadPlan(slots, experts, valid), num_miss, evicted

    def _apply(self, slots: torch.Tensor, experts: torch.Tensor, valid: torch.Tensor,
               old: torch.Tensor, evicted: torch.Tensor) -> None:
        """Update both maps; invalid entries scatter into a dump column (index E / N) that is
        dropped, so shapes stay fixed and nothing branches on values."""
        n, e = self.num_slots, self.num_experts
        pad = torch.full((*self.batch_shape, 1), -1, dtype=torch.int64, device=slots.device)
        soe = torch.cat([self.slot_of_expert, pad], -1)                      # [..., E+1]
        soe.scatter_(-1, torch.where(evicted, old, e), pad.expand_as(old))
        soe.scatter_(-1, torch.where(valid, experts, e), slots)
        eos = torch.cat([self.expert_of_slot, pad], -1)                      # [..., N+1]
        eos.scatter_(-1, torch.where(valid, slots, n), experts)
        self.slot_of_expert.copy_(soe[..., :e])
        self.expert_of_slot.copy_(eos[..., :n])

    def invalidate(self) -> None:
        """Forget every slot's expert (in place: graphs hold these tensors), for after a step
        failed part-way, when a map may name an expert whose copy never ran. Policy state and
        counters stay; later steps copy what they need again, so outputs stay exact."""
        self.slot_of_expert.fill_(-1)
        self.expert_of_slot.fill_(-1)
        self.wave_of_expert.fill_(-1)

    def remap(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] global expert ids -> [T, K] slot ids (-1 where not resident). Unbatched only."""
        if self.batch_shape:
            raise ValueError("remap() is per layer: this Residency holds a batch of layers")
        return self.slot_of_expert[topk_ids.long()]

    def resident_mask(self) -> torch.Tensor:
        """[..., E] bool, experts currently in a slot."""
        return self.slot_of_expert >= 0
