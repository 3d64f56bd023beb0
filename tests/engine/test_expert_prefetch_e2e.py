"""Next-layer expert prefetch through the engine: outputs bitwise equal to the uncached engine,
counters equal a brute-force audit, and the prediction is the next layer's norm + router applied
to this layer's residual stream (computed here from the checkpoint tensors)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from prefetch_audit import PrefetchAudit
from vllm import LLM, SamplingParams

# (arch, num_experts, top_k, num_hidden_layers): the default model's architecture (3 MoE layers)
# and DeepSeek-V2 (a dense first layer, f32 router, shared experts; 3 MoE layers).
ARCHS = [("Qwen3MoeForCausalLM", 6, 2, 3), ("DeepseekV2ForCausalLM", 8, 2, 4)]


def _prompts(n, seed=0, lo=2, hi=24):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 150, (int(k),), generator=g).tolist()
            for k in torch.randint(lo, hi, (n,), generator=g)]


def _outputs(llm, prompts, params):
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                       for d in (o.outputs[0].logprobs or [])])
            for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch,E,K,layers", ARCHS)
def test_prefetch_outputs_bitwise_equal_and_counters_audited(tiny_model_factory, arch, E, K,
                                                             layers):
    """N = 1 (< distinct experts of a step: waves), N = top_k, N = E/2; batched prefills and
    decodes. Each layer's prefetch counters equal the audit's; the first MoE layer has none."""
    path = tiny_model_factory(arch, num_hidden_layers=layers)
    prompts = _prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    ref = _outputs(LLM(path), prompts, params)
    for n in (1, K, E // 2):
        llm = LLM(path, moe_expert_cache_size=n, moe_expert_prefetch="next-layer")
        runner = llm.llm_engine.runner
        assert runner.prefetch_pairs == 2 and runner.decode_graphs is None
        audits = [PrefetchAudit(m.expert_cache) for m in runner.moe_layers]
        assert _outputs(llm, prompts, params) == ref, f"capacity {n}"
        stats = llm.get_moe_cache_stats()
        per_layer = stats["per_layer"]
        for i, audit in enumerate(audits):
            want = audit.expected()
            assert {k: per_layer[k][i] for k in want} == want, f"capacity {n}, layer {i}"
            assert per_layer["hits"][i] + per_layer["misses"][i] == audit.needed_total
        assert per_layer["prefetch_recall"][0] is None and stats["prefetch_loads"] > 0
        assert stats["bytes_copied"] == sum(
            (m + p) * c.store.bytes_per_expert for m, p, c in
            zip(per_layer["misses"], per_layer["prefetch_loads"],
                (m.expert_cache for m in runner.moe_layers)))
        llm.llm_engine.shutdown()      # now, not at exit: the audits' wrappers make a cycle


def _rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_prediction_is_next_router_on_this_layers_residual(tiny_model_factory):
    """Qwen3-MoE: the ids prefetched into layer l+1 are the softmax top-k of
    gate_{l+1}(post_attention_layernorm_{l+1}(h)), h the residual entering layer l's
    post-attention norm, recomputed from the checkpoint in plain torch."""
    path = tiny_model_factory("Qwen3MoeForCausalLM", num_hidden_layers=3)
    llm = LLM(path, moe_expert_cache_size=2, moe_expert_prefetch="next-layer")
    model = llm.llm_engine.runner.model
    ckpt = load_file(f"{path}/model.safetensors")
    eps = model.config.rms_norm_eps
    seen = []          # (layer l, h [T, H]) and (layer l+1, predicted ids [T, K]), in order
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, args, i=i: seen.append(("h", i, args[0] + args[1])), prepend=True)
        provider = layer.mlp.experts.expert_cache
        inner = provider.prefetch
        provider.prefetch = (lambda ids, rs=None, inner=inner, i=i:
                             (seen.append(("pred", i, ids.clone())), inner(ids, rs)))
    llm.generate(_prompts(3, seed=2), SamplingParams(temperature=0, max_tokens=3,
                                                     ignore_eos=True))
    checked = 0
    for (kind, i, h), (kind2, j, ids) in zip(seen, seen[1:]):
        if kind != "h" or kind2 != "pred":
            continue
        assert j == i + 1
        norm_w = ckpt[f"model.layers.{j}.post_attention_layernorm.weight"]
        gate_w = ckpt[f"model.layers.{j}.mlp.gate.weight"]
        probs = (_rms_norm(h, norm_w, eps) @ gate_w.T).float().softmax(-1)
        top = probs.topk(3, dim=-1)
        clear = top.values[:, 1] - top.values[:, 2] > 1e-4      # no near-tie at the k-th pick
        want = top.indices[:, :2].sort(-1).values
        assert torch.equal(ids.sort(-1).values[clear], want[clear])
        checked += int(clear.sum())
    assert checked > 10
    llm.llm_engine.shutdown()


def test_prefetch_value_validated_and_needs_a_cache(tiny_model_factory, vllm_log):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="moe_expert_prefetch='soon'.*next-layer"):
        LLM(path, moe_expert_cache_size=2, moe_expert_prefetch="soon")
    llm = LLM(path, moe_expert_prefetch="next-layer")
    assert llm.llm_engine.runner.prefetch_pairs == 0
    assert "moe_expert_prefetch='next-layer' ignored" in vllm_log.text
