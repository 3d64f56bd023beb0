"""Eviction policies: registry, and each policy inside Residency against a plain-Python simulator
that implements the policy's written definition independently (dicts and floats, no torch)."""
import random

import pytest
import torch

from vllm.config import MoECacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.fused_moe.expert_cache.policy import (
    DEFAULT_POLICY, EvictionPolicy, get_policy, policy_names)
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency


def _steps(n, num_experts, top_k, seed):
    rng = random.Random(seed)
    out, prev = [], list(range(top_k))
    for _ in range(n):
        keep = [e for e in prev if rng.random() < 0.4]                # some locality
        hot = [e for e in range(num_experts // 4) if e not in keep]
        rest = [e for e in range(num_experts) if e not in keep]
        pick = keep + rng.sample(hot if rng.random() < 0.5 and len(hot) >= top_k else rest,
                                 top_k)
        prev = sorted(set(pick))[:top_k]
        out.append(prev)
    return out


def _score_fns(decay=0.5 ** (1 / 30), w=0.2):
    """name -> (update(st, e, clock), score(st, e, clock)) from each policy's definition."""
    def upd_lru(st, e, t):
        st[e]["last"] = t

    def upd_freq(st, e, t):
        st[e]["freq"] += 1
        st[e]["last"] = t

    def upd_lrfu(st, e, t):
        st[e]["crf"] = st[e]["crf"] * decay ** (t - st[e]["last"]) + 1.0
        st[e]["last"] = t

    def sc_lrfu(st, e, t):
        dt = t - st[e]["last"]
        return st[e]["crf"] * decay ** dt * (1 - decay) + w / (dt + 1)

    return {"lru": (upd_lru, lambda st, e, t: st[e]["last"]),
            "lfu": (upd_freq, lambda st, e, t: st[e]["freq"]),
            "lfru": (upd_freq, lambda st, e, t: st[e]["freq"] / (t - st[e]["last"] + 1)),
            "lrfu": (upd_lrfu, sc_lrfu)}


def _plain_sim(steps, num_experts, num_slots, update, score):
    """Empty slots first; else evict the resident, non-needed expert with the lowest (score, id)."""
    st = [{"last": -1 if update.__name__ == "upd_lru" else 0, "freq": 0, "crf": 0.0}
          for _ in range(num_experts)]
    resident, hits, misses, clock = set(), 0, 0, 0
    for need in steps:
        scores = {x: score(st, x, clock) for x in resident}           # before this plan's update
        hits += sum(e in resident for e in need)
        for e in sorted(need):
            if e in resident:
                continue
            misses += 1
            if len(resident) == num_slots:
                victim = min((x for x in resident if x not in need), key=lambda x: (scores[x], x))
                resident.discard(victim)
            resident.add(e)
        for e in need:
            update(st, e, clock)
        clock += 1
    return hits, misses


@pytest.mark.parametrize("name", ["lru", "lfu", "lfru", "lrfu"])
@pytest.mark.parametrize("num_slots", [5, 9])
def test_policy_matches_plain_python(name, num_slots):
    steps = _steps(250, 16, 4, seed=num_slots)
    res = Residency(16, num_slots, get_policy(name))
    for need in steps:
        mask = torch.zeros(16, dtype=torch.bool)
        mask[need] = True
        res.plan(mask)
    update, score = _score_fns()[name]
    assert (int(res.hits), int(res.misses)) == _plain_sim(steps, 16, num_slots, update, score)


def test_policies_differ_somewhere():
    """Guards the simulator test against all policies collapsing to one behaviour."""
    steps = _steps(250, 16, 4, seed=1)
    results = set()
    for name in ("lru", "lfu", "lfru", "lrfu"):
        update, score = _score_fns()[name]
        results.add(_plain_sim(steps, 16, 6, update, score))
    assert len(results) >= 3


def test_registry_and_auto():
    assert {"lru", "lfu", "lfru", "lrfu"} <= set(policy_names())
    assert DEFAULT_POLICY in policy_names()
    assert get_policy("auto") is get_policy(DEFAULT_POLICY)
    assert isinstance(get_policy("lrfu"), EvictionPolicy)
    with pytest.raises(ValueError, match=r"'nope' is invalid: must be one of"):
        get_policy("nope")
    assert MoECacheConfig(cache_size=4, policy="lrfu").policy == "lrfu"
    # A name the registry lacks is rejected before any model is built, naming what is allowed.
    with pytest.raises(ValueError, match=r"moe_expert_cache_policy='belady' is invalid.*'lrfu'"):
        EngineArgs(moe_expert_cache_size=4, moe_expert_cache_policy="belady").create_engine_config()
    with pytest.raises(ValueError, match="moe_expert_cache_policy"):
        MoECacheConfig(cache_size=4, policy=3)


def test_lrfu_keeps_frequent_over_once_used():
    """Expert 0 used every step until t=8, expert 1 once at t=9: at t=10 expert 0 still
    outranks 1 (frequency), but a long idle time lets recency win again."""
    pol = get_policy("lrfu")
    st = pol.init_state(4, torch.device("cpu"))
    for t in range(9):
        pol.on_access(st, torch.tensor([True, False, False, False]), torch.tensor(t))
    pol.on_access(st, torch.tensor([False, True, False, False]), torch.tensor(9))
    s = pol.keep_score(st, torch.tensor(10))
    assert s[0] > s[1] > s[2] == s[3]          # 2, 3 never used
    for t in range(10, 400):
        pol.on_access(st, torch.tensor([False, False, True, False]), torch.tensor(t))
    s = pol.keep_score(st, torch.tensor(400))
    assert s[2] > s[0]


def test_bad_lrfu_params():
    from vllm.model_executor.layers.fused_moe.expert_cache.policy import LRFUPolicy
    with pytest.raises(ValueError, match="half_life=0"):
        LRFUPolicy(half_life=0)
