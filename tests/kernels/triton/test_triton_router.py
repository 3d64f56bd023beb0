"""The Triton softmax top-k router (``vllm/kernels/triton/router.py``) against a reference
written here (float64 softmax; the k largest, ties to the lower expert id), on CUDA where there
is a GPU, else under Triton's interpreter: ids exactly, weights to float32 rounding. Also: the
engine's router takes it where the platform hands it out (plain softmax only)."""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def rt():
    return triton_module("router")


def reference(logits: torch.Tensor, k: int, renorm: bool):
    x = logits.double().cpu()
    scores = torch.softmax(x, dim=-1)
    ids, weights = [], []
    for row, s in zip(x.tolist(), scores.tolist()):
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]   # ties: lower id
        w = [s[e] for e in order]
        total = sum(w)
        ids.append(order)
        weights.append([v / total for v in w] if renorm else w)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,renorm", [(1, 8, 2, True), (37, 60, 8, True), (5, 128, 8, False),
                                          (3, 5, 5, True), (9, 257, 6, True), (1, 1, 1, False)])
def test_matches_the_reference(rt, dtype, T, E, k, renorm):
    g = torch.Generator().manual_seed(T * 7 + E)
    logits = (torch.randn(T, E, generator=g) * 3).to(dtype).to(DEVICE)
    weights, ids = rt.topk_softmax(logits, k, renorm)
    want_w, want_ids = reference(logits, k, renorm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (T, k)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu().double(), want_w, atol=3e-6, rtol=3e-6)


def test_ties_take_the_lower_expert_first_and_strided_rows(rt):
    wide = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, -1.0, 9.0, 9.0]], device=DEVICE)
    logits = wide[:, :6]                               # a view: row stride 8
    weights, ids = rt.topk_softmax(logits, 4, renormalize=False)
    assert ids.tolist() == [[1, 3, 2, 4]]
    want = torch.softmax(logits.cpu().double(), dim=-1)[:, [1, 3, 2, 4]]
    torch.testing.assert_close(weights.cpu().double(), want, atol=1e-6, rtol=1e-6)


def test_zero_tokens_and_bad_arguments(rt):
    w, i = rt.topk_softmax(torch.zeros(0, 8, device=DEVICE), 2, True)
    assert w.shape == i.shape == (0, 2)
    with pytest.raises(ValueError, match=r"top_k=9 is invalid: must be in \[1, 8\]"):
        rt.topk_softmax(torch.zeros(2, 8, device=DEVICE), 9, True)
    with pytest.raises(ValueError, match="contiguous rows"):
        rt.topk_softmax(torch.zeros(8, 2, device=DEVICE).t(), 1, True)


def test_the_router_takes_the_platform_kernel_for_plain_softmax_only(rt, monkeypatch):
    """select_experts asks elementwise_ops first: the kernel for plain softmax routing; expert
    groups (or a bias, or sigmoid) keep the torch path."""
    from vllm.model_executor.layers.fused_moe import router as router_mod
    from vllm.platforms.interface import ElementwiseOps
    calls = []

    def kernel(logits, k, renorm):
        calls.append((k, renorm))
        return rt.topk_softmax(logits, k, renorm)
    ops = ElementwiseOps((torch.float32,), None, None, None, None, kernel)
    monkeypatch.setattr(router_mod, "elementwise_ops", lambda dtype, device: ops)
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    plain = router_mod.RouterConfig(top_k=2, renormalize=True, num_experts=16)
    w, ids = router_mod.select_experts(logits, plain)
    want_w, want_ids = router_mod.select_experts_torch(logits, plain)
    assert calls == [(2, True)] and torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, atol=3e-6, rtol=3e-6)
    grouped = router_mod.RouterConfig(top_k=2, renormalize=True, num_experts=16,
                                      num_expert_group=4, topk_group=2)
    router_mod.select_experts(logits, grouped)
    assert calls == [(2, True)]
