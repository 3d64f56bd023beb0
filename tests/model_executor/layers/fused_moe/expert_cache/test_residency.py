"""Residency: invariants, LRU against a plain-Python simulator, waves, batching, compile."""
import random

import pytest
import torch

from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.residency import (
    Residency, num_waves, split_waves, wave_capacity)


def _random_steps(num_steps, num_experts, top_k, seed):
    rng = random.Random(seed)
    hot = list(range(max(top_k, num_experts // 3)))
    steps = []
    for _ in range(num_steps):
        pool = hot if rng.random() < 0.6 else list(range(num_experts))
        steps.append(sorted(rng.sample(pool, top_k)))
    return steps


def _plain_lru(steps, num_slots):
    """Reference: per step, hits refresh; each miss (in id order) evicts the least recently used
    expert not needed in this step, ties to the lower expert id. Returns (hits, misses)."""
    last, hits, misses = {}, 0, 0
    for t, need in enumerate(steps):
        for e in need:
            if e in last:
                hits += 1
        for e in sorted(need):
            if e not in last:
                misses += 1
                if len(last) == num_slots:
                    victim = min((x for x in last if x not in need), key=lambda x: (last[x], x))
                    del last[victim]
                last[e] = t
        for e in need:
            last[e] = t
    return hits, misses


def _mask(ids, num_experts):
    m = torch.zeros(num_experts, dtype=torch.bool)
    m[list(ids)] = True
    return m


def _check_invariants(res):
    soe, eos = res.slot_of_expert.tolist(), res.expert_of_slot.tolist()
    for e, s in enumerate(soe):
        if s >= 0:
            assert eos[s] == e
    for s, e in enumerate(eos):
        if e >= 0:
            assert soe[e] == s
    assert sum(s >= 0 for s in soe) <= res.num_slots


@pytest.mark.parametrize("num_slots", [4, 7, 12])
def test_lru_matches_plain_python(num_slots):
    steps = _random_steps(300, 16, 4, seed=num_slots)
    res = Residency(16, num_slots, get_policy("lru"))
    for need in steps:
        res.plan(_mask(need, 16))
        _check_invariants(res)
        assert all(res.slot_of_expert[e] >= 0 for e in need)
    hits, misses = _plain_lru(steps, num_slots)
    assert (int(res.hits), int(res.misses)) == (hits, misses)
    assert int(res.evictions) == misses - num_slots


def test_load_plan_contents():
    res = Residency(8, 3, get_policy("lru"))
    plan = res.plan(_mask([5, 1], 8))
    assert int(plan.num_loads) == 2 and plan.valid.tolist() == [True, True, False]
    # Misses in expert-id order take the empty slots first.
    assert plan.experts[:2].tolist() == [1, 5]
    assert res.slot_of_expert[1] == plan.slots[0] and res.slot_of_expert[5] == plan.slots[1]
    res.plan(_mask([2], 8))        # fills the last empty slot
    plan = res.plan(_mask([5, 7], 8))
    # 5 is a hit; 7 evicts the LRU among non-needed {1 (t=0), 2 (t=1)} -> expert 1's slot.
    assert (int(res.last_hits), int(res.last_misses)) == (1, 1)
    assert plan.experts[0] == 7 and plan.valid.tolist() == [True, False, False]
    assert res.slot_of_expert[1] == -1 and res.slot_of_expert[7] >= 0
    remapped = res.remap(torch.tensor([[5, 7]]))
    assert remapped.tolist() == [[int(res.slot_of_expert[5]), int(res.slot_of_expert[7])]]


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "lrfu", "lrfu_next"])
def test_never_evicts_needed_expert(policy):
    res = Residency(12, 4, get_policy(policy))
    for need in _random_steps(200, 12, 4, seed=3):
        before = res.slot_of_expert.clone()
        plan = res.plan(_mask(need, 12))
        for e in need:   # a needed resident expert keeps its slot
            if before[e] >= 0:
                assert res.slot_of_expert[e] == before[e]
        assert set(res.expert_of_slot.tolist()) >= set(need)
        assert int(plan.num_loads) == sum(int(before[e]) < 0 for e in need)


@pytest.mark.parametrize("policy", ["lfru", "lrfu_next"])
def test_empty_plan_is_noop(policy):
    res = Residency(8, 2, get_policy(policy))
    res.plan(_mask([0, 3], 8))
    snap = (res.clock.clone(), res.slot_of_expert.clone(),
            {k: v.clone() for k, v in res.policy_state.items()})
    plan = res.plan(torch.zeros(8, dtype=torch.bool))
    assert int(plan.num_loads) == 0 and torch.equal(res.clock, snap[0])
    assert torch.equal(res.slot_of_expert, snap[1])
    assert all(torch.equal(v, snap[2][k]) for k, v in res.policy_state.items())


def test_split_waves_order_and_count():
    soe = torch.full((10,), -1, dtype=torch.int64)
    soe[7], soe[2] = 0, 1                      # 7 and 2 resident
    needed = _mask([1, 2, 4, 7, 8, 9], 10)
    waves = split_waves(needed, soe, num_slots=4, max_needed=12)
    assert len(waves) == num_waves(10, 12, 4) == 3
    got = [torch.nonzero(w).flatten().tolist() for w in waves]
    # resident-first (2, 7), then by id (1, 4 | 8, 9); last wave empty.
    assert got == [[1, 2, 4, 7], [8, 9], []]


@pytest.mark.parametrize("E,N,max_needed", [(10, 4, 12), (64, 63, 256), (64, 16, 8),
                                             (8, 3, 8), (6, 5, 2), (5, 1, 9)])
def test_wave_capacity_bounds_every_wave_and_is_reached(E, N, max_needed):
    """No wave of split_waves ever holds more experts than wave_capacity, over random needed
    sets of every size up to min(E, max_needed); when all of them are needed each wave holds
    exactly its capacity (N for all but a last wave: one expert at N = 63 of 64)."""
    D = min(E, max_needed)
    W = num_waves(E, max_needed, N)
    caps = [wave_capacity(E, max_needed, N, w) for w in range(W)]
    assert sum(caps) == D and all(1 <= c <= N for c in caps)
    rng = random.Random(E * N + max_needed)
    for trial in range(60):
        soe = torch.full((E,), -1, dtype=torch.int64)
        for slot, e in enumerate(rng.sample(range(E), N)):
            soe[e] = slot
        size = D if trial == 0 else rng.randint(0, D)
        waves = split_waves(_mask(rng.sample(range(E), size), E), soe, N, max_needed)
        counts = [int(w.sum()) for w in waves]
        assert all(c <= cap for c, cap in zip(counts, caps)), (counts, caps)
        if size == D:
            assert counts == caps
    with pytest.raises(ValueError, match=f"wave={W} is invalid"):
        wave_capacity(E, max_needed, N, W)


def test_waves_through_plan_match_sequential_lru():
    """Splitting a too-large step into waves and planning each keeps every wave resident."""
    res = Residency(16, 5, get_policy("lru"))
    for need in _random_steps(100, 16, 9, seed=5):
        for w in split_waves(_mask(need, 16), res.slot_of_expert, 5, max_needed=9):
            ids = torch.nonzero(w).flatten().tolist()
            res.plan(w)
            assert all(res.slot_of_expert[e] >= 0 for e in ids)
            _check_invariants(res)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "lrfu", "lrfu_next"])
