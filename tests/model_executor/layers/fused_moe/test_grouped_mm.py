"""The grouped_mm expert backend against the per-expert loop reference (bitwise on CPU)."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.fused_moe.grouped_mm import (expert_pairs_grouped,
                                                             grouped_mm_refusal)
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref
from vllm.platforms import platform_for


def _case(T, E=8, K=2, H=32, N=16, dtype=torch.float32, seed=0, skip_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * N, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, N, generator=g) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if skip_frac:
        ids = torch.where(torch.rand(T, K, generator=g) < skip_frac, -1, ids)
    w = torch.rand(T, K, generator=g).to(dtype)
    return x, w13, w2, w, ids


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 8191, 8192, 8193])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_equal_to_reference(T, dtype):
    x, w13, w2, w, ids = _case(T, dtype=dtype, seed=T)
    ref = torch.full((T, 2, x.shape[1]), 7.0, dtype=dtype)
    got = ref.clone()
    expert_pairs_ref(x, w13, w2, w, ids, ref)
    expert_pairs_grouped(x, w13, w2, w, ids, got)
    assert torch.equal(got, ref)


def test_skipped_pairs_untouched_and_unused_experts():
    # Only experts 0 and 5 used, many pairs skipped (-1, as in a wave of the expert cache).
    x, w13, w2, w, ids = _case(40, skip_frac=0.5, seed=3)
    ids = torch.where(ids >= 0, torch.where(ids % 2 == 0, 0, 5), -1)
    sentinel = torch.full((40, 2, x.shape[1]), -3.0)
    ref, got = sentinel.clone(), sentinel.clone()
    expert_pairs_ref(x, w13, w2, w, ids, ref)
    expert_pairs_grouped(x, w13, w2, w, ids, got)
    assert torch.equal(got, ref)
    assert torch.equal(got[ids < 0], sentinel[ids < 0])


def test_gelu_activation():
    # Not bitwise: torch's vectorised erf-GELU may round differently depending on the tensor's
    # shape. Cached vs uncached stays bitwise because both use the same backend.
    x, w13, w2, w, ids = _case(9, seed=4)
    ref, got = torch.zeros(9, 2, 32), torch.zeros(9, 2, 32)
    expert_pairs_ref(x, w13, w2, w, ids, ref, "gelu")
    expert_pairs_grouped(x, w13, w2, w, ids, got, "gelu")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_support_check():
    cpu, cuda = platform_for("cpu"), platform_for("cuda")
    assert grouped_mm_refusal(32, 16, torch.float32, cpu) is None
    assert "hidden_size=30" in grouped_mm_refusal(30, 16, torch.float32, cpu)  # 120-byte rows
    assert "bfloat16" in grouped_mm_refusal(32, 16, torch.float32, cuda)
    assert grouped_mm_refusal(32, 16, torch.bfloat16, cuda) is None   # the SM is the registry's


def test_compiles_fullgraph():
    # bf16: torch's fake-tensor rule for _grouped_mm (used while tracing) only accepts bf16.
    x, w13, w2, w, ids = _case(17, seed=5, dtype=torch.bfloat16)

    def f(x, w, ids):
        out = x.new_zeros(17, 2, 32)
        expert_pairs_grouped(x, w13, w2, w, ids, out)
        return out.sum(1)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    ref = torch.zeros(17, 2, 32, dtype=torch.bfloat16)
    expert_pairs_ref(x, w13, w2, w, ids, ref)
    assert torch.equal(compiled(x, w, ids), ref.sum(1))
