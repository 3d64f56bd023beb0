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


# --- lrfu_next: lrfu plus an online-learned next-plan predictor ---------------------------------

def _lrfu_next_sim(steps, num_experts, num_slots, lr=0.03, a=1.0, decay=0.5 ** (1 / 30), w=0.2):
    """lrfu_next from its written definition, in Python ints and floats: weights are integers in
    units of 2**-32; victims ranked by lrfu + a * p(need), p from the plan being made."""
    one, cap = 2 ** 32, 2 ** 40
    weight = [[0] * num_experts for _ in range(num_experts)]
    bias, prev = [0] * num_experts, set()
    st = [{"last": 0, "crf": 0.0} for _ in range(num_experts)]
    update, lrfu = _score_fns(decay, w)["lrfu"]

    def p(given, j):
        return float(bias[j] + sum(weight[i][j] for i in given)) / one

    resident, hits, misses = set(), 0, 0
    for clock, need in enumerate(steps):
        scores = {x: lrfu(st, x, clock) + p(need, x) * a for x in resident}
        hits += sum(e in resident for e in need)
        for e in sorted(need):
            if e not in resident:
                misses += 1
                if len(resident) == num_slots:
                    resident.discard(min((x for x in resident if x not in need),
                                         key=lambda x: (scores[x], x)))
                resident.add(e)
        delta = [round(((e in need) - p(prev, e)) * lr / (len(prev) + 1.0) * one)
                 for e in range(num_experts)]
        for j in range(num_experts):
            bias[j] = max(-cap, min(cap, bias[j] + delta[j]))
            for i in prev:
                weight[i][j] = max(-cap, min(cap, weight[i][j] + delta[j]))
        prev = set(need)
        for e in need:
            update(st, e, clock)
    return hits, misses


@pytest.mark.parametrize("num_slots", [5, 9])
def test_lrfu_next_matches_plain_python(num_slots):
    steps = _steps(250, 16, 4, seed=num_slots)
    res = Residency(16, num_slots, get_policy("lrfu_next"))
    for need in steps:
        res.plan(torch.zeros(16, dtype=torch.bool).index_fill(0, torch.tensor(need), True))
    assert (int(res.hits), int(res.misses)) == _lrfu_next_sim(steps, 16, num_slots)
    # ... and it is not lrfu in disguise on this sequence.
    lrfu = Residency(16, num_slots, get_policy("lrfu"))
    for need in steps:
        lrfu.plan(torch.zeros(16, dtype=torch.bool).index_fill(0, torch.tensor(need), True))
    assert int(lrfu.misses) != int(res.misses)


def _one_hot(ids, n):
    return torch.zeros(n, dtype=torch.bool).index_fill(0, torch.tensor(ids, dtype=torch.long),
                                                       True)


def test_lrfu_next_learning_rule_by_hand():
    """Plans {0}, {1}, {0} with learning rate 1/2 (every value exact in binary):
    t=0: prev {}, p = 0, err = (1,0,0), delta = err/2/1  -> bias (.5,0,0)
    t=1: prev {0}, p = bias + W[0] = (.5,0,0), err = (-.5,1,0), delta = err/2/2
         -> bias (.375,.25,0), W[0] = (-.125,.25,0)
    t=2: prev {1}, p = bias + W[1] = (.375,.25,0), err = (.625,-.25,0), delta = err/2/2
         -> bias (.53125,.1875,0), W[1] = (.15625,-.0625,0)."""
    from vllm.model_executor.layers.fused_moe.expert_cache.policy import LRFUNextPolicy
    pol = LRFUNextPolicy(learning_rate=0.5)
    st = pol.init_state(3, torch.device("cpu"))
    for t, e in enumerate([0, 1, 0]):
        pol.on_access(st, _one_hot([e], 3), torch.tensor(t))
    one = 2.0 ** 32
    assert st["bias"].tolist() == [0.53125 * one, 0.1875 * one, 0.0]
    assert st["weight"].tolist() == [[-0.125 * one, 0.25 * one, 0.0],
                                     [0.15625 * one, -0.0625 * one, 0.0], [0.0] * 3]
    assert st["prev"].tolist() == [True, False, False]
    # After {0} the model expects 1 (0.4375) more than 0 (0.40625); after {1}, 0 (0.6875).
    assert pol.predict(st, _one_hot([0], 3)).tolist() == [0.40625, 0.4375, 0.0]
    assert pol.predict(st, _one_hot([1], 3)).tolist() == [0.6875, 0.125, 0.0]
    # An empty plan changes nothing.
    snap = {k: v.clone() for k, v in st.items()}
    pol.on_access(st, torch.zeros(3, dtype=torch.bool), torch.tensor(3))
    assert all(torch.equal(v, snap[k]) for k, v in st.items())


def test_lrfu_next_prediction_changes_the_victim_by_hand():
    """4 experts, 3 slots; plans {2}, {1}, {3} fill the slots, then {0} misses. With a near-zero
    half-life lrfu is recency 1/(dt+1): 2 -> 1/4, 1 -> 1/3, 3 -> 1/2, so lrfu evicts 2. A
    prediction p(2 | {0}) = 1/2 (set by hand) lifts 2 to 3/4 and lrfu_next evicts 1 instead."""
    from vllm.model_executor.layers.fused_moe.expert_cache.policy import (LRFUNextPolicy,
                                                                          LRFUPolicy)
    victims = {}
    for name, pol in (("lrfu", LRFUPolicy(half_life=0.01, recency_weight=1.0)),
                      ("lrfu_next", LRFUNextPolicy(half_life=0.01, recency_weight=1.0))):
        res = Residency(4, 3, pol)
        for e in (2, 1, 3):
            res.plan(_one_hot([e], 4))
        if name == "lrfu_next":
            res.policy_state["weight"].zero_()
            res.policy_state["bias"].zero_()
            res.policy_state["weight"][0, 2] = 0.5 * 2.0 ** 32
        before = set(res.expert_of_slot.tolist())
        res.plan(_one_hot([0], 4))
        victims[name] = before - set(res.expert_of_slot.tolist())
    assert victims == {"lrfu": {2}, "lrfu_next": {1}}


def test_lrfu_next_deterministic_and_batched_like_single():
    """Two runs give the same state bits; a batch of layers equals each layer alone."""
    layers, steps = 3, [_steps(120, 16, 4, seed=s) for s in range(3)]
    runs = []
    for _ in range(2):
        res = Residency(16, 6, get_policy("lrfu_next"), layers=layers)
        for t in range(120):
            res.plan(torch.stack([_one_hot(steps[i][t], 16) for i in range(layers)]))
        runs.append(res)
    assert all(torch.equal(v, runs[1].policy_state[k]) for k, v in runs[0].policy_state.items())
    for i in range(layers):
        single = Residency(16, 6, get_policy("lrfu_next"))
        for t in range(120):
            single.plan(_one_hot(steps[i][t], 16))
        assert torch.equal(single.slot_of_expert, runs[0].slot_of_expert[i])
        assert all(torch.equal(v, runs[0].policy_state[k][i])
                   for k, v in single.policy_state.items())


def test_bad_lrfu_next_params():
    from vllm.model_executor.layers.fused_moe.expert_cache.policy import LRFUNextPolicy
    with pytest.raises(ValueError, match="learning_rate=0"):
        LRFUNextPolicy(learning_rate=0)
    with pytest.raises(ValueError, match="next_weight=-1"):
        LRFUNextPolicy(next_weight=-1)
