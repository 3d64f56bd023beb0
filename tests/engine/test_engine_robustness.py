"""A bad request or a failing step must not break the engine or leak into other requests."""
from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine


def _greedy(max_tokens=4, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("kw,match", [(dict(seed=2**64), "seed"), (dict(top_k=2**63), "top_k"),
                                      (dict(stop_token_ids=[2**63]), "stop_token_ids")])
def test_out_of_range_integers_rejected_up_front(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_stop_token_id_outside_vocab_rejected(tiny_model_factory):
    llm = LLM(tiny_model_factory())
    with pytest.raises(ValueError, match="stop_token_ids: token id 100000"):
        llm.generate([[5, 6]], _greedy(stop_token_ids=[100000], min_tokens=1))
    assert len(llm.generate([[5, 6]], _greedy())[0].outputs[0].token_ids) == 4


def test_engine_usable_after_a_failing_step(tiny_model_factory, monkeypatch):
    llm = LLM(tiny_model_factory())
    ref = llm.generate([[5, 6, 7]], _greedy())[0].outputs[0].token_ids
    runner = llm.llm_engine.runner
    real = runner.launch
    calls = {"n": 0}

    def flaky(sched, token_masks=None, previous=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(sched, token_masks, previous)
    monkeypatch.setattr(runner, "launch", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[5, 6, 7]], _greedy())
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == runner.num_blocks
    assert llm.generate([[5, 6, 7]], _greedy())[0].outputs[0].token_ids == ref


def test_n_children_of_a_failed_request_report_nothing(tiny_model_factory):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory(), block_size=16,
                                                   num_gpu_blocks_override=4))
    engine.add_request("A", [5] * 100, _greedy(n=3))   # 101 tokens never fit in 64 KV slots
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.error is not None) for o in outs] == [("A", True)]


def test_child_id_collision_rejected_without_side_effects(tiny_model_factory):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory()))
    engine.add_request("0_x", [5, 6], _greedy())
    with pytest.raises(ValueError, match="'0_x' is in use"):
        engine.add_request("x", [5, 6], _greedy(n=2))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["0_x"]


@pytest.mark.parametrize("kw,match", [(dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
                                      (dict(quantization="fp8"), "quantization='fp8'"),
                                      (dict(max_model_len=100000), "max_model_len=100000")])
def test_unsupported_engine_arguments(tiny_model_factory, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_factory(), **kw)


def test_chunked_prefill_off_still_generates(tiny_model_factory):
    path = tiny_model_factory()
    ref = LLM(path).generate([[5] * 40], _greedy())[0].outputs[0].token_ids
    llm = LLM(path, enable_chunked_prefill=False, max_num_batched_tokens=64)
    assert llm.generate([[5] * 40], _greedy())[0].outputs[0].token_ids == ref


def test_text_that_is_not_unicode_or_cannot_fit_is_refused_before_tokenizing(
        tiny_model_factory, monkeypatch):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_factory(), max_model_len=64))
    prompts = engine.prompts
    longest = max(len(t) for t in prompts.tokenizer.get_vocab())
    assert prompts.max_chars == 63 * longest
    with pytest.raises(ValueError, match="lone surrogate U\\+D83D at character 3"):
        engine.add_request("a", "abc\ud83d!")
    calls = []
    monkeypatch.setattr(prompts.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    with pytest.raises(ValueError, match=f"{63 * longest + 1} characters, which cannot fit in "
                                         "max_model_len=64"):
        engine.add_request("b", "x" * (63 * longest + 1))
    with pytest.raises(ValueError, match="messages\\[1\\].content has"):
        engine.render_chat([{"role": "user", "content": "hi"},
                            {"role": "user", "content": "y" * (63 * longest + 1)}],
                           chat_template="{{ messages[0]['content'] }}")
    assert calls == []                                   # refused without tokenizing
    engine.add_request("c", "x" * (63 * longest))         # at the bound: tokenized
    assert len(calls) == 1
    engine.shutdown()
