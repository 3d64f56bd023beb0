"""Quantized experts on the C kernel through the engine: a tiny Qwen3-MoE quantized to FP8,
GPTQ INT4 and NVFP4, and a tiny GPT-OSS with MXFP4 experts (biases, swigluoai), give the same
greedy tokens with ``moe_backend="cpu_kernel"`` as with ``"torch"`` (logprobs within f32
summation-order tolerance), the expert cache at N in {1, top_k, E/2} equals no cache bit for
bit, and decode steps replay as CPU graphs with the eager step's bits."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.quantize_checkpoint import main as quantize_main
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.quantization.utils import float_to_e2m1

TOP_K = 2      # both tiny configs (tests/model_executor/tiny_checkpoints.py)
SCHEMES = {"fp8-block": ["--scheme", "fp8-block"], "fp8-channel": ["--scheme", "fp8-channel"],
           "w4a16-gptq-asym-descact-g32": ["--scheme", "w4a16-gptq", "--asym", "--desc-act",
                                           "--group-size", "32"],
           "nvfp4": ["--scheme", "nvfp4"], "mxfp4-gpt-oss": None}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def mxfp4_gpt_oss(src, path):
    """The tiny GPT-OSS at ``src`` with random expert biases and its experts rounded to MXFP4
    in the published layout, written here from the format: rows = outputs (gate/up interleaved
    as published), 32-input blocks of 16 bytes (code 2j in the low nibble of byte j), e8m0
    scales 2^ceil(log2(amax / 6))."""
    shutil.copytree(src, path)
    g = torch.Generator().manual_seed(0)
    state = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(name).float().transpose(1, 2)                   # [E, out, in]
        blocks = w.reshape(*w.shape[:2], -1, 32)
        exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0 ** -60) / 6))
        codes = float_to_e2m1(blocks / 2.0 ** exp[..., None])
        state[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        state[name + "_scales"] = (exp + 127).to(torch.uint8)
        bias = state[name + "_bias"]
        state[name + "_bias"] = (torch.randn(bias.shape, generator=g) * 0.1).bfloat16()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = MXFP4_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


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
        mxfp4_gpt_oss(tiny_model_factory("GptOssForCausalLM"), os.path.join(path, "m"))
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
