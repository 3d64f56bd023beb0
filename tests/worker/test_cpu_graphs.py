"""Decode steps replayed from CPU graphs (``vllm/worker/cpu_graphs.py``) give the tokens of the
eager engine (``enforce_eager=True``), bit for bit, at every batch size a run passes through."""
from __future__ import annotations

import pytest
import torch
from graph_checks import check_replays_against_eager, record_block_ids

from vllm import LLM, SamplingParams


@pytest.fixture(autouse=True)
def capture_at_once(monkeypatch):
    """Capture a batch size on its first decode step, so short runs exercise many graphs."""
    from vllm.worker.cpu_graphs import DecodeGraphs
    monkeypatch.setattr(DecodeGraphs, "CAPTURE_AFTER", 1)


def _requests(vocab: int, n: int = 12):
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(L),), generator=g).tolist()}
               for L in torch.randint(2, 40, (n,), generator=g)]
    # Different output lengths, so requests finish at different steps and the decode batch
    # shrinks through many sizes; greedy and seeded sampling alternate.
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             top_p=0.9, seed=i)
              for i, m in enumerate(torch.randint(1, 24, (n,), generator=g))]
    return prompts, params


def _generate(path, prompts, params, **kwargs):
    llm = LLM(path, device="cpu", max_num_seqs=6, **kwargs)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs], llm.llm_engine.runner


@pytest.mark.parametrize("arch,dtype", [("Qwen3MoeForCausalLM", "float32"),
                                        ("Qwen3MoeForCausalLM", "bfloat16"),
                                        ("MixtralForCausalLM", "float32"),
                                        ("Qwen2MoeForCausalLM", "bfloat16"),
                                        ("Qwen2MoeForCausalLM", "float32"),
                                        ("Qwen3ForCausalLM", "bfloat16"),
                                        ("LlamaForCausalLM", "float32")])
def test_graph_decode_equals_eager(tiny_model_factory, arch, dtype):
    path = tiny_model_factory(arch)
    prompts, params = _requests(vocab=200)
    eager, runner = _generate(path, prompts, params, dtype=dtype, enforce_eager=True)
    assert runner.decode_graphs is None
    got, runner = _generate(path, prompts, params, dtype=dtype)
    graphs = runner.decode_graphs
    # Batches of 1-6 sequences replay (some of) the padded sizes 1, 2, 4 and 8.
    assert graphs.refused is None and {4, 8} <= set(graphs._graphs) <= {1, 2, 4, 8}
    assert got == eager


