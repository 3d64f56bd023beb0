"""Router configuration checks and grouped top-k against a plain reference."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.fused_moe.router import RouterConfig, select_experts


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=9, num_experts=8), "top_k=9"),
    (dict(top_k=2, num_experts=8, num_expert_group=3), "num_expert_group=3"),
    (dict(top_k=2, num_experts=8, num_expert_group=4, topk_group=5), "topk_group=5"),
    (dict(top_k=4, num_experts=8, num_expert_group=4, topk_group=1), "top_k=4"),
    (dict(top_k=2, scoring_func="relu"), "scoring_func='relu'"),
])
def test_invalid_configs_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kw)


def _grouped_ref(scores, bias, groups, keep, k):
    """Per token: rank groups (best expert, or sum of best two with a bias), keep the best
    ``keep`` groups, then take the top-k of the biased scores inside them."""
    T, E = scores.shape
    size = E // groups
    ids = []
    for t in range(T):
        choice = scores[t] + (bias if bias is not None else 0)
        gscore = [sorted(choice[g * size:(g + 1) * size].tolist(), reverse=True)
                  for g in range(groups)]
        gscore = [s[0] + s[1] if bias is not None else s[0] for s in gscore]
        kept = sorted(range(groups), key=lambda g: -gscore[g])[:keep]
        allowed = [e for e in range(E) if e // size in kept]
        ids.append(sorted(allowed, key=lambda e: -choice[e].item())[:k])
    return ids


@pytest.mark.parametrize("use_bias", [False, True])
def test_grouped_topk_matches_reference(use_bias):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.1 if use_bias else None
    cfg = RouterConfig(top_k=3, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                       renormalize=False, num_experts=16)
    weights, ids = select_experts(logits, cfg, bias)
    ref = _grouped_ref(logits.sigmoid(), bias, 4, 2, 3)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in ref]
    # The bias chooses experts; the weights are the unbiased scores.
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids))


def test_correction_bias_stays_float32_in_a_bf16_model():
    """Models are built under their dtype as torch's default; the correction bias must not
    follow it: bf16 would round biases like 0.30078 vs 0.30117 together and change choices."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = FusedMoE(8, 2, 16, 8, scoring_func="sigmoid", use_correction_bias=True)
    finally:
        torch.set_default_dtype(prev)
    assert layer.e_score_correction_bias.dtype == torch.float32
