"""Async scheduling (``async_scheduling=True``): the next decode step is launched before the
tokens of the one in flight are read, its input tokens taken from that step's device output.
On CPU the kernels are batch invariant, so every output equals the plain engine's exactly:
tokens, texts, finish reasons, logprobs and seeded samples, with requests stopping on stop
tokens (their extra row computed and dropped), by length, and aborted mid-flight."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.worker import cuda_graphs


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 30, (n,), generator=g)]


def _spy_launches(llm) -> list[bool]:
    """Per launched step: whether it was scheduled ahead (its sequences take pending tokens)."""
    runner, seen = llm.llm_engine.runner, []
    launch = runner.launch

    def spy(sched, token_masks=None, previous=None):
        seen.append(bool(sched.sequences) and all(s.pending_token for s in sched.sequences))
        return launch(sched, token_masks, previous)
    runner.launch = spy
    return seen


def _run(path, prompts, params, **kw):
    llm = LLM(path, device="cpu", max_num_seqs=8, **kw)
    launches = _spy_launches(llm)
    outs = llm.generate(prompts, params)
    engine = llm.llm_engine
    assert engine.scheduler.block_manager.num_free_blocks == engine.runner.num_blocks
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs,
              c.cumulative_logprob) for c in o.outputs] for o in outs], launches


def _check_equal(path, prompts, params, min_ahead: int, **kw) -> list:
    """The plain engine's outputs, after checking async scheduling's equal them with at least
    ``min_ahead`` steps launched ahead."""
    plain, plain_launches = _run(path, prompts, params, **kw)
    piped, launches = _run(path, prompts, params, async_scheduling=True, **kw)
    assert piped == plain
    assert not any(plain_launches) and sum(launches) >= min_ahead
    return plain


def _stopping_params(path, prompts):
    """Greedy requests of different lengths, each stopping on a token its plain run samples
    mid-way (so it stops there, before max_tokens)."""
    base = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i) for i in range(len(prompts))]
    plain = LLM(path, device="cpu", max_num_seqs=8).generate(prompts, base)
    params = []
    for i, o in enumerate(plain):
        ids = o.outputs[0].token_ids
        stop = [ids[len(ids) // 2]] if i % 2 == 0 else []
        params.append(SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, stop_token_ids=stop))
    return params


@pytest.mark.parametrize("kw", [dict(), dict(enforce_eager=True),
                                dict(moe_expert_cache_size=2, moe_expert_cache_policy="lru")])
def test_greedy_with_stops_equals_the_plain_engine(tiny_model_factory, kw):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts()
    plain = _check_equal(path, prompts, _stopping_params(path, prompts), 10, **kw)
    assert {o[0][2] for o in plain} == {"stop", "length"}


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "DeepseekV2ForCausalLM",
                                  "GptOssForCausalLM"])
def test_other_architectures_equal_the_plain_engine(tiny_model_factory, arch):
    """Recurrent state (Qwen3-Next's Gated DeltaNet: a stopped request's extra row writes
    its slot before the slot is handed on), MLA's one-plane cache, sinks and windows."""
    path = tiny_model_factory(arch)
    prompts = _prompts(4, seed=6)
    _check_equal(path, prompts, _stopping_params(path, prompts), 5)


def test_seeded_sampling_and_logprobs_equal_the_plain_engine(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts(4, seed=1)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=8 + i,
                             logprobs=2, n=2 if i == 0 else 1) for i in range(4)]
    _check_equal(path, prompts, params, 5)


