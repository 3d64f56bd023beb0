"""``fuse_linears``: q/k/v (gate/up) joined into one weight where the Linears run as nn.Linear (one
GEMM on a GPU), left apart where the C kernel packs them; and the loader applying it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.linear import Linear, fuse_linears
from vllm.platforms import native_kernels

CPU = torch.device("cpu")


def _linears(dtype, sizes=(32, 8, 8), bias=True, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows in sizes:
        m = Linear(n, rows, bias=bias, dtype=dtype)
        m.weight.data.copy_(torch.randn(rows, n, generator=g))
        if bias:
            m.bias.data.copy_(torch.randn(rows, generator=g))
        out.append(m)
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_fused_weight_is_the_members_rows_and_their_parameters_view_it(bias):
    """float64 on CPU runs as nn.Linear: one weight [48, 16], the members' parameters its rows
    (no second copy), and the one GEMM split by columns equals each member's output."""
    members = _linears(torch.float64, bias=bias)
    want_w = [m.weight.detach().clone() for m in members]
    want_b = [m.bias.detach().clone() for m in members] if bias else None
    x = torch.randn(5, 16, dtype=torch.float64)
    want = [F.linear(x, w, None if want_b is None else b)
            for w, b in zip(want_w, want_b or [None] * 3)]
    weight, b = fuse_linears(members, CPU)
    assert weight.shape == (48, 16) and torch.equal(weight, torch.cat(want_w))
    assert (b is None) == (not bias) and (b is None or torch.equal(b, torch.cat(want_b)))
    for i, m in enumerate(members):
        assert m.weight.data_ptr() == weight.data_ptr() + 16 * sum((32, 8, 8)[:i]) * 8
        assert torch.equal(m.weight, want_w[i])
    for got, ref in zip(F.linear(x, weight, b).split((32, 8, 8), -1), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_packed_or_mismatched_members_are_left_apart():
    if native_kernels(torch.float32, CPU):        # the C kernel will pack them: no fusion
        members = _linears(torch.float32)
        ptrs = [m.weight.data_ptr() for m in members]
        assert fuse_linears(members, CPU) is None
        assert [m.weight.data_ptr() for m in members] == ptrs
    mixed = _linears(torch.float64)[:2] + _linears(torch.float64, sizes=(8,), bias=False)
    assert fuse_linears(mixed, CPU) is None                         # bias on two of three
    wide = _linears(torch.float64)[:2] + _linears(torch.float64, sizes=(8,), n=24)
    assert fuse_linears(wide, CPU) is None                          # another input size


def _groups(model):
    """(module, its Linears of one input) of every module the loader fuses."""
    from vllm.model_executor.models.decoder import GatedMLP
    for m in model.modules():
        if hasattr(m, "v_proj"):
            yield m, (m.q_proj, m.k_proj, m.v_proj)
        elif isinstance(m, GatedMLP):
            yield m, (m.gate_proj, m.up_proj)


@pytest.mark.parametrize("arch,mlps", [("Qwen3MoeForCausalLM", 0), ("GptOssForCausalLM", 0),
                                       ("Qwen2MoeForCausalLM", 2), ("DeepseekV2ForCausalLM", 2)])
def test_the_loader_fuses_where_not_packed(tiny_model_factory, monkeypatch, arch, mlps):
    """Loaded in float16 on CPU (no C kernel for it): every attention's q/k/v and every gated
    MLP's gate/up (Qwen2-MoE's shared expert, DeepSeek's shared experts and dense layer) is
    one weight whose rows the projections view, and greedy tokens equal those of the same
    engine with the fusion turned off (a GEMM each). (Nemotron-H's attention: its
    ``test_torch_paths``, against transformers, where nothing is packed.)"""
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers import linear
    path = tiny_model_factory(arch)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [250, 7]}]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run():
        llm = LLM(path, device="cpu", dtype="float16", enforce_eager=True)
        groups = list(_groups(llm.llm_engine.runner.model))
        return groups, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    groups, fused = run()
    assert sum(len(ls) == 2 for _, ls in groups) >= mlps and groups
    for m, linears in groups:
        w = m.fused_weight
        assert w.shape[0] == sum(p.out_features for p in linears)
        assert linears[0].weight.data_ptr() == w.data_ptr()
        assert torch.equal(torch.cat([p.weight for p in linears]), w)
    monkeypatch.setattr(linear, "fuse_linears", lambda linears, device: None)
    groups, apart = run()
    assert all("fused_weight" not in m._buffers for m, _ in groups)
    assert fused == apart
