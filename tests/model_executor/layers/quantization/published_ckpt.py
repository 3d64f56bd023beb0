"""Helpers for the published-layout tests (imported by name): write a quantized copy of a tiny
float checkpoint from per-projection tensors someone else's writer produced, and check the
loaded model against a dequantize-then-matmul reference the test writes itself."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.model_loader import get_model
from model_executor.tiny_checkpoints import make_vllm_config

EXPERT_WEIGHT = re.compile(r"^(?P<mod>.+\.experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight$")
# Tiny Qwen3-MoE for these tests: hidden 64, expert intermediate 32 (multiples of every group
# size used: 16, 32; NVFP4 needs 16), E = 6, top-2, 2 layers, bf16 like published checkpoints.
TINY = dict(hidden_size=64, moe_intermediate_size=32, dtype=torch.bfloat16)
E, TOP_K = 6, 2
# Non-expert modules every writer leaves unquantized (the ignore list an llm-compressor
# recipe for an MoE carries).
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"]


def split_experts(src: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """-> ({module name: [out, in] expert weight}, {name: every other tensor})."""
    experts, rest = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        m = EXPERT_WEIGHT.match(name)
        if m:
            experts[m["mod"]] = t
        else:
            rest[name] = t
    return experts, rest


def save_quantized(src: str, out: str, tensors: dict[str, torch.Tensor], qc: dict | None,
                   extra_files: dict[str, dict] | None = None) -> str:
    """Copy ``src``'s side files, write ``tensors`` and config.json (+ ``quantization_config``
    when ``qc`` is given; a writer that updates config.json itself passes None)."""
    os.makedirs(out, exist_ok=True)
    for entry in os.listdir(src):
        if entry.endswith(".safetensors") or entry.endswith(".index.json"):
            continue
        path = os.path.join(src, entry)
        if os.path.isfile(path) and not os.path.exists(os.path.join(out, entry)):
            shutil.copy2(path, os.path.join(out, entry))
    if qc is not None:
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = qc
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    for name, content in (extra_files or {}).items():
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def reference_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w: Callable[[int, str], torch.Tensor]) -> torch.Tensor:
    """Dequantize-then-matmul in float32: sum_k weights[t, k] * down(silu(gate x) * up x) with
    w(e, proj) the test's dequantized [out, in] weight of expert e."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = torch.nn.functional.silu(w(e, "gate_proj") @ x[t]) * (w(e, "up_proj") @ x[t])
            out[t] += weights[t, k] * (w(e, "down_proj") @ h)
    return out


def assert_model_matches_reference(path: str, dequant: Callable[[str], torch.Tensor]) -> None:
    """Load ``path`` through our loader (float32 activations) and compare every MoE layer's
    output on random tokens and routing with ``reference_moe`` over ``dequant(module name)``.

    Tolerance rtol 1e-4 / atol 1e-5: both sides compute the same float32 math, only the
    summation order differs (64-long dot products of O(0.1) terms: ~1e-6 relative). A layout
    mistake (nibble order, zero offset, scale transpose, reciprocal global scale) changes
    outputs by O(1) relative, 4 orders of magnitude above it."""
    model = get_model(make_vllm_config(path))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
    assert layers and all(m.quant_method.scheme != "unquantized" for m in layers.values())
    g = torch.Generator().manual_seed(0)
    for name, layer in layers.items():
        T, H = 12, layer.hidden_size
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)])
        weights = torch.rand(T, TOP_K, generator=g)
        got = layer.forward_experts(x, weights, ids)
        cache: dict = {}

        def w(e, proj):
            key = f"{name}.{e}.{proj}"
            if key not in cache:
                cache[key] = dequant(key).float()
            return cache[key]
        torch.testing.assert_close(got, reference_moe(x, weights, ids, w), rtol=1e-4, atol=1e-5)


def greedy(path: str, **kw) -> tuple[list, LLM]:
    llm = LLM(path, dtype="float32", **kw)          # float32 activations
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (3, 9, 17)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids,
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs], llm


def assert_cache_equals_no_cache(path: str, sizes=(1, TOP_K)) -> None:
    """Greedy tokens and logprobs with the expert cache at each N equal those without it."""
    want, _ = greedy(path)
    for n in sizes:
        got, llm = greedy(path, moe_expert_cache_size=n)
        assert got == want, f"cache size {n}"
        assert llm.get_moe_cache_stats()["misses"] > 0