def test_rows_that_read_their_outputs_keep_the_plain_schedule(tiny_model_factory):
    """A penalised request in the batch: no step is scheduled ahead while it runs."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts(3, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4)]
    plain, _ = _run(path, prompts, params)
    piped, launches = _run(path, prompts, params, async_scheduling=True)
    assert piped == plain and not any(launches)


def test_cuda_graph_path_takes_the_tokens_on_the_device(tiny_model_factory, monkeypatch):
    """CudaDecodeGraphs (eager capturer on CPU) with steps scheduled ahead: the tokens of the
    step in flight are copied over the staged placeholder rows (``ids``)."""
    monkeypatch.setattr(cuda_graphs, "uses_cuda_graphs", lambda device: True)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts(5, seed=3)
    params = _stopping_params(path, prompts)
    plain, _ = _run(path, prompts, params, cuda_graph_sizes=[1, 2, 4])
    llm = LLM(path, device="cpu", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4],
              async_scheduling=True)
    graphs, given = llm.llm_engine.runner.decode_graphs, []
    orig = graphs.logits

    def spy(input_ids, positions, md, ids=None):
        given.append(ids is not None)
        return orig(input_ids, positions, md, ids=ids)
    graphs.logits = spy
    outs = llm.generate(prompts, params)
    assert [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs,
              c.cumulative_logprob) for c in o.outputs] for o in outs] == plain
    assert sum(given) >= 5 and graphs.captured_sizes


def test_abort_while_a_step_is_ahead_and_a_stale_step_after_the_last_request(
        tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = _prompts(2, seed=4)

    def engine(async_scheduling):
        return LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu",
                                                     async_scheduling=async_scheduling))
    plain = engine(False)
    plain.add_request("keep", {"prompt_token_ids": prompts[0]}, greedy)
    want = []
    while plain.has_unfinished_requests():
        want += [o.outputs[0].token_ids for o in plain.step() if o.finished]
    e = engine(True)
    e.add_request("keep", {"prompt_token_ids": prompts[0]}, greedy)
    e.add_request("drop", {"prompt_token_ids": prompts[1]}, greedy)
    for _ in range(3):
        e.step()
    assert e._ahead is not None                # the next step is in flight
    e.abort_request("drop")
    got = []
    while e.has_unfinished_requests():
        got += [(o.request_id, o.outputs[0].token_ids) for o in e.step() if o.finished]
    assert got == [("keep", want[0])]
    # The last step launched one ahead for "keep"? No: its 12th token is its last by length.
    # A stop token instead leaves a stale step in flight, applied (and dropped) by the next
    # step() of a later request.
    stop_at = want[0][4]
    e.add_request("stops", {"prompt_token_ids": prompts[0]},
                  SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert outs[-1].outputs[0].token_ids == want[0][:want[0].index(stop_at) + 1]
    assert e._ahead is not None                # the stale step, for a finished request
    e.add_request("after", {"prompt_token_ids": prompts[0]}, greedy)
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert [o.outputs[0].token_ids for o in outs if o.finished] == [want[0]]
    assert e.scheduler.block_manager.num_free_blocks == e.runner.num_blocks


def test_a_failing_step_ahead_leaves_the_engine_usable(tiny_model_factory, monkeypatch):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(path, device="cpu", async_scheduling=True)
    want = llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
    runner = llm.llm_engine.runner
    launch, calls = runner.launch, []

    def flaky(sched, token_masks=None, previous=None):
        calls.append(previous is not None)
        if previous is not None and sum(calls) == 2:   # the second step scheduled ahead
            raise RuntimeError("injected")
        return launch(sched, token_masks, previous)
    monkeypatch.setattr(runner, "launch", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[5, 6, 7]], greedy)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine._ahead is None
    assert engine.scheduler.block_manager.num_free_blocks == runner.num_blocks
    assert llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids == want


def test_requests_arriving_mid_run_join_steps_ahead(tiny_model_factory):
    """Requests added while others decode are admitted into steps scheduled ahead (their
    prefills after the pending decodes, eagerly); a guided one gets its mask there, and
    decodes in plain steps after. Outputs equal the plain engine's for the same arrivals."""
    pytest.importorskip("xgrammar", reason="the guided request needs xgrammar")
    from vllm.sampling_params import GuidedDecodingParams
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts(6, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 2 * i) for i in range(6)]
    params[3] = SamplingParams(temperature=0.7, seed=3, max_tokens=12,
                               guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    arrivals = {0: [0, 1], 2: [2], 3: [3], 5: [4, 5]}         # step -> requests added

    def run(async_scheduling):
        e = LLMEngine.from_engine_args(EngineArgs(model=path, device="cpu",
                                                  async_scheduling=async_scheduling))
        mixed, launch = [], e.runner.launch

        def spy(sched, token_masks=None, previous=None):
            kinds = {s.pending_token for s in sched.sequences}
            mixed.append(kinds == {True, False})
            return launch(sched, token_masks, previous)
        e.runner.launch = spy
        done, step = {}, 0
        while step <= max(arrivals) or e.has_unfinished_requests():
            for i in arrivals.get(step, ()):
                e.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i])
            for o in e.step():
                if o.finished:
                    done[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].text)
            step += 1
        assert e.scheduler.block_manager.num_free_blocks == e.runner.num_blocks
        return done, mixed
    plain, _ = run(False)
    piped, mixed = run(True)
    assert piped == plain and len(plain) == 6
    # Its tokens (its text starts with the random prompt's own undecodable tail).
    assert plain["r3"][0] in ([91, 71, 85, 0], [80, 81, 0])          # "yes" / "no", EOS
    assert any(mixed)                          # a step ahead carried decodes and prefills


def test_a_routing_trace_turns_async_scheduling_off(tiny_model_factory, tmp_path, vllm_log):
    """A step ahead may compute rows that are dropped; the trace records the requests' tokens
    only, so the engine schedules as before (and says so)."""
    import logging
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    vllm_log.set_level(logging.INFO)
    llm = LLM(path, device="cpu", async_scheduling=True,
              moe_routing_trace_path=str(tmp_path / "t.npz"))
    launches = _spy_launches(llm)
    llm.generate(_prompts(2), SamplingParams(temperature=0.0, max_tokens=6))
    assert not any(launches)
    assert "async_scheduling off: a routing trace is recorded" in vllm_log.text
