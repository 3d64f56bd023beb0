"""The C RMSNorm, rotary and argmax kernels against torch: the layers' own ``forward_torch``
(checked against transformers in tests/model_executor/layers/test_rotary_and_norm.py) and
``Tensor.argmax``."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(7, 48), (3, 4, 64), (2, 21)])
def test_rmsnorm_kernel_matches_torch(dtype, tol, shape):
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-6).to(dtype)
    norm.weight.data.copy_(torch.randn(shape[-1], generator=g))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    got = norm(x)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, norm.forward_torch(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rotary_dim,scaling", [(32, 1.0), (16, 1.0), (32, 1.2)])
def test_rotary_kernel_matches_torch(dtype, tol, rotary_dim, scaling):
    T, hq, hkv, D = 9, 6, 2, 32
    g = torch.Generator().manual_seed(rotary_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rope = RotaryEmbedding(D, rotary_dim, inv_freq, attention_scaling=scaling)
    pos = torch.tensor([0, 1, 5, 17, 300, 2047, 4095, 9, 9])
    q = torch.randn(T, hq * D, generator=g).to(dtype)
    k = torch.randn(T, hkv * D, generator=g).to(dtype)
    got_q, got_k = rope(pos, q, k)
    want_q, want_k = rope.forward_torch(pos, q, k)
    assert got_q.dtype == dtype and got_k.shape == k.shape
    torch.testing.assert_close(got_q.float(), want_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_k.float(), want_k.float(), atol=tol, rtol=tol)
    if rotary_dim < D:      # dims past the rotary part are copied untouched
        tail = (..., slice(rotary_dim, None))
        assert torch.equal(got_q.view(T, hq, D)[tail], q.view(T, hq, D)[tail])


def test_cos_sin_rows_are_reused_only_for_the_same_positions_and_frequencies():
    """Layers of one forward share the cos/sin rows of their positions tensor; a module with
    other frequencies, or a new positions tensor with other values, gets its own."""
    D = 32
    ropes = [RotaryEmbedding(D, D, 1.0 / (base ** (torch.arange(0, D, 2).float() / D)))
             for base in (10000, 500)]
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(4, 2 * D, generator=g), torch.randn(4, D, generator=g)
    pos, other = torch.tensor([3, 70, 9, 1000]), torch.tensor([5, 6, 7, 8])
    for rope, p in [(ropes[0], pos), (ropes[1], pos), (ropes[0], pos), (ropes[0], other)]:
        got, want = rope(p, q, k), rope.forward_torch(p, q, k)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_argmax_matches_torch_including_ties_and_nan():
    from vllm.kernels.cpu.ops import argmax_rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4099, generator=g)
    x[1, 17] = x[1, 4000] = 50.0            # tie: the first index wins
    x[2, 4098] = float("nan")                # in the scalar tail
    x[3, 5] = float("nan"); x[3, 9] = float("nan")
    x[4] = float("-inf")
    x[5, 0] = 99.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, :7]), x[:, :7].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k,renorm", [(32, 4, True), (8, 2, False), (60, 8, True), (5, 5, True)])
@pytest.mark.parametrize("T", [37, 700])         # 700 x 32: rows split across threads
def test_topk_softmax_kernel_matches_torch_router(dtype, E, k, renorm, T):
    from vllm.model_executor.layers.fused_moe.router import (RouterConfig, select_experts,
                                                             select_experts_torch)
    g = torch.Generator().manual_seed(E + k)
    # Distinct logits (multiples of 1/8, exact in bf16 too): torch.topk's order among equal
    # scores is unspecified, the kernel's is the lower expert first (tested below).
    logits = torch.stack([(torch.randperm(E, generator=g) - E / 2) / 8 for _ in range(T)])
    logits = logits.to(dtype)
    cfg = RouterConfig(top_k=k, renormalize=renorm, num_experts=E)
    weights, ids = select_experts(logits, cfg)              # the C kernel on CPU
    want_w, want_ids = select_experts_torch(logits, cfg)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)


def test_topk_softmax_kernel_ties_take_the_lower_expert_first():
    from vllm.kernels.cpu.ops import topk_softmax
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, -1.0]])
    weights, ids = topk_softmax(logits, 4, renormalize=False)
    assert ids.tolist() == [[1, 3, 2, 4]]
    scores = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights, scores[:, [1, 3, 2, 4]])


def test_wrappers_reject_shapes_the_kernels_would_overrun():
    """The C side trusts its sizes: each wrapper checks them and names what does not fit."""
    from vllm.kernels.cpu import ops
    with pytest.raises(ValueError, match="bias has 3 elements"):
        ops.dense_linear(torch.randn(2, 16), ops.prepack(torch.randn(8, 16)), 8, torch.randn(3))
    with pytest.raises(ValueError, match="weight has 5 elements"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(5), 1e-6)
    with pytest.raises(ValueError, match="rotary_dim=16"):
        ops.rotary_embedding(torch.randn(3, 8), torch.randn(3, 32), torch.randn(3, 32), 16, 16)
    cache = torch.zeros(2, 4, 4, 2, 8)
    with pytest.raises(ValueError, match="layers.0.attn: write_kv_cache"):
        ops.write_kv_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.arange(2), cache,
                           "layers.0.attn")
    with pytest.raises(ValueError, match="do not fit num_kv_heads=2"):
        ops.paged_attention(torch.randn(3, 4, 8), cache, torch.zeros(2, 1, dtype=torch.long),
                            torch.ones(2, dtype=torch.long), 1.0, 2)
