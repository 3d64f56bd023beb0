"""Prefetch bookkeeping of one cached MoE layer: which experts a predictor asks for, and how many
of those loads the real router then used or the cache threw away unused.

A predictor (the engine's: layer l+1's router run on layer l's hidden state,
``fused_moe/next_layer_prefetch.py``) hands the layer's provider predicted top-k ids [T, K]
before the layer's real step; ``CachedWeightProvider.prefetch`` then
  1. ``settle``s the previous prediction against the real step that ran since,
  2. picks at most N experts (``wanted_experts``) and makes them resident with
     ``Residency.load`` (the victims ``plan`` would choose, never a wanted expert; no policy
     update, no hit/miss count: only real requests teach the policy),
  3. copies the loads through the provider's copy engine and ``record``s them.
Exactness: the prefetch runs strictly between two real steps of its layer, so no expert kernel of
that layer reads a slot it overwrites (on a device, stream order), and the real step plans its
waves from whatever residency it finds: outputs are bitwise those without prefetch; only hits,
misses and copies change.

Counters (int64 [6], ``PREFETCH_COUNTERS``): predicted (experts asked for, summed over
predictions), loads (experts the prefetches copied), used (loads the real router needed in a
later step before they left the cache), wasted (loads evicted before any real use), recalled
and needed (over the real steps that followed a prediction: |predicted & needed| and |needed|,
so recall = recalled / needed). A load still resident and unused is neither used nor wasted yet.
Settling reads ``wave_of_expert`` (the last real step's needed set) and the clock (advanced by
each non-empty real wave, never by a prefetch); it runs at every prefetch, at the start of every
real step of a prefetching provider (``prepare``) and in ``stats``, so each real step is settled
before the next overwrites its needed set. Everything is fixed-shape tensor code: no host
synchronisation.
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan, Residency

PAD_SLOT_ID = -1
"""forward_context.PAD_SLOT_ID (restated: the cache must not import the model executor)."""

PREFETCH_COUNTERS = ("predicted", "loads", "used", "wasted", "recalled", "needed")


def wanted_experts(topk_ids: torch.Tensor, num_experts: int, num_slots: int,
                   row_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Predicted ids [T, K] (negative: none; rows whose slot is PAD_SLOT_ID ignored) -> [E]
    bool: the predicted experts, at most ``num_slots`` of them, most-predicted first (count of
    pairs naming it, ties to the lower id)."""
    valid = topk_ids >= 0
    if row_slots is not None:
        valid = valid & (row_slots != PAD_SLOT_ID).unsqueeze(1)
    ids = torch.where(valid, topk_ids.long(), num_experts).reshape(-1)        # [T*K] in [0, E]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts = counts.index_add_(0, ids, torch.ones_like(ids))[:num_experts]    # [E]
    expert_ids = torch.arange(num_experts, device=ids.device)
    key = (ids.numel() - counts) * num_experts + expert_ids                   # smaller: first
    rank = torch.empty_like(expert_ids).scatter_(0, torch.argsort(key), expert_ids)
    return (counts > 0) & (rank < num_slots)


class PrefetchState:
    """One layer's prefetch flags and counters (device tensors, read only by ``stats``)."""

    def __init__(self, num_experts: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.flagged = torch.zeros(num_experts, dtype=torch.bool, device=device)
        """[E] loaded by a prefetch, not yet needed by a real step nor evicted."""
        self.flag_clock = torch.zeros(num_experts, **i64)
        """[E] the residency clock when the flag was set (a real step ran since iff clock >)."""
        self.predicted = torch.zeros(num_experts, dtype=torch.bool, device=device)
        """[E] the last prediction, still to be compared with the next real step if pending."""
        self.pending = torch.zeros((), dtype=torch.bool, device=device)
        self.predicted_clock = torch.zeros((), **i64)
        self.counters = torch.zeros(len(PREFETCH_COUNTERS), **i64)

    def settle(self, res: Residency) -> None:
        """Account for the real step since the last prediction: loads it needed are used;
        loads no longer resident (evicted by a real step or another prefetch) are wasted; the
        pending prediction's recall. Idempotent until the next real step or load."""
        needed = res.wave_of_expert >= 0                                     # [E] last real step
        ran = res.clock > self.flag_clock                                    # [E]
        used = self.flagged & ran & needed
        flagged = self.flagged & ~used
        wasted = flagged & (res.slot_of_expert < 0)
        self.flagged.copy_(flagged & ~wasted)
        take = self.pending & (res.clock > self.predicted_clock)             # [] bool
        recalled = (self.predicted & needed).sum() * take
        self.pending.copy_(self.pending & ~take)
        zero = torch.zeros((), dtype=torch.int64, device=needed.device)
        self.counters.add_(torch.stack([zero, zero, used.sum(), wasted.sum(), recalled,
                                        needed.sum() * take]))

    def record(self, res: Residency, wanted: torch.Tensor, plan: LoadPlan) -> None:
        """After ``settle`` and ``res.load(wanted)`` returned ``plan``: flag its loads, keep the
        prediction pending, and count earlier loads this load evicted as wasted."""
        E = wanted.shape[0]
        loaded = torch.zeros(E + 1, dtype=torch.bool, device=wanted.device)
        loaded = loaded.index_fill_(0, torch.where(plan.valid, plan.experts, E), True)[:E]
        # Earlier loads this load evicted: wasted (``settle`` ran just before the load).
        gone = self.flagged & (res.slot_of_expert < 0)
        self.flagged.copy_((self.flagged & ~gone) | loaded)
        self.flag_clock.copy_(torch.where(loaded, res.clock, self.flag_clock))
        self.predicted.copy_(wanted)
        self.predicted_clock.copy_(res.clock)
        self.pending.fill_(True)
        zero = torch.zeros((), dtype=torch.int64, device=wanted.device)
        self.counters.add_(torch.stack([wanted.sum(), loaded.sum(), zero, gone.sum(), zero,
                                        zero]))

    def stats(self, bytes_per_expert: int) -> dict[str, int | float]:
        """Python numbers (a host sync; the stats path only). Recall is None before any
        prediction met a real step (e.g. the first MoE layer, which nothing predicts)."""
        c = dict(zip(PREFETCH_COUNTERS, self.counters.tolist()))
        return {f"prefetch_{k}": v for k, v in c.items()} | {
            "prefetch_recall": c["recalled"] / c["needed"] if c["needed"] else None,
            "prefetch_bytes": c["loads"] * bytes_per_expert,
            "prefetch_wasted_bytes": c["wasted"] * bytes_per_expert}
