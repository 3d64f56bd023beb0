"""The runner: its device on every step; a failed step's expert caches; its KV-cache sizing: a
budget that holds no block is an error naming the budget and
the settings that raise it (on a GPU, where the budget is what the device has left, it used to
start with one block and fail every longer request); one that holds less than a full-length
sequence warns."""
from __future__ import annotations

import pytest

from vllm import LLM


def test_a_budget_without_one_block_is_refused_at_start(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match=r"no memory left for the KV cache: a budget of 0.0 MiB "
                                         r"\(less 0.0 MiB of recurrent state\) holds no "
                                         r"\d+-byte block; raise gpu_memory_utilization"):
        LLM(path, kv_cache_memory_bytes=100)


def test_a_budget_short_of_one_sequence_warns(tiny_model_factory, vllm_log):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(path, block_size=16, max_model_len=256)
    per_block = llm.llm_engine.runner.kv_bytes_per_block()
    llm = LLM(path, block_size=16, max_model_len=256, kv_cache_memory_bytes=3 * per_block)
    assert llm.llm_engine.runner.num_blocks == 3
    assert "KV cache: 3 blocks, fewer than one 256-token sequence needs (16)" in vllm_log.text


def test_every_step_makes_the_runners_device_current(tiny_model_factory):
    """The current CUDA device is per thread and AsyncLLM steps on its own thread: each step
    selects the runner's device (on CPU a no-op; recorded here)."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    llm = LLM(tiny_model_factory("Qwen3MoeForCausalLM"))
    runner, picked = llm.llm_engine.runner, []
    runner._platform = SimpleNamespace(select_device=picked.append,
                                       download=runner._platform.download)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(picked) >= 3 and set(picked) == {runner.device}


def test_a_failed_step_leaves_no_slot_trusted_whose_copy_never_ran(tiny_model_factory):
    """A step that raises after a layer's plan named new slot contents but before their copy
    ran (the engine goes on serving): later requests still match the uncached engine."""
    from vllm import SamplingParams
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = [[5, 17, 99, 3, 42], [250, 7, 8], list(range(40, 60))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params)]
    llm = LLM(path, moe_expert_cache_size=2, enforce_eager=True)
    provider = llm.llm_engine.runner.moe_layers[0].expert_cache
    copy = provider.copy

    def copy_that_fails_once(slots, plan):
        provider.copy = copy                    # later steps copy again
        raise RuntimeError("copy failed")
    provider.copy = copy_that_fails_once
    with pytest.raises(RuntimeError, match="copy failed"):
        llm.llm_engine.add_request("r0", [9, 10, 11, 12, 13, 14], params)
        llm.llm_engine.step()
    llm.llm_engine.abort_request("r0")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
