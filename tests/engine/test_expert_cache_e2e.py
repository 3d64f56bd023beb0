"""The expert cache through the whole engine: outputs bitwise equal to the uncached engine at every
capacity, counters consistent with a replay of the routing trace recorded in the same run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency, split_waves
from vllm.model_executor.layers.fused_moe.expert_cache.trace import load_trace, step_masks

# (arch, num_experts, top_k) of the tiny configs in tests/model_executor/tiny_checkpoints.py
ARCHS = [("Qwen3MoeForCausalLM", 6, 2), ("MixtralForCausalLM", 4, 2), ("Qwen2MoeForCausalLM", 8, 2)]


def _prompts(n, seed=0, lo=2, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist()
            for k in torch.randint(lo, hi, (n,), generator=g)]


def _run(path, prompts, params, **kw):
    llm = LLM(path, **kw)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                       for d in (o.outputs[0].logprobs or [])]) for o in outs], llm


def _capacities(E, K):
    return sorted({1, 2, K, E // 2, E - 1})


@pytest.mark.parametrize("arch,E,K", ARCHS)
def test_greedy_bitwise_equal_at_every_capacity(tiny_model_factory, arch, E, K):
    path = tiny_model_factory(arch)
    prompts = _prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    ref, _ = _run(path, prompts, params)
    for n in _capacities(E, K):
        got, llm = _run(path, prompts, params, moe_expert_cache_size=n)
        assert got == ref, f"capacity {n}"
        stats = llm.get_moe_cache_stats()
        assert stats["misses"] > 0 and stats["hits"] + stats["misses"] > 0


@pytest.mark.parametrize("batch", [1, 64])
def test_seeded_sampling_equal_and_batch_sizes(tiny_model_factory, batch):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts(batch, seed=2)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=6, ignore_eos=True)
    ref, _ = _run(path, prompts, params)
    for n in (1, 3):
        got, _ = _run(path, prompts, params, moe_expert_cache_size=n)
        assert got == ref


def test_long_prefill_needs_waves(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM", max_position_embeddings=2048)
    prompt = _prompts(1, seed=4, lo=1100, hi=1101)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = dict(max_num_batched_tokens=2048, max_model_len=2048)
    ref, _ = _run(path, prompt, params, **kw)
    got, llm = _run(path, prompt, params, moe_expert_cache_size=2, **kw)
    assert got == ref
    runner = llm.llm_engine.runner
    waves = [m.expert_cache.stats()["waves"] for m in runner.moe_layers]
    # The 1100-token prefill needs all 6 experts with 2 slots: ceil(min(6, 2200) / 2) = 3 waves.
    assert all(w >= 3 for w in waves)


def test_capacity_at_least_num_experts_runs_uncached(tiny_model_factory, caplog):
    path = tiny_model_factory("MixtralForCausalLM")
    llm = LLM(path, moe_expert_cache_size=4)
    assert llm.get_moe_cache_stats() is None
    assert all(m.expert_cache is None for m in llm.llm_engine.runner.moe_layers)


@pytest.mark.parametrize("bad", [-1, "4", 1.5, True])
def test_bad_cache_size_rejected(tiny_model_factory, bad):
    with pytest.raises(ValueError, match="moe_expert_cache_size"):
        LLM(tiny_model_factory("Qwen3MoeForCausalLM"), moe_expert_cache_size=bad)


def test_bad_policy_rejected(tiny_model_factory):
    with pytest.raises(ValueError, match="moe_expert_cache_policy='nope'.*lru"):
        LLM(tiny_model_factory("Qwen3MoeForCausalLM"), moe_expert_cache_size=2,
            moe_expert_cache_policy="nope")


@pytest.mark.parametrize("policy", ["lru", "lfru", "auto"])
def test_engine_counts_equal_replay_of_recorded_trace(tiny_model_factory, tmp_path, policy):
    """One token per step (budget 1, one sequence at a time) makes engine steps = trace tokens, so
    a batch-1 replay of the recorded trace through Residency must give the same counts."""
    path = tiny_model_factory("Qwen2MoeForCausalLM")
    trace_path = str(tmp_path / "trace.npz")
    llm = LLM(path, moe_expert_cache_size=3, moe_expert_cache_policy=policy, max_num_seqs=1,
              max_num_batched_tokens=1, moe_routing_trace_path=trace_path)
    llm.generate(_prompts(3, seed=5, lo=3, hi=8),
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    stats = llm.get_moe_cache_stats()
    llm.llm_engine.shutdown()
    trace = load_trace(trace_path)
    assert trace.num_sequences == 3 and trace.num_layers == stats["num_layers"]
    masks = torch.from_numpy(step_masks(trace, 1))                   # [S, L, E]
    cache = llm.llm_engine.runner.moe_layers[0].expert_cache
    res = Residency(trace.num_experts, 3, get_policy(cache.policy_name), layers=trace.num_layers)
    for step in masks:
        for wave in split_waves(step, res.slot_of_expert, 3, trace.top_k):
            res.plan(wave)
    assert res.hits.tolist() == stats["per_layer"]["hits"]
    assert res.misses.tolist() == stats["per_layer"]["misses"]
    assert res.evictions.tolist() == stats["per_layer"]["evictions"]
    # hits + misses = distinct experts needed, summed over steps.
    assert (masks.sum(dim=(0, 2)).tolist() ==
            [h + m for h, m in zip(stats["per_layer"]["hits"], stats["per_layer"]["misses"])])


def test_recorded_trace_scores_are_the_engines_router_softmax(tiny_model_factory, tmp_path):
    """moe_routing_trace_scores: each token's scores row at each layer sums to 1 and its top-k
    are the recorded expert ids (the engine records what its own routers computed)."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    trace_path = str(tmp_path / "scores.npz")
    llm = LLM(path, moe_routing_trace_path=trace_path, moe_routing_trace_scores=True)
    llm.generate(_prompts(2, seed=3, lo=4, hi=9), SamplingParams(max_tokens=3, ignore_eos=True))
    llm.llm_engine.shutdown()
    trace = load_trace(trace_path)
    scores = trace.scores.astype(np.float32)                          # [T, L, E]
    assert scores.shape == (len(trace.experts), trace.num_layers, trace.num_experts)
    assert np.allclose(scores.sum(-1), 1.0, atol=1e-2)
    top = np.sort(np.argsort(-scores, -1, kind="stable")[..., :trace.top_k], -1)
    agree = (np.sort(trace.experts, -1) == top).all(-1).mean()
    assert agree > 0.99                                   # float16 ties may swap a rare pair
