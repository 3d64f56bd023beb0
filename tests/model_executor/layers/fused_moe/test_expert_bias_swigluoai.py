"""Experts with biases and GPT-OSS's clamped "swigluoai" activation: FusedMoE on every backend
against transformers' own GptOssExperts + router, the two torch backends bitwise equal, a
backend without biases refused, and the expert cache moving biases with their experts (cached ==
uncached bitwise)."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.grouped_mm import expert_pairs_grouped
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation, MoEKernelQuery
from vllm.model_executor.layers.fused_moe.registry import MoEBackend, select_moe_backend
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref
from vllm.platforms import platform_for
from tiny_checkpoints import layer_config as vllm_config

E, H, I, TOP_K = 8, 32, 16, 2
LIMIT, ALPHA = 0.4, 1.702    # a small limit, so random weights reach both clamps


def hf_mlp(seed=0):
    """transformers' GPT-OSS MoE block with random weights and non-zero biases."""
    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                    num_experts_per_tok=TOP_K, swiglu_limit=LIMIT,
                                    swiglu_alpha=ALPHA)
    torch.manual_seed(seed)
    mlp = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
    return mlp


def our_layer(mlp, cache_size=0, moe_backend="auto", dtype=torch.float32):
    """FusedMoE loaded from the HF module: its gate_up [E, H, 2I] is input-major with gate/up
    interleaved along the outputs; ours is [E, 2I, H] = [gate rows; up rows]."""
    ex = mlp.experts
    gu = ex.gate_up_proj.detach().transpose(1, 2)                     # [E, 2I, H]
    w13 = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
    b = ex.gate_up_proj_bias.detach()
    b13 = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
    with set_current_vllm_config(vllm_config(cache_size, moe_backend=moe_backend)):
        layer = FusedMoE(E, TOP_K, H, I, activation=MoEActivation("swigluoai", ALPHA, LIMIT),
                         bias=True, params_dtype=dtype)
        for name, t in (("w13_weight", w13), ("w2_weight", ex.down_proj.detach().transpose(1, 2)),
                        ("w13_bias", b13), ("w2_bias", ex.down_proj_bias.detach())):
            layer.load_expert_weight(name, t.to(dtype), None, None)
        layer.finish_loading(torch.device("cpu"))
    return layer


def router_logits(mlp, x):
    return torch.nn.functional.linear(x, mlp.router.weight, mlp.router.bias)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm", "cpu_kernel", "auto"])
@pytest.mark.parametrize("T", [1, 9, 40])
def test_matches_transformers_gpt_oss_experts(backend, T):
    mlp = hf_mlp()
    layer = our_layer(mlp, moe_backend=backend)
    assert layer.quant_method.backend_name == ("cpu_kernel" if backend == "auto" else backend)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        want = mlp(x[None])[0][0]
        got = layer(x, router_logits(mlp, x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_clamps_are_reached():
    """Guards the test above: with these weights some gate and up values lie beyond the limit."""
    mlp = hf_mlp()
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(40))
    with torch.no_grad():
        gu = x @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    assert (gu[:, 0::2] > LIMIT).any() and (gu[:, 1::2].abs() > LIMIT).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_bitwise_equal_to_reference(dtype):
    g = torch.Generator().manual_seed(3)
    T, N = 50, I
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * N, H, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(E, H, N, generator=g) * 0.3).to(dtype)
    b13, b2 = torch.randn(E, 2 * N, generator=g).to(dtype), torch.randn(E, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)])
    ids = torch.where(torch.rand(T, TOP_K, generator=g) < 0.3, -1, ids)   # skipped pairs
    w = torch.rand(T, TOP_K, generator=g).to(dtype)
    act = MoEActivation("swigluoai", ALPHA, LIMIT)
    ref = torch.full((T, TOP_K, H), 5.0, dtype=dtype)
    got = ref.clone()
    expert_pairs_ref(x, w13, w2, w, ids, ref, act, b13, b2)
    expert_pairs_grouped(x, w13, w2, w, ids, got, act, b13, b2)
    assert torch.equal(got, ref)
    assert (ref[ids < 0] == 5.0).all()


def test_every_builtin_backend_takes_them_and_a_backend_without_refuses():
    q = MoEKernelQuery("unquantized", "swigluoai", torch.float32, H, I, platform_for("cpu"), True)
    for name in ("cpu_kernel", "grouped_mm", "torch"):
        assert select_moe_backend(q, name).name == name
    plain = MoEBackend("plain", lambda act, deq: None)        # the declaration's defaults
    assert plain.refusal(q) == "it implements activations ['silu', 'gelu'], not 'swigluoai'"
    q_silu = MoEKernelQuery("unquantized", "silu", torch.float32, H, I, platform_for("cpu"), True)
    assert plain.refusal(q_silu) == "it does not add expert biases (w13_bias/w2_bias)"


def test_unknown_activation_and_bias_names():
    with pytest.raises(ValueError, match=r"activation='relu' is invalid.*swigluoai"):
        FusedMoE(E, TOP_K, H, I, activation="relu")
    with set_current_vllm_config(vllm_config()):
        layer = FusedMoE(E, TOP_K, H, I, bias=True)
    assert layer.quant_method.expert_tensor_names() == ("w13_weight", "w2_weight", "w13_bias",
                                                        "w2_bias")
    assert layer.w13_bias.shape == (E, 2 * I) and layer.w2_bias.shape == (E, H)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm", "cpu_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_bitwise_equal_uncached(backend, dtype):
    mlp = hf_mlp(seed=1)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(t, H, generator=g).to(dtype) for t in (1, 6, 33, 2)]
    plain = our_layer(mlp, moe_backend=backend, dtype=dtype)
    want = [plain(x, router_logits(mlp, x.float()).to(dtype)) for x in batches]
    for n in (1, TOP_K, E // 2):
        layer = our_layer(mlp, cache_size=n, moe_backend=backend, dtype=dtype)
        cache = layer.expert_cache
        assert {"w13_bias", "w2_bias"} <= set(cache.names)
        assert layer.w13_bias.shape == (n, 2 * I) and cache.store.tensors["w2_bias"].shape == (E, H)
        got = [layer(x, router_logits(mlp, x.float()).to(dtype)) for x in batches]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n
