"""Quantized experts through the whole engine: a tiny Qwen3-MoE quantized by the tool gives the
same greedy token ids and logprobs with the expert cache at N in {1, top_k, E/2} as without it."""
import pytest
import torch

from tools.quantize_checkpoint import main as quantize_main
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.quantization.moe_ref import QuantizedFusedMoEMethod

E, TOP_K = 6, 2      # the tiny Qwen3-MoE config in tests/model_executor/tiny_checkpoints.py
SCHEMES = {"fp8-tensor": [], "fp8-channel": [], "fp8-block": [], "w4a16-gptq": [],
           "w4a16-gptq-asym-descact-g32": ["--asym", "--desc-act", "--group-size", "32"],
           "nvfp4": []}


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 24, (n,), generator=g)]


def _run(path, prompts, params, **kw):
    llm = LLM(path, **kw)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                       for d in o.outputs[0].logprobs]) for o in outs], llm


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cached_equals_uncached_greedy(tiny_model_factory, tmp_path, scheme):
    src = tiny_model_factory("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    path = str(tmp_path / scheme)
    quantize_main(["--model", src, "--out", path, "--scheme", scheme.split("-asym")[0],
                   *SCHEMES[scheme]])
    prompts = _prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    ref, llm = _run(path, prompts, params)
    layers = llm.llm_engine.runner.moe_layers
    assert all(isinstance(m.quant_method, QuantizedFusedMoEMethod) for m in layers)
    float_out, _ = _run(src, prompts, params)
    assert ref != float_out          # the quantized weights are really used
    for n in (1, TOP_K, E // 2):
        got, llm = _run(path, prompts, params, moe_expert_cache_size=n)
        assert got == ref, f"{scheme}: capacity {n}"
        stats = llm.get_moe_cache_stats()
        assert stats["misses"] > 0 and stats["bytes_copied"] > 0
