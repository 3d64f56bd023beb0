"""Non-gated experts (Nemotron-H: down(relu(up(x))^2), activation "relu2_no_mul", w13 = the up
projection alone [E, I, H]): FusedMoE with Nemotron-H's routing against transformers' own
NemotronHExperts + NemotronHTopkRouter on every backend, the two torch backends bitwise equal,
quantized schemes refused with a reason, a gate projection refused at load, and the expert cache
(cached == uncached bitwise, C kernel and torch)."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.nemotron_h.modeling_nemotron_h import (NemotronHExperts,
                                                                NemotronHTopkRouter)

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from tiny_checkpoints import layer_config as vllm_config

E, H, I, TOP_K = 8, 32, 16, 2


def hf_modules(seed=0):
    """transformers' router (sigmoid, correction bias, 4 groups keep 2, scaling 2.5) and experts,
    random weights and bias."""
    cfg = transformers.NemotronHConfig(hidden_size=H, n_routed_experts=E, num_experts_per_tok=TOP_K,
                                       moe_intermediate_size=I, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, layers_block_type=["moe"])
    torch.manual_seed(seed)
    router, experts = NemotronHTopkRouter(cfg), NemotronHExperts(cfg)
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.1)
    return router, experts


def our_layer(router, experts, cache_size=0, moe_backend="auto"):
    """FusedMoE loaded expert by expert, as the checkpoint stores them (experts.{e}.up_proj)."""
    with set_current_vllm_config(vllm_config(cache_size, moe_backend=moe_backend)):
        layer = FusedMoE(E, TOP_K, H, I, renormalize=True, scoring_func="sigmoid",
                         num_expert_group=4, topk_group=2, routed_scaling_factor=2.5,
                         use_correction_bias=True, activation="relu2_no_mul")
        assert tuple(layer.w13_weight.shape) == (E, I, H)
        for e in range(E):
            layer.load_expert_weight("w13_weight", experts.up_proj[e].detach(), e, "w3")
            layer.load_expert_weight("w2_weight", experts.down_proj[e].detach(), e, "w2")
        layer.e_score_correction_bias.data.copy_(router.e_score_correction_bias)
        layer.finish_loading(torch.device("cpu"))
    return layer


def forward(layer, router, x):
    return layer(x, torch.nn.functional.linear(x, router.weight))


@pytest.mark.parametrize("backend", ["torch", "grouped_mm", "cpu_kernel", "auto"])
@pytest.mark.parametrize("T", [1, 9, 40])
@torch.no_grad()
def test_matches_transformers_nemotron_h_experts(backend, T):
    router, experts = hf_modules()
    layer = our_layer(router, experts, moe_backend=backend)
    assert layer.quant_method.backend_name == ("cpu_kernel" if backend == "auto" else backend)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    _, w, ids = router(x)
    torch.testing.assert_close(forward(layer, router, x), experts(x, ids, w), rtol=1e-5,
                               atol=1e-5)


@torch.no_grad()
def test_torch_backends_agree_bitwise_and_cache_changes_nothing():
    router, experts = hf_modules(1)
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(0))
    ref = forward(our_layer(router, experts, moe_backend="torch"), router, x)
    assert torch.equal(forward(our_layer(router, experts, moe_backend="grouped_mm"), router, x),
                       ref)
    c_ref = forward(our_layer(router, experts, moe_backend="cpu_kernel"), router, x)
    for backend, want in (("torch", ref), ("cpu_kernel", c_ref)):
        for n in (1, TOP_K, E // 2):
            layer = our_layer(router, experts, cache_size=n, moe_backend=backend)
            for _ in range(2):                   # the second pass starts from a warm cache
                assert torch.equal(forward(layer, router, x), want), f"{backend} capacity {n}"
            assert layer.expert_cache.stats()["misses"] > 0


def test_gate_shard_and_quantized_are_refused():
    router, experts = hf_modules()
    layer = our_layer(router, experts, moe_backend="torch")
    with pytest.raises(ValueError, match="not gated.*no gate projection"):
        layer.load_expert_weight("w13_weight", experts.up_proj[0].detach(), 0, "w1")
    with set_current_vllm_config(vllm_config()), \
            pytest.raises(ValueError, match="non-gated experts.*unquantized only"):
        FusedMoE(E, TOP_K, H, I, activation="relu2_no_mul",
                 quant_method=Fp8MoEMethod("tensor", None, "relu2_no_mul"))
