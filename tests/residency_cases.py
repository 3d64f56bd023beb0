"""Shared by the expert-cache tests: random routing steps like real decode and prefill batches, a
residency's whole state as comparable values, two steps compared wave by wave (or one planning
all waves in one call against the other wave by wave), and a plain-Python LRU simulator."""
from __future__ import annotations

import random

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency, num_waves

POLICIES = ["lru", "lfu", "lfru", "lrfu", "lrfu_next"]
"""The policies with a fused residency step (kernel_code), which its tests cover."""


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


def saturate_predictor(states: list[dict[str, torch.Tensor]], seed: int) -> None:
    """Gives lrfu_next policy states [E] (all alike) the same random weight and bias integers over
    the whole +-2**40 range, half the weights within 2**34 of a bound (two rows at them), and a
    random ``prev``: the kernels' sums of large terms and the clamps of their update then run."""
    g = torch.Generator().manual_seed(seed)
    E = states[0]["bias"].shape[-1]
    bound = 2 ** 40
    weight = torch.randint(-bound, bound + 1, (E, E), generator=g, dtype=torch.float64)
    near = bound - torch.randint(0, 2 ** 34, (E, E), generator=g, dtype=torch.float64)
    weight = torch.where(torch.rand(E, E, generator=g) < 0.5, weight.sign() * near, weight)
    weight[0], weight[1] = bound, -bound
    bias = torch.randint(-bound, bound + 1, (E,), generator=g, dtype=torch.float64)
    prev = torch.rand(E, generator=g) < 0.5
    for state in states:
        for name, value in (("weight", weight), ("bias", bias), ("prev", prev)):
            state[name].copy_(value)


def plan_values(plan, slot_ids) -> tuple:
    """A wave's (plan slots, plan experts, plan valid, slot ids) as lists, to compare."""
    return (plan.slots.tolist(), plan.experts.tolist(), plan.valid.tolist(), slot_ids.tolist())


def step_both(step_a, step_b, ref: Residency, ker: Residency, ids: torch.Tensor,
              row_slots: torch.Tensor | None) -> None:
    """One step of W waves, step_a on ref and step_b on ker: every output and all state equal
    after each wave."""
    T, K = ids.shape
    for wave in range(num_waves(ref.num_experts, T * K, ref.num_slots)):
        want = plan_values(*step_a(ref, ids, row_slots, wave))
        assert plan_values(*step_b(ker, ids, row_slots, wave)) == want, wave
        assert state_of(ref) == state_of(ker), wave


def step_all_waves(step_a, step_b, ref: Residency, ker: Residency, ids: torch.Tensor,
                   row_slots: torch.Tensor | None) -> int:
    """One step of W waves: step_a on ref wave by wave, step_b's ``waves`` on ker (a fused
    kernel plans all W in one call): every wave's plan and slot ids equal, and all state after
    the step. Returns W."""
    T, K = ids.shape
    W = num_waves(ref.num_experts, T * K, ref.num_slots)
    want = [plan_values(*step_a(ref, ids, row_slots, wave)) for wave in range(W)]
    got = [plan_values(*out) for out in step_b.waves(ker, ids, row_slots, W)]
    assert len(got) == W
    for wave in range(W):
        assert got[wave] == want[wave], wave
    assert state_of(ref) == state_of(ker)
    return W
