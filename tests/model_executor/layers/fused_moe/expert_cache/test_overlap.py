"""Miss copies overlapped with the hit experts (``expert_cache/overlap.py``).

On CPU there is no side stream, so these tests give the platform ``RecordingSideStream``
(tests/side_streams.py): it runs forked work inline and records the order of forks, copies, joins
and kernel passes, which is the schedule a CUDA stream would be given. What a GPU adds (the copy really running beside the hit
pass) is checked by the ``gpu`` test at the end."""
from __future__ import annotations

import pytest
import torch
from side_streams import RecordingSideStream, hand_out_side_streams
from test_provider import E, H, build  # the shared layer builder

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.fused_moe.expert_cache.overlap import split_pairs
from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
from vllm.platforms import platform_for


@pytest.fixture
def side_streams(monkeypatch):
    """The CPU platform hands out recording side streams; returns every one it made."""
    return hand_out_side_streams(monkeypatch, type(platform_for("cpu")))


def _plan(g, N, T, K):
    """A random wave: slot ids with -1 holes, and a plan loading a random subset of slots."""
    slot_ids = torch.randint(-1, N, (T, K), generator=g)
    valid = torch.rand(N, generator=g) < 0.4
    slots = torch.where(valid, torch.randperm(N, generator=g), -1)   # invalid: garbage (-1)
    experts = torch.where(valid, torch.randint(0, 50, (N,), generator=g), -1)
    return slot_ids, LoadPlan(slots, experts, valid)


@pytest.mark.parametrize("N,T,K", [(1, 1, 1), (4, 3, 2), (8, 1, 8), (16, 33, 6)])
def test_split_pairs_against_a_loop(N, T, K):
    g = torch.Generator().manual_seed(N * 100 + T)
    for _ in range(20):
        slot_ids, plan = _plan(g, N, T, K)
        loaded = {int(s) for s, v in zip(plan.slots, plan.valid) if v}
        hits, misses = split_pairs(slot_ids, plan, N)
        for t in range(T):
            for k in range(K):
                s = int(slot_ids[t, k])
                want_miss = s >= 0 and s in loaded
                assert int(misses[t, k]) == (s if want_miss else -1)
                assert int(hits[t, k]) == (-1 if want_miss else s)


def _spy(llm):
    """Log every copy (whether it ran inside a fork, what it loaded) and every kernel pass's ids
    into the log of the provider's side stream."""
    for m in llm.llm_engine.runner.moe_layers:
        provider, method = m.expert_cache, m.quant_method
        copy, apply_pairs, side = provider.copy, method.apply_pairs, provider.side_stream

        def spy_copy(slots, plan, copy=copy, side=side):
            side.log.append(("copy", side.forked, plan.slots.clone(), plan.valid.clone()))
            copy(slots, plan)

        def spy_apply(weights, x, w, ids, out, max_ids=None, apply_pairs=apply_pairs,
                      side=side):
            assert max_ids is not None and ids[ids >= 0].unique().numel() <= max_ids
            side.log.append(("pass", ids.clone()))
            apply_pairs(weights, x, w, ids, out, max_ids=max_ids)
        provider.copy, method.apply_pairs = spy_copy, spy_apply


def _check_waves(log: list) -> tuple[int, int]:
    """Per wave: fork, the copy inside it, the hit pass, join, the miss pass; the hit pass never
    reads a slot the copy writes, the miss pass only such slots. -> (waves, miss pairs)."""
    waves, i, missed = 0, 0, 0
    while i < len(log):
        assert log[i] == "fork", log[i]
        _, forked, slots, valid = log[i + 1]
        (_, hits), join, (_, misses) = log[i + 2:i + 5]
        assert forked and join == "join"
        loaded = set(slots[valid].tolist())
        assert not loaded & set(hits[hits >= 0].tolist())
        assert set(misses[misses >= 0].tolist()) <= loaded
        assert not ((hits >= 0) & (misses >= 0)).any()
        waves, missed, i = waves + 1, missed + int((misses >= 0).sum()), i + 5
    return waves, missed


