"""On a CUDA GPU: the expert cache leaves outputs bitwise unchanged (greedy tokens and their
logprobs) at every capacity, for each MoE backend that runs there, with the expert copy going
through the compiled gather kernel where the build made one (else the torch fallback)."""
from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

E, K = 6, 2          # the tiny Qwen3-MoE config of tests/model_executor/tiny_checkpoints.py


def _prompts():
    return [[5, 17, 99, 3], [250, 7], list(range(40, 90)), [11] * 9]


def _run(path, **kw):
    llm = LLM(path, device="cuda", dtype="bfloat16", **kw)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate(_prompts(), params)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                       for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("backend", ["grouped_mm", "torch"])
def test_cached_equals_uncached_bitwise(tiny_model_factory, backend):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    ref = _run(path, moe_backend=backend)
    for n in (1, K, E - 1):
        assert _run(path, moe_backend=backend, moe_expert_cache_size=n) == ref, f"capacity {n}"


def test_fp8_w8a8_cached_equals_uncached_bitwise(tiny_model_factory, tmp_path):
    """FP8 block experts whose checkpoint declares FP8 activations (HF "fp8",
    activation_scheme dynamic: 1 x 32 input groups here): W8A8 on the triton backend where the
    GPU multiplies e4m3 (SM 8.9+), with and without the cache and CUDA graphs."""
    import torch
    from tools.quantize_checkpoint import main as quantize_main
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("W8A8 needs FP8 matrix units (SM 8.9+)")
    src = tiny_model_factory("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    path = str(tmp_path / "fp8")
    quantize_main(["--model", src, "--out", path, "--scheme", "fp8-block", "--block-size",
                   "16", "32"])
    ref = _run(path, moe_backend="triton")
    assert _run(path, moe_backend="triton", enforce_eager=True) == ref
    for n in (1, K, E - 1):
        assert _run(path, moe_backend="triton", moe_expert_cache_size=n) == ref, f"capacity {n}"


def test_async_scheduling_equals_sync_bitwise(tiny_model_factory):
    """Steps launched before the tokens of the one in flight reach the host take them from the
    device (CUDA graphs and eager steps, with and without the cache); requests stopping on a
    token leave a row that is computed and dropped: the same tokens and logprobs."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    for kw in (dict(), dict(enforce_eager=True), dict(moe_expert_cache_size=K)):
        ref = _run(path, moe_backend="triton", **kw)
        assert _run(path, moe_backend="triton", async_scheduling=True, **kw) == ref, kw
    prompts = _prompts()
    want = [ids for ids, _ in _run(path, moe_backend="triton")]
    params = [SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ids[3]])
              for ids in want]
    outs = [LLM(path, device="cuda", dtype="bfloat16", moe_backend="triton",
                async_scheduling=a).generate(prompts, params) for a in (False, True)]
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids
                                                         for o in outs[0]]
