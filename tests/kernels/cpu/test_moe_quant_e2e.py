"""Quantized experts on the C kernel through the engine: a tiny Qwen3-MoE quantized to FP8,
GPTQ INT4 and NVFP4, and a tiny GPT-OSS with MXFP4 experts (biases, swigluoai), give the same
greedy tokens with ``moe_backend="cpu_kernel"`` as with ``"torch"`` (logprobs within f32
summation-order tolerance), the expert cache at N in {1, top_k, E/2} equals no cache bit for
bit, and decode steps replay as CPU graphs with the eager step's bits."""
import os

import pytest
import torch

from tools.quantize_checkpoint import main as quantize_main
from vllm import LLM, SamplingParams
from model_executor.layers.quantization.gpt_oss_mxfp4 import gpt_oss_mxfp4

TOP_K = 2      # both tiny configs (tests/model_executor/tiny_checkpoints.py)
SCHEMES = {"fp8-block": ["--scheme", "fp8-block"], "fp8-channel": ["--scheme", "fp8-channel"],
           "w4a16-gptq-asym-descact-g32": ["--scheme", "w4a16-gptq", "--asym", "--desc-act",
                                           "--group-size", "32"],
           "nvfp4": ["--scheme", "nvfp4"], "mxfp4-gpt-oss": None}


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 24, (n,), generator=g)]


def _run(path, prompts, **kw):
    llm = LLM(path, **kw)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    got = [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                     for d in o.outputs[0].logprobs]) for o in outs]
    return got, llm


@pytest.fixture(scope="module", params=list(SCHEMES))
def quantized(request, tiny_model_factory, tmp_path_factory):
    """-> (checkpoint path, experts per layer)."""
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "mxfp4-gpt-oss":
        gpt_oss_mxfp4(tiny_model_factory("GptOssForCausalLM"), os.path.join(path, "m"))
        return os.path.join(path, "m"), 8
    src = tiny_model_factory("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    quantize_main(["--model", src, "--out", path, *SCHEMES[request.param]])
    return path, 6


def test_cpu_kernel_equals_torch_backend_and_cache(quantized):
    quantized, num_experts = quantized
    prompts = _prompts(6, seed=2)
    ref, llm = _run(quantized, prompts, moe_backend="torch", enforce_eager=True)
    got, llm = _run(quantized, prompts, moe_backend="cpu_kernel")
    assert {m.quant_method.backend_name for m in llm.llm_engine.runner.moe_layers} == \
        {"cpu_kernel"}
    # Same greedy tokens; logprobs differ only by f32 summation order (the torch backend's
    # matmuls vs the kernel's sequential FMA chains).
    assert [t for t, _ in got] == [t for t, _ in ref]
    for (_, lp_got), (_, lp_ref) in zip(got, ref):
        for a, b in zip(lp_got, lp_ref):
            assert [t for t, _ in a] == [t for t, _ in b]
            torch.testing.assert_close([v for _, v in a], [v for _, v in b], atol=1e-4, rtol=0)
    for n in (1, TOP_K, num_experts // 2):
        cached, llm = _run(quantized, prompts, moe_backend="cpu_kernel", moe_expert_cache_size=n)
        assert cached == got, f"capacity {n}"
        assert llm.get_moe_cache_stats()["misses"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_capture_and_replay_eager_bits(quantized, dtype):
    """The quantized kernel is one C call, so decode steps capture (cached or not) and replay
    the eager bits. In bf16 the cache is exact too; greedy tokens there are not compared with
    the torch backend, which rounds to bf16 after every op (gate_up, activation, products) where
    the kernel accumulates in f32: on this random model's near-tied logits that can flip a
    token (the kernel's own tests bound the difference)."""
    quantized, _ = quantized
    prompts = _prompts(5, seed=3)
    eager, _ = _run(quantized, prompts, enforce_eager=True, dtype=dtype)
    for n in (0, 1):
        graphs, llm = _run(quantized, prompts, moe_expert_cache_size=n, dtype=dtype)
        dg = llm.llm_engine.runner.decode_graphs
        assert dg is not None and dg.refused is None and dg._graphs, dg and dg.refused
        assert graphs == eager, f"capacity {n}"