def test_schedule_copy_forked_hits_before_join_misses_after(tiny_model_factory, side_streams):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(path, moe_expert_cache_size=2, moe_expert_overlap=True, enforce_eager=True)
    assert all(m.expert_cache.side_stream is not None for m in llm.llm_engine.runner.moe_layers)
    _spy(llm)
    llm.generate([[5, 17, 99, 3], [250, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    for stream in side_streams:
        waves, missed = _check_waves(stream.log)
        assert waves > 0 and missed > 0


def test_prefetch_copies_are_forked_and_joined_before_the_next_plan(tiny_model_factory,
                                                                    side_streams):
    """With next-layer prefetch, a predicted layer's log is: fork, the prefetch's copy inside
    it; then join before anything of that layer's real step; then its waves as above."""
    path = tiny_model_factory("Qwen3MoeForCausalLM", num_hidden_layers=3)
    llm = LLM(path, moe_expert_cache_size=2, moe_expert_overlap=True,
              moe_expert_prefetch="next-layer", enforce_eager=True)
    _spy(llm)
    llm.generate([[5, 17, 99, 3], [250, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    first, *predicted = side_streams
    assert _check_waves(first.log)[0] > 0                      # nothing predicts layer 0
    assert {r for _, r in first.roles} == {"misses"}
    for stream in predicted:
        log, i, prefetches, waves = stream.log, 0, 0, 0
        while i < len(log):
            assert log[i] == "fork" and log[i + 1][0] == "copy" and log[i + 1][1], log[i:i + 2]
            if log[i + 2] == "join":                           # a prefetch, then the real plan
                prefetches, i = prefetches + 1, i + 3
                continue
            waves, i = waves + _check_waves(log[i:i + 5])[0], i + 5
        assert prefetches > 0 and waves > 0
        # Prefetches fork and join on their own stream, so a wave's miss copy (forked after
        # the next layer's prefetch) never queues behind it.
        assert stream.roles.count(("fork", "prefetch")) == prefetches
        assert stream.roles.count(("join", "prefetch")) == prefetches
        assert stream.roles.count(("fork", "misses")) == waves


def _outputs(llm, prompts, params):
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                       for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch,E,K", [("Qwen3MoeForCausalLM", 6, 2),
                                      ("GptOssForCausalLM", 4, 2)])
def test_outputs_bitwise_equal_with_overlap_on_and_off(tiny_model_factory, side_streams, arch,
                                                       E, K):
    """Capacities 1 (waves), top_k, E/2, with next-layer prefetch off and on (a cached layer
    with a side stream runs eagerly: CPU graphs do not record the split): tokens and logprobs
    equal the uncached engine's bit for bit."""
    path = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 150, (int(n),), generator=g).tolist() for n in (2, 9, 17, 4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    ref = _outputs(LLM(path), prompts, params)
    for n in sorted({1, K, E // 2}):
        for prefetch in ("off", "next-layer"):
            llm = LLM(path, moe_expert_cache_size=n, moe_expert_overlap=True,
                      moe_expert_prefetch=prefetch)
            assert _outputs(llm, prompts, params) == ref, f"capacity {n}, prefetch {prefetch}"
            assert llm.get_moe_cache_stats()["misses"] > 0
    assert sum(s.log.count("join") for s in side_streams) > 0


def test_without_a_side_stream_overlap_changes_nothing(tiny_model_factory, vllm_log):
    """CPU: no side stream, so no split (one pass per wave), said once in the log."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(path, moe_expert_cache_size=2, moe_expert_overlap=True)
    assert all(m.expert_cache.side_stream is None for m in llm.llm_engine.runner.moe_layers)
    assert "cpu has no side stream" in vllm_log.text
    assert '"moe_expert_overlap": true' in vllm_log.text


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_overlap_must_be_a_bool(tiny_model_factory, bad):
    with pytest.raises(ValueError, match=rf"moe_expert_overlap={bad!r} is invalid: must be True "
                                         "or False"):
        LLM(tiny_model_factory("Qwen3MoeForCausalLM"), moe_expert_overlap=bad)


def _layer_with_recording_side_stream():
    """A cached layer (3 slots of 8 experts) whose provider forks onto a recording stream."""
    layer = build(3)
    layer.expert_cache.side_stream = side = RecordingSideStream()
    return layer, side


@pytest.mark.parametrize("fails", ["copy", "hit pass"])
def test_a_wave_that_raises_between_fork_and_join_still_joins(monkeypatch, fails):
    """A capture must not end with the side stream forked (and eagerly the plan must not be
    freed while the side stream may read it): the join runs before the error leaves the layer."""
    layer, side = _layer_with_recording_side_stream()

    def boom(*args, **kwargs):
        side.log.append("raise")
        raise RuntimeError("boom")
    if fails == "copy":
        monkeypatch.setattr(layer.expert_cache, "copy", boom)
    else:
        monkeypatch.setattr(layer.quant_method, "apply_pairs", boom)
    with pytest.raises(RuntimeError, match="boom"):
        layer(torch.randn(4, H), torch.randn(4, E))
    assert side.log == ["fork", "raise", "join"] and not side.forked


def test_a_second_prefetch_joins_the_first(monkeypatch):
    """Two prefetches before the next plan: the first's copy is joined before the second is
    planned (its plan stays alive while the side stream may read it); the plan joins the
    second."""
    layer, side = _layer_with_recording_side_stream()
    provider, copy = layer.expert_cache, layer.expert_cache.copy

    def spy_copy(slots, plan):
        side.log.append("copy")
        copy(slots, plan)
    monkeypatch.setattr(provider, "copy", spy_copy)
    provider.prefetch(torch.tensor([[0, 1]]))
    assert provider._prefetch_in_flight is not None
    provider.prefetch(torch.tensor([[2, 3]]))
    assert side.log == ["fork", "copy", "join", "fork", "copy"]
    layer(torch.randn(1, H), torch.randn(1, E))
    assert side.log[5] == "join" and provider._prefetch_in_flight is None


def test_a_prefetch_copy_that_raises_is_still_joined(monkeypatch):
    """The fork of a prefetch whose copy raised has enqueued work on the side stream: the
    next plan joins it all the same."""
    layer, side = _layer_with_recording_side_stream()
    provider = layer.expert_cache

    def failing_copy(slots, plan):
        raise RuntimeError("copy failed")
    monkeypatch.setattr(provider, "copy", failing_copy)
    with pytest.raises(RuntimeError, match="copy failed"):
        provider.prefetch(torch.tensor([[0, 1]]))
    assert side.log == ["fork"]
    provider.join_prefetch()
    assert side.log == ["fork", "join"] and provider._prefetch_in_flight is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlap_on_a_gpu_equals_off(tiny_model_factory):
    """A real side stream, inside CUDA graphs and eagerly: tokens equal overlap off."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = [[5, 17, 99, 3], [250, 7], list(range(40, 70))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for eager in (True, False):
        want = [o.outputs[0].token_ids for o in LLM(
            path, device="cuda", moe_expert_cache_size=2, enforce_eager=eager,
            dtype="float32").generate(prompts, params)]
        llm = LLM(path, device="cuda", moe_expert_cache_size=2, moe_expert_overlap=True,
                  enforce_eager=eager, dtype="float32")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert all(m.expert_cache.side_stream is not None
                   for m in llm.llm_engine.runner.moe_layers)
