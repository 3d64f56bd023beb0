"""Prefetch into a CachedWeightProvider: outputs bitwise unchanged at every capacity, loads never
evict a wanted expert nor teach the policy, and the counters equal a brute-force audit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from prefetch_audit import PrefetchAudit, brute_wanted
from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.prefetch import wanted_experts
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
from test_provider import E, H, I, K, build  # the shared layer builder


def _routing(g: torch.Generator, T: int) -> torch.Tensor:
    """[T, K] distinct ids per row, skewed towards low ids (so some experts recur)."""
    probs = torch.linspace(2.0, 0.5, E)
    return torch.stack([torch.multinomial(probs, K, generator=g) for _ in range(T)])


def _prediction(g: torch.Generator, real: torch.Tensor) -> torch.Tensor:
    """A noisy predictor: each id right with probability 1/2, else random; some -1."""
    noise = torch.randint(0, E, real.shape, generator=g)
    pred = torch.where(torch.rand(real.shape, generator=g) < 0.5, real, noise)
    return torch.where(torch.rand(real.shape, generator=g) < 0.1, -1, pred)


def test_wanted_experts_caps_most_predicted_first():
    ids = torch.tensor([[5, 1], [5, 3], [3, -1], [7, 5]])       # counts: 5:3, 3:2, 1:1, 7:1
    assert wanted_experts(ids, E, 2).nonzero().flatten().tolist() == [3, 5]
    assert wanted_experts(ids, E, 3).nonzero().flatten().tolist() == [1, 3, 5]   # 1 < 7
    assert wanted_experts(ids, E, 8).sum() == 4
    pad = torch.tensor([5, 5, -1, 5])                             # row 2 is graph padding
    assert wanted_experts(ids, E, 8, pad).nonzero().flatten().tolist() == [1, 3, 5, 7]
    assert wanted_experts(ids[2:3], E, 8, pad[2:3]).sum() == 0
    for n in (1, 2, 3, 8):
        assert set(wanted_experts(ids, E, n).nonzero().flatten().tolist()) == \
            brute_wanted(ids.tolist(), n)


@pytest.mark.parametrize("policy", ["lru", "lrfu", "lrfu_next"])
def test_load_is_no_access_and_picks_plans_victims(policy):
    g = torch.Generator().manual_seed(1)
    res = Residency(E, 4, get_policy(policy))
    for _ in range(6):
        res.plan(torch.rand(E, generator=g) < 0.4)
    # plan() of the same set on a copy chooses the same slots: load differs only in bookkeeping.
    twin = Residency(E, 4, get_policy(policy))
    for name in ("slot_of_expert", "expert_of_slot", "counters"):
        getattr(twin, name).copy_(getattr(res, name))
    for k, v in res.policy_state.items():
        twin.policy_state[k].copy_(v)
    counters = res.counters.clone()
    state = {k: v.clone() for k, v in res.policy_state.items()}
    wanted = torch.zeros(E, dtype=torch.bool)
    wanted[[0, 5, 6]] = True
    plan = res.load(wanted)
    twin_plan = twin.plan(wanted)
    assert torch.equal(plan.slots, twin_plan.slots) and torch.equal(plan.experts,
                                                                    twin_plan.experts)
    assert torch.equal(res.slot_of_expert, twin.slot_of_expert)
    assert (res.slot_of_expert[wanted] >= 0).all()
    assert torch.equal(res.counters, counters)                       # clock, hits, misses ...
    assert all(torch.equal(res.policy_state[k], v) for k, v in state.items())


@pytest.mark.parametrize("n,T", [(K, 1), (1, 3), (3, 3), (E // 2, 2)])
def test_outputs_bitwise_equal_and_counters_match_audit(n, T):
    """N = top_k, N = 1 < distinct experts of a step (waves), and larger: the same outputs with
    prefetch as without the cache; every prefetch counter as a brute-force audit computes it."""
    ref, cached = build(0), build(n)
    provider = cached.expert_cache
    audit = PrefetchAudit(provider)
    copied = [0]
    inner = provider.copy

    def counting_copy(slots, plan):
        copied[0] += int(plan.valid.sum())
        inner(slots, plan)
    provider.copy = counting_copy
    g = torch.Generator().manual_seed(n * 10 + T)
    real = _routing(g, T)
    for step in range(40):
        nxt = _routing(g, T)
        x = torch.randn(T, H, generator=g)
        w = torch.rand(T, K, generator=g)
        if step % 7 != 3:                                            # sometimes no prediction
            provider.prefetch(_prediction(g, real))
        assert torch.equal(cached.forward_experts(x, w, real), ref.forward_experts(x, w, real))
        if step % 5 == 4:                 # reading the stats mid-run changes no count
            assert PrefetchAudit.actual(provider.stats()) == audit.expected()
        real = nxt
    st = provider.stats()
    assert PrefetchAudit.actual(st) == audit.expected()
    assert st["hits"] + st["misses"] == audit.needed_total
    assert st["experts_copied"] == copied[0] == st["misses"] + st["prefetch_loads"]
    assert st["bytes_copied"] == copied[0] * provider.store.bytes_per_expert
    assert st["prefetch_loads"] > 0 and st["prefetch_used"] > 0
    assert st["prefetch_recall"] == pytest.approx(st["prefetch_recalled"] / st["prefetch_needed"])
    assert st["prefetch_wasted_bytes"] == st["prefetch_wasted"] * provider.store.bytes_per_expert


def test_stats_carry_prefetch_counters_only_when_prefetching():
    cached = build(3)
    assert not any(k.startswith("prefetch_") for k in cached.expert_cache.stats())
    cached.expert_cache.prefetch(torch.tensor([[1, 2]]))
    st = cached.expert_cache.stats()
    assert st["prefetch_loads"] == 2 and st["prefetch_recall"] is None   # no real step yet
    cached.expert_cache.reset_stats()
    assert cached.expert_cache.stats()["prefetch_loads"] == 0


def test_wiring_refuses_a_model_it_cannot_read():
    """A FusedMoE with no router Linear beside it (or no pre-MoE norm): a clear error."""
    from vllm.model_executor.layers.fused_moe.next_layer_prefetch import wire_next_layer_prefetch
    model = nn.Module()
    model.block = nn.Module()
    model.block.experts = build(2)
    with pytest.raises(ValueError, match="not supported for this model: block.experts: no router"):
        wire_next_layer_prefetch(model)
