"""Shared by the expert-cache tests: random routing steps like real decode and prefill batches, a
residency's whole state as comparable values, two steps compared wave by wave, and a plain-Python
LRU simulator."""
from __future__ import annotations

import random

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency, num_waves

POLICIES = ["lru", "lfu", "lfru", "lrfu"]


def plain_lru(steps, num_slots: int) -> tuple[int, int]:
    """Independent LRU (per step: hits refresh; misses in id order evict the least recently used
    expert not needed now, ties to the lower id) over steps of needed expert ids: (hits,
    misses)."""
    last, hits, misses = {}, 0, 0
    for t, need in enumerate(steps):
        hits += sum(e in last for e in need)
        for e in sorted(need):
            if e not in last:
                misses += 1
                if len(last) == num_slots:
                    del last[min((x for x in last if x not in need), key=lambda x: (last[x], x))]
                last[e] = t
        for e in need:
            last[e] = t
    return hits, misses


def bits(t: torch.Tensor) -> list:
    return (t.view(torch.int64) if t.dtype == torch.float64 else t).tolist()


def state_of(res: Residency) -> dict:
    return {"slot_of_expert": res.slot_of_expert.tolist(),
            "expert_of_slot": res.expert_of_slot.tolist(),
            "wave_of_expert": res.wave_of_expert.tolist(), "counters": res.counters.tolist(),
            **{k: bits(v) for k, v in res.policy_state.items()}}


def random_steps(E: int, K: int, num_steps: int, seed: int):
    """(topk_ids [T, K], row_slots [T] or None) steps with a drifting hot set (like real
    routing), distinct experts per row, some skipped pairs (-1) and some padding rows."""
    rng = random.Random(seed)
    hot = rng.sample(range(E), max(K, E // 4))
    for step in range(num_steps):
        if step % 25 == 0:
            hot[rng.randrange(len(hot))] = rng.randrange(E)
        T = rng.choice([1, 1, 2, 3, 8, rng.randint(1, 40)])
        rows = []
        for _ in range(T):
            pool = hot if rng.random() < 0.7 else range(E)
            row = rng.sample(sorted(set(pool)), K) if len(set(pool)) >= K else \
                rng.sample(range(E), K)
            if rng.random() < 0.05:
                row[rng.randrange(K)] = -1
            rows.append(row)
        row_slots = None
        if rng.random() < 0.3:
            row_slots = torch.tensor([-1 if rng.random() < 0.3 else t for t in range(T)])
        yield torch.tensor(rows, dtype=torch.int64), row_slots


def step_both(step_a, step_b, ref: Residency, ker: Residency, ids: torch.Tensor,
              row_slots: torch.Tensor | None) -> None:
    """One step of W waves, step_a on ref and step_b on ker: every output and all state equal
    after each wave."""
    T, K = ids.shape
    for wave in range(num_waves(ref.num_experts, T * K, ref.num_slots)):
        p1, s1 = step_a(ref, ids, row_slots, wave)
        p2, s2 = step_b(ker, ids, row_slots, wave)
        assert p1.slots.tolist() == p2.slots.tolist(), wave
        assert p1.experts.tolist() == p2.experts.tolist(), wave
        assert p1.valid.tolist() == p2.valid.tolist(), wave
        assert s1.tolist() == s2.tolist(), wave
        assert state_of(ref) == state_of(ker), wave
