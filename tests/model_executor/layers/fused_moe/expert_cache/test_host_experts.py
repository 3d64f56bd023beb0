"""Which quantized experts the CPU computes through ``qgemv`` off a CPU device (``HostExperts``
with the quant method's ``host_rows``) and which it dequantizes first: a layout ``qgemv`` does
not read (FP8 blocks that split a w13 half) and experts with many tokens in a call take the
torch loop, whose pairs equal the uncached torch backend's bit for bit; act-order GPTQ, bf16
activations, NVFP4 and MXFP4 (GPT-OSS) experts through ``qgemv``."""
from __future__ import annotations

import pytest
import torch

from model_executor.layers.quantization.gpt_oss_mxfp4 import gpt_oss_mxfp4
from model_executor.layers.quantization.published_ckpt import TINY
from model_executor.tiny_checkpoints import make_vllm_config
from tools.quantize_checkpoint import main as quantize_main
from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.model_executor.layers.fused_moe.expert_cache import host_experts as module
from vllm.model_executor.layers.fused_moe.expert_cache.host_experts import host_experts
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.model_loader import get_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="CPU kernels not built")


def layers(tiny_model_factory, tmp_path, scheme, args, dtype=None):
    """(cached layer with 2 slots, uncached twin) of a tiny quantized Qwen3-MoE (MXFP4: a tiny
    GPT-OSS, biases and swigluoai), torch backend."""
    path = str(tmp_path / scheme)
    if scheme == "mxfp4":
        gpt_oss_mxfp4(tiny_model_factory("GptOssForCausalLM"), path)
    else:
        src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
        quantize_main(["--model", src, "--out", path, "--scheme", scheme, *args])

    def layer(cache_size):
        cfg = make_vllm_config(path)
        if dtype is not None:
            cfg.model_config.dtype = dtype
        cfg.moe_cache_config.cache_size = cache_size
        cfg.kernel_config.moe_backend = "torch"
        return next(m for m in get_model(cfg).modules() if isinstance(m, FusedMoE))
    return layer(2), layer(0)


def run(cached, twin, monkeypatch, T=5, dtype=torch.float32):
    """(CPU pairs from the host store, the twin's pairs, qgemv calls) for a random step."""
    calls = []
    real = module.qgemv
    monkeypatch.setattr(module, "qgemv", lambda x, w: calls.append(w) or real(x, w))
    experts = host_experts(cached.quant_method, torch.device("cuda"))
    g = torch.Generator().manual_seed(1)
    K, H = cached.top_k, cached.hidden_size
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.rand(T, K, generator=g).to(dtype)
    ids = torch.randint(0, cached.num_experts, (T, K), generator=g)
    want, got = torch.zeros(T, K, H, dtype=dtype), torch.zeros(T, K, H, dtype=dtype)
    twin.quant_method.apply_pairs(twin.weight_provider.slot_weights(), x, w, ids, want)
    experts.apply_pairs(cached.expert_cache.store.tensors, x, w, ids, got)
    return got, want, calls, ids


def test_a_layout_qgemv_does_not_read_is_dequantized(tiny_model_factory, tmp_path, monkeypatch):
    """FP8 blocks of 24 rows split the tiny model's 32-row w13 halves."""
    cached, twin = layers(tiny_model_factory, tmp_path, "fp8-block", ["--block-size", "24", "32"])
    expert0 = {n: t[0] for n, t in cached.expert_cache.store.tensors.items()}
    assert cached.quant_method.host_rows(expert0) is None
    got, want, calls, _ = run(cached, twin, monkeypatch)
    assert not calls and torch.equal(got, want)


def test_act_order_gptq_runs_qgemv_with_its_g_idx(tiny_model_factory, tmp_path, monkeypatch):
    cached, twin = layers(tiny_model_factory, tmp_path, "w4a16-gptq",
                          ["--desc-act", "--asym", "--group-size", "32"])
    expert0 = {n: t[0] for n, t in cached.expert_cache.store.tensors.items()}
    w13, w2 = cached.quant_method.host_rows(expert0)
    assert w13.g_idx is not None        # w2's 32 inputs are one group: no order to follow
    got, want, calls, ids = run(cached, twin, monkeypatch)
    assert len(calls) == 2 * len(set(ids.reshape(-1).tolist()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_experts_with_many_tokens_are_dequantized(tiny_model_factory, tmp_path, monkeypatch):
    cached, twin = layers(tiny_model_factory, tmp_path, "w4a16-gptq", [])
    monkeypatch.setattr(module, "QGEMV_MAX_TOKENS", 3)
    got, want, calls, ids = run(cached, twin, monkeypatch, T=8)
    counts = torch.bincount(ids.reshape(-1), minlength=cached.num_experts)
    few = int(((counts > 0) & (counts <= 3)).sum())
    assert 0 < few < int((counts > 0).sum())            # both kinds of expert in the step
    assert len(calls) == 2 * few
    many = [e for e in range(cached.num_experts) if counts[e] > 3]
    rows = (ids[..., None] == torch.tensor(many)).any(-1)      # [T, K] pairs of those experts
    assert torch.equal(got[rows], want[rows])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme,args", [("w4a16-gptq", ["--group-size", "32"]),
                                         ("fp8-channel", [])])
def test_bf16_activations(tiny_model_factory, tmp_path, monkeypatch, scheme, args):
    """Each product rounded to bf16 once, as the torch backend's bf16 matmul rounds it: within
    a few bf16 ulps of the dequantize-then-matmul pairs."""
    cached, twin = layers(tiny_model_factory, tmp_path, scheme, args, torch.bfloat16)
    got, want, calls, _ = run(cached, twin, monkeypatch, dtype=torch.bfloat16)
    assert calls and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0.03, atol=2e-3)


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_experts_run_qgemv(tiny_model_factory, tmp_path, monkeypatch, scheme, dtype):
    """NVFP4 (e4m3 block scales, a global scale per w13 half) and MXFP4 (e8m0 scales; GPT-OSS's
    biases and swigluoai around the products) within rounding of the dequantize-then-matmul
    pairs: two products per expert of the step, none dequantized."""
    cached, twin = layers(tiny_model_factory, tmp_path, scheme, [], dtype)
    got, want, calls, ids = run(cached, twin, monkeypatch, dtype=dtype)
    assert len(calls) == 2 * len(set(ids.reshape(-1).tolist()))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.03, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
