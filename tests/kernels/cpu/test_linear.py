"""The C dense linear (packed weights) against F.linear, and the Linear layer that uses it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.kernels.cpu import build
from vllm.kernels.cpu.ops import dense_linear, prepack
from vllm.model_executor.layers.linear import Linear


@pytest.mark.parametrize("M,n,cols", [(1, 32, 64), (5, 48, 40), (33, 256, 4096), (7, 24, 7),
                                      (130, 80, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_f32(M, n, cols, bias):
    g = torch.Generator().manual_seed(M * cols)
    x, w = torch.randn(M, n, generator=g), torch.randn(cols, n, generator=g)
    b = torch.randn(cols, generator=g) if bias else None
    torch.testing.assert_close(dense_linear(x, prepack(w), cols, b), F.linear(x, w, b),
                               atol=1e-4, rtol=1e-5)


def test_matches_f_linear_bf16_and_keeps_leading_dims():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    got = dense_linear(x, prepack(w), 96, b)
    assert got.shape == (2, 3, 96) and got.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b.float())          # f32 math on the same bf16 inputs
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(37, 72, generator=g), torch.randn(150, 72, generator=g)
    packed = prepack(w)
    whole = dense_linear(x, packed, 150)
    alone = torch.cat([dense_linear(x[i:i + 1], packed, 150) for i in range(37)])
    assert torch.equal(whole, alone)


def test_rejects_a_weight_that_does_not_fit():
    with pytest.raises(ValueError, match="does not match"):
        dense_linear(torch.randn(2, 16), prepack(torch.randn(8, 16)), 9)


def test_linear_layer_packs_once_and_matches_nn_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(40, 24)
    layer = Linear(40, 24)
    layer.load_state_dict(ref.state_dict())
    layer.finish_loading(torch.device("cpu"))
    assert "weight" not in dict(layer.named_parameters())     # replaced, not duplicated
    layer.finish_loading(torch.device("cpu"))                   # idempotent
    x = torch.randn(6, 40)
    torch.testing.assert_close(layer(x), ref(x), atol=1e-5, rtol=1e-5)


def test_linear_layer_keeps_weight_without_kernels(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KERNELS", "0")
    build.load_cpu_kernels.cache_clear()
    try:
        layer = Linear(8, 4, bias=False)
        torch.nn.init.ones_(layer.weight)
        layer.finish_loading(torch.device("cpu"))
        assert torch.equal(layer(torch.ones(1, 8)), torch.full((1, 4), 8.0))
        assert "weight" in dict(layer.named_parameters())
    finally:
        build.load_cpu_kernels.cache_clear()
