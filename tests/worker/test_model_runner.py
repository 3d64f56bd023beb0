"""The runner's KV-cache sizing: a budget that holds no block is an error naming the budget and
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
    runner._platform = SimpleNamespace(select_device=picked.append)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(picked) >= 3 and set(picked) == {runner.device}
