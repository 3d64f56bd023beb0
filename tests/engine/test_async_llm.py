"""AsyncLLM: concurrent requests batch in the one engine thread and each gets exactly its own
outputs (equal to the offline LLM); aborts free KV blocks; a bad request, a failing add or a
failing step fails only the requests it concerns, and the loop keeps serving."""
from __future__ import annotations

import asyncio

import pytest

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, EngineDead, InternalRequestError

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "The quick brown fox",
           "for i in range(10):", "print(i)"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    return tiny_model_factory("Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def reference(path):
    llm = LLM(path, max_model_len=128)
    outs = llm.generate(PROMPTS, GREEDY)
    llm.llm_engine.shutdown()
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def _make(path, **kw) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(model=path, max_model_len=128, **kw))


async def _final(engine: AsyncLLM, prompt, params, rid):
    last = None
    async for out in engine.generate(prompt, params, rid):
        last = out
    return last


def test_concurrent_requests_batch_and_match_offline(path, reference):
    engine = _make(path)
    batch_sizes = []
    step = engine.engine.step

    def recording_step():
        batch_sizes.append(engine.engine.scheduler.num_running)
        return step()
    engine.engine.step = recording_step
    try:
        async def main():
            return await asyncio.gather(*(_final(engine, p, GREEDY, f"r{i}")
                                          for i, p in enumerate(PROMPTS * 2)))
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [o.request_id for o in outs] == [f"r{i}" for i in range(len(PROMPTS) * 2)]
    assert [o.outputs[0].text for o in outs] == [reference[p] for p in PROMPTS * 2]
    assert all(o.finished for o in outs)
    assert max(batch_sizes) > 1  # they really ran together


def test_abort_frees_blocks_and_bad_prompt_fails_alone(path, reference):
    engine = _make(path)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        gen = engine.generate("class Stack:", long, "long")
        seen = 0
        async for out in gen:
            seen += 1
            if seen == 2:
                break
        await gen.aclose()  # what a disconnecting client does
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("bad", [5] * 500, GREEDY)
        with pytest.raises(ValueError, match="max_tokens=200"):
            await engine.add_request("bad2", "hi", SamplingParams(max_tokens=200))
        text = (await _final(engine, PROMPTS[0], GREEDY, "after")).outputs[0].text
        state = await engine.call(lambda e: (e.scheduler.num_running, e.scheduler.num_waiting,
                                             e.scheduler.block_manager.num_free_blocks,
                                             e.scheduler.block_manager.num_blocks))
        return out, text, state
    try:
        partial, text, (running, waiting, free, total) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert not partial.finished and len(partial.outputs[0].token_ids) < 100
    assert text == reference[PROMPTS[0]]
    assert (running, waiting) == (0, 0) and free == total


def test_failing_add_fails_only_that_request(path, reference):
    engine = _make(path)
    process = engine.engine.process_prompt

    def flaky(prompt, index=None):
        if prompt == "boom":
            raise RuntimeError("tokenizer exploded")
        return process(prompt, index)
    engine.engine.process_prompt = flaky

    async def main():
        good = asyncio.create_task(_final(engine, PROMPTS[1], GREEDY, "good"))
        with pytest.raises(InternalRequestError) as e:
            await engine.add_request("bad", "boom", GREEDY)
        assert "tokenizer exploded" not in str(e.value)  # internals stay in the log
        return (await good).outputs[0].text
    try:
        assert asyncio.run(main()) == reference[PROMPTS[1]]
    finally:
        engine.shutdown()


def test_failing_step_fails_running_requests_and_keeps_serving(path, reference):
    engine = _make(path, max_num_seqs=1)  # one running request; later ones wait
    runner = engine.engine.runner
    launch = runner.launch
    failed = []

    def faulty(sched, token_masks=None, previous=None):
        if not failed and any(s.req_id == "victim" for s in sched.sequences):
            failed.append(True)
            raise RuntimeError("device fell over")
        return launch(sched, token_masks, previous)
    runner.launch = faulty

    async def main():
        victim = await engine.add_request("victim", PROMPTS[2], GREEDY)
        bystander = asyncio.create_task(_final(engine, PROMPTS[3], GREEDY, "bystander"))
        with pytest.raises(InternalRequestError):
            async for _ in victim:
                pass
        after = await _final(engine, PROMPTS[4], GREEDY, "after")
        return (await bystander).outputs[0].text, after.outputs[0].text
    try:
        bystander_text, after_text = asyncio.run(main())
        assert failed == [True]
        assert engine.is_running
    finally:
        engine.shutdown()
    assert bystander_text == reference[PROMPTS[3]]
    assert after_text == reference[PROMPTS[4]]


def test_shutdown_rejects_new_requests(path):
    engine = _make(path)
    engine.shutdown()
    assert not engine.is_running

    async def main():
        await engine.add_request("late", "hi", GREEDY)
    with pytest.raises(EngineDead):
        asyncio.run(main())


def test_async_scheduling_serves_the_same_outputs_and_aborts_cleanly(path, reference):
    """The engine thread with steps launched ahead: concurrent requests get the offline
    outputs, a client leaving mid-stream is aborted while a step ahead holds it, and every
    KV block comes back."""
    engine = _make(path, async_scheduling=True)
    runner, ahead = engine.engine.runner, []
    launch = runner.launch

    def spy(sched, token_masks=None, previous=None):
        ahead.append(previous is not None)
        return launch(sched, token_masks, previous)
    runner.launch = spy
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        gen = engine.generate("class Stack:", long, "long")
        tasks = [asyncio.create_task(_final(engine, p, GREEDY, f"r{i}"))
                 for i, p in enumerate(PROMPTS)]
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == 5:
                break
        await gen.aclose()
        return await asyncio.gather(*tasks)
    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [o.outputs[0].text for o in outs] == [reference[p] for p in PROMPTS]
    assert any(ahead)
    sched = engine.engine.scheduler
    assert not sched.requests and sched.block_manager.num_free_blocks == runner.num_blocks
