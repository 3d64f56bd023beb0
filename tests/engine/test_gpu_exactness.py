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
