"""The shipped default model through our engine: greedy parity with transformers, and the expert
cache bitwise equal to no cache at several capacities."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

import vllm
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not os.path.isdir(vllm.DEFAULT_MODEL),
                                reason="default model not shipped")
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


def _hf_greedy(model, tok, prompt: str, n: int) -> list[int]:
    ids = tok(prompt).input_ids
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_greedy_matches_transformers_fp32():
    hf = transformers.AutoModelForCausalLM.from_pretrained(vllm.DEFAULT_MODEL,
                                                           dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(vllm.DEFAULT_MODEL)
    llm = LLM(dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, tok, prompt, 16)


def test_cache_bitwise_equal_on_default_model():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(**kw):
        outs = LLM(**kw).generate(PROMPTS, params)
        return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                          for d in o.outputs[0].logprobs]) for o in outs]
    ref = run()
    for n in (1, 4, 16, 31):          # 1, top_k, E/2, E-1 of 32 experts
        assert run(moe_expert_cache_size=n) == ref, n