def test_batched_layers_equal_independent(policy):
    layers, steps = 3, [_random_steps(150, 16, 4, seed=10 + i) for i in range(3)]
    batched = Residency(16, 6, get_policy(policy), layers=layers)
    singles = [Residency(16, 6, get_policy(policy)) for _ in range(layers)]
    for t in range(150):
        needed = torch.stack([_mask(steps[i][t], 16) for i in range(layers)])
        batched.plan(needed)
        for i in range(layers):
            singles[i].plan(needed[i])
    for i in range(layers):
        assert torch.equal(batched.slot_of_expert[i], singles[i].slot_of_expert)
        assert int(batched.hits[i]) == int(singles[i].hits)


@pytest.mark.parametrize("policy", ["lfru", "lrfu", "lrfu_next"])
def test_plan_compiles_fullgraph(policy):
    res = Residency(16, 6, get_policy(policy))
    ref = Residency(16, 6, get_policy(policy))

    def step(topk_ids):
        needed = torch.zeros(16, dtype=torch.bool).index_fill(0, topk_ids.flatten(), True)
        for w in split_waves(needed, res.slot_of_expert, 6, max_needed=topk_ids.numel()):
            res.plan(w)
        return res.remap(topk_ids)

    # aot_eager: dynamo full-graph capture + functionalisation of the in-place map updates, without
    # inductor's C++ build (which also passes but takes ~30 s on this machine).
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for need in _random_steps(20, 16, 4, seed=1):
        ids = torch.tensor([need])
        slots = compiled(ids)
        ref.plan(_mask(need, 16))
        assert torch.equal(slots, ref.remap(ids))
    assert int(res.hits) == int(ref.hits)