def test_padded_sizes_are_vllms_graph_sizes():
    from vllm.worker.cpu_graphs import padded_size
    assert [padded_size(b) for b in range(1, 18)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8 + [24]
    assert padded_size(256) == 256 and padded_size(257) == 264


def test_padding_rows_leave_the_kv_cache_alone(tiny_model_factory):
    """Three sequences replay the graph of four rows: the padding row writes no KV (every
    block the engine did not hand out stays zero) and the tokens are the eager ones."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]},
               {"prompt_token_ids": [10, 11, 12, 13]}]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eager, _ = _generate(path, prompts, params, enforce_eager=True)
    llm = LLM(path, device="cpu", max_num_seqs=6)
    runner = llm.llm_engine.runner
    used = record_block_ids(runner)
    outs = llm.generate(prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == eager
    assert list(runner.decode_graphs._graphs) == [4]
    for attn in runner.attn_layers:
        untouched = [b for b in range(attn.kv_cache.shape[1]) if b not in used]
        assert untouched and attn.kv_cache[:, untouched].abs().sum() == 0


def test_graphs_are_off_where_per_step_python_state_lives(tiny_model_factory, tmp_path):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    kwargs = {"moe_routing_trace_path": str(tmp_path / "trace.json")}
    assert LLM(path, device="cpu", **kwargs).llm_engine.runner.decode_graphs is None


def _cache_state(runner):
    return [(m.expert_cache.stats(), m.expert_cache.residency.slot_of_expert.tolist(),
             {k: v.tolist() for k, v in m.expert_cache.residency.policy_state.items()})
            for m in runner.moe_layers]


# (arch, experts of its tiny config, dtype, slots, policy): N = 1, top_k, E/2, E - 1.
CACHED = [("Qwen3MoeForCausalLM", "float32", 1, "lrfu"), ("Qwen3MoeForCausalLM", "bfloat16", 2,
          "lru"), ("Qwen3MoeForCausalLM", "float32", 5, "lfru"),
          ("MixtralForCausalLM", "float32", 2, "lfu"), ("Qwen2MoeForCausalLM", "bfloat16", 4,
                                                        "auto"),
          ("Qwen3MoeForCausalLM", "float32", 3, "lrfu_next")]


@pytest.mark.parametrize("arch,dtype,n,policy", CACHED)
def test_cached_graph_decode_equals_eager_and_uncached(tiny_model_factory, arch, dtype, n,
                                                       policy):
    """The expert cache inside the graphs: the residency step and copies are graph nodes, the
    tokens equal the eager cached run's and the uncached run's, and the cache reaches the same
    state (counters, residency, policy) as eagerly: padding rows route nowhere."""
    path = tiny_model_factory(arch)
    prompts, params = _requests(vocab=200)
    uncached, _ = _generate(path, prompts, params, dtype=dtype, enforce_eager=True)
    kw = dict(dtype=dtype, moe_expert_cache_size=n, moe_expert_cache_policy=policy)
    eager, eager_runner = _generate(path, prompts, params, enforce_eager=True, **kw)
    got, runner = _generate(path, prompts, params, **kw)
    graphs = runner.decode_graphs
    assert graphs.refused is None and {4, 8} <= set(graphs._graphs)
    nodes = graphs._graphs[8].graph._names
    assert nodes.count("moe_residency_step") >= len(runner.moe_layers)
    assert "expert_copy" in nodes
    assert got == eager == uncached
    assert _cache_state(runner) == _cache_state(eager_runner)


def test_a_refused_capture_runs_that_batch_size_eagerly(tiny_model_factory, monkeypatch,
                                                         vllm_log):
    """A torch op without a graph node in the forward (here a scale added to every norm)
    refuses the capture; the step runs eagerly and its tokens are still right."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts, params = _requests(vocab=200, n=4)
    from vllm.model_executor.layers.layernorm import RMSNorm
    orig = RMSNorm.forward

    def scaled(self, x, residual=None):
        out = orig(self, x, residual)
        return (out[0] * 1.0, out[1]) if residual is not None else out * 1.0
    monkeypatch.setattr(RMSNorm, "forward", scaled)
    eager, _ = _generate(path, prompts, params, enforce_eager=True)
    got, runner = _generate(path, prompts, params)
    assert got == eager
    assert "mul" in runner.decode_graphs.refused and not runner.decode_graphs._graphs
    assert vllm_log.text.count("run eagerly (no CPU graphs)") == 1


def test_tied_embeddings_replay_the_forward_and_compute_logits_eagerly(tiny_model_factory):
    """Tied logits go through ``F.linear`` (no graph node): only the forward is replayed."""
    path = tiny_model_factory("Qwen3MoeForCausalLM", tie_word_embeddings=True)
    prompts, params = _requests(vocab=200, n=6)
    eager, _ = _generate(path, prompts, params, enforce_eager=True)
    got, runner = _generate(path, prompts, params)
    graphs = runner.decode_graphs
    assert graphs.refused is None and graphs._graphs
    assert all(e.logits_graph is None for e in graphs._graphs.values())
    assert "linear" in graphs.logits_refused
    assert got == eager


def test_untied_logits_are_replayed_too(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    _, runner = _generate(path, *_requests(vocab=200, n=4))
    assert all(e.logits_graph is not None for e in runner.decode_graphs._graphs.values())


def test_graphs_past_the_memory_budget_are_dropped(tiny_model_factory, monkeypatch):
    from vllm.worker.cpu_graphs import DecodeGraphs
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts, params = _requests(vocab=200)
    eager, _ = _generate(path, prompts, params, enforce_eager=True)
    _, runner = _generate(path, prompts, params)
    sizes = {B: e.graph.nbytes + e.logits_graph.nbytes
             for B, e in runner.decode_graphs._graphs.items()}
    assert len(sizes) >= 3 and min(sizes.values()) > 0
    budget = max(sizes.values()) + 1          # less than all of them together
    monkeypatch.setattr(DecodeGraphs, "MAX_BYTES", budget)
    got, runner = _generate(path, prompts, params)
    kept = runner.decode_graphs._graphs
    assert 1 <= len(kept) < len(sizes)
    assert sum(e.graph.nbytes + e.logits_graph.nbytes for e in kept.values()) <= budget
    assert got == eager


def test_a_batch_size_is_captured_after_a_streak_of_steps(tiny_model_factory, monkeypatch):
    from vllm.worker.cpu_graphs import DecodeGraphs
    monkeypatch.setattr(DecodeGraphs, "CAPTURE_AFTER", 5)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    # Batch 2 for 3 decode steps (not captured), then batch 1 for 6 more (captured at its 5th).
    params = [SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True)]
    eager, _ = _generate(path, prompts, params, enforce_eager=True)
    got, runner = _generate(path, prompts, params)
    assert list(runner.decode_graphs._graphs) == [1]
    assert got == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_logits_equal_eager_logits_bitwise(tiny_model_factory, dtype):
    """Each replay (padded or not) against the eager forward of the same step's inputs."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(path, device="cpu", max_num_seqs=6, dtype=dtype)
    checked = check_replays_against_eager(llm)
    llm.generate(*_requests(vocab=200))
    # Padded (3, 5, 6 -> 4, 8, 8) and exact (1, 2, 4) sizes were replayed.
    assert {3, 5, 6} & set(checked) and {1, 2, 4} & set(checked)
