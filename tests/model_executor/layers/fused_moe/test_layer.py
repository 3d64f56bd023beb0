"""FusedMoE without a cache against a per-token loop reference written from the model definitions;
weight loading; when the cache turns on."""
import math

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from tiny_checkpoints import layer_config as vllm_config

E, H, I = 8, 32, 16


def per_token_reference(x, logits, w13, w2, top_k, renormalize=True, scoring="softmax",
                        bias=None, groups=None, topk_group=None, scale=1.0, activation="silu"):
    """One token at a time, in float64, following the routing as the model papers describe it."""
    x, logits, w13, w2 = x.double(), logits.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = [float(v) for v in (logits[t].softmax(0) if scoring == "softmax"
                                else logits[t].sigmoid())]
        choice = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        if groups:
            size = E // groups
            best = sorted(range(groups), key=lambda g: -max(choice[g * size:(g + 1) * size]))
            kept = set(best[:topk_group])
            choice = [c if e // size in kept else -math.inf for e, c in enumerate(choice)]
        ids = sorted(range(E), key=lambda e: -choice[e])[:top_k]
        ws = [s[e] for e in ids]
        if renormalize:
            ws = [w / sum(ws) for w in ws]
        for e, wt in zip(ids, ws):
            gate, up = w13[e][:I] @ x[t], w13[e][I:] @ x[t]
            act = (gate * torch.sigmoid(gate) if activation == "silu"
                   else 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2))))
            out[t] += wt * scale * (w2[e] @ (act * up))
    return out


CASES = {
    "mixtral": dict(top_k=2),
    "no_renorm": dict(top_k=2, renormalize=False),
    "deepseek_v3": dict(top_k=3, scoring="sigmoid", bias=True, scale=2.5),
    "grouped": dict(top_k=2, groups=4, topk_group=2),
    "gelu": dict(top_k=2, activation="gelu"),
}


def build_layer(case, dtype, seed=0, cache_size=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    with set_current_vllm_config(vllm_config(cache_size)):
        layer = FusedMoE(E, case["top_k"], H, I, renormalize=case.get("renormalize", True),
                         scoring_func=case.get("scoring", "softmax"),
                         num_expert_group=case.get("groups"), topk_group=case.get("topk_group"),
                         routed_scaling_factor=case.get("scale", 1.0),
                         use_correction_bias=case.get("bias", False),
                         activation=case.get("activation", "silu"), params_dtype=dtype)
        layer.load_expert_weight("w13_weight", w13, None, None)
        layer.load_expert_weight("w2_weight", w2, None, None)
        bias = None
        if case.get("bias"):
            bias = torch.randn(E, generator=g) * 0.5
            layer.e_score_correction_bias.data.copy_(bias)
        layer.finish_loading(torch.device("cpu"))
    return layer, w13, w2, bias


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T", [1, 7, 64])
def test_uncached_layer_matches_per_token_reference(dtype, tol, case, T):
    kw = CASES[case]
    layer, w13, w2, bias = build_layer(kw, dtype)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    want = per_token_reference(x, logits, w13, w2, kw["top_k"], kw.get("renormalize", True),
                               kw.get("scoring", "softmax"), bias, kw.get("groups"),
                               kw.get("topk_group"), kw.get("scale", 1.0),
                               kw.get("activation", "silu"))
    got = layer(x, logits)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_per_expert_shards_load_like_fused_tensors():
    fused, w13, w2, _ = build_layer(CASES["mixtral"], torch.float32)
    with set_current_vllm_config(vllm_config()):
        layer = FusedMoE(E, 2, H, I)
    for e in range(E):
        layer.load_expert_weight("w13_weight", w13[e][:I], e, "w1")
        layer.load_expert_weight("w13_weight", w13[e][I:], e, "w3")
        layer.load_expert_weight("w2_weight", w2[e], e, "w2")
    layer.finish_loading(torch.device("cpu"))
    assert torch.equal(layer.w13_weight, fused.w13_weight)
    assert torch.equal(layer.w2_weight, fused.w2_weight)


def test_bad_loads_are_rejected():
    with set_current_vllm_config(vllm_config()):
        layer = FusedMoE(E, 2, H, I, prefix="model.layers.3.mlp.experts")
    assert layer.layer_index == 3
    with pytest.raises(ValueError, match=r"expert 1 shape mismatch.*\(16, 31\)"):
        layer.load_expert_weight("w13_weight", torch.zeros(I, H - 1), 1, "w1")
    with pytest.raises(KeyError, match="no expert parameter 'w9_weight'"):
        layer.load_expert_weight("w9_weight", torch.zeros(1), 0, None)


@pytest.mark.parametrize("cache_size,on", [(0, False), (3, True), (E - 1, True), (E, False),
                                           (E + 5, False)])
def test_cache_turns_on_only_below_num_experts(cache_size, on):
    with set_current_vllm_config(vllm_config(cache_size)):
        layer = FusedMoE(E, 2, H, I)
        if on:  # expert params are born in host memory, the store's source
            assert layer.w13_weight.device.type == "cpu" and layer.w2_weight.device.type == "cpu"
        layer.finish_loading(torch.device("cpu"))
    assert (layer.expert_cache is not None) == on
    assert layer.w13_weight.shape[0] == (cache_size if on else E)


def test_routing_observer_sees_topk_ids():
    layer = build_layer(CASES["mixtral"], torch.float32)[0]
    seen = []
    layer.routing_observer = lambda idx, ids, lg: seen.append((idx, ids.clone(), lg))
    logits = torch.randn(5, E)
    layer(torch.randn(5, H), logits)
    assert len(seen) == 1 and seen[0][0] == 0 and seen[0][2] is logits
    want = torch.topk(logits.softmax(-1), 2, dim=-1).indices
    assert torch.equal(seen[0][1].sort(-1).values, want.sort(-1).values)
