"""The C dense linear (packed weights) against F.linear, and the Linear layer that uses it."""
from __future__ import annotations

import pytest
import torch
from cpu_builds import run_with_cflags
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


def _pair_chain_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, n], w [cols, n] bf16 -> f32 [M, cols] by the chain gemm.h documents for bf16: for
    each input pair the odd product first, then the even one, then the last input when n is odd.
    One torch op per step: a product of two bf16 values is exact in f32, so each add rounds
    once, as an FMA does."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    order = [i for p in range(x.shape[1] // 2) for i in (2 * p + 1, 2 * p)]
    for i in order + ([x.shape[1] - 1] if x.shape[1] % 2 else []):
        acc = acc + xf[:, i, None] * wf[None, :, i]
    return acc


@pytest.mark.parametrize("M,n,cols", [(1, 32, 64), (5, 47, 40), (33, 256, 130), (7, 25, 7),
                                      (9, 2, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_the_pair_chain_bitwise(M, n, cols, bias):
    g = torch.Generator().manual_seed(M * cols + n)
    x, w = torch.randn(M, n, generator=g), torch.randn(cols, n, generator=g)
    # A product of 2^20 first and its negation last: the small products are summed at that
    # magnitude, where f32 rounds coarsely, so another order (even product first, or one
    # rounding per pair) changes the bf16 result.
    x[:, 0], w[:, 0], x[:, n - 1], w[:, n - 1] = 2.0 ** 10, 2.0 ** 10, 2.0 ** 10, -2.0 ** 10
    x, w = x.bfloat16(), w.bfloat16()
    b = torch.randn(cols, generator=g).bfloat16() if bias else None
    want = _pair_chain_ref(x, w) + (b.float() if bias else 0.0)
    assert torch.equal(dense_linear(x, prepack(w), cols, b), want.bfloat16())


def test_matches_f_linear_bf16_and_keeps_leading_dims():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    got = dense_linear(x, prepack(w), 96, b)
    assert got.shape == (2, 3, 96) and got.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b.float())          # f32 math on the same bf16 inputs
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def test_prepack_bf16_layout():
    """Written out by index: per block of 64 columns, row pairs interleaved, then the odd row."""
    n, cols = 5, 70                                               # blocks of 64 + 6 columns
    # Distinct values: consecutive bf16 bit patterns from 1.0 up.
    w = torch.arange(0x3F80, 0x3F80 + cols * n, dtype=torch.int16).view(torch.bfloat16)
    w = w.reshape(cols, n)
    expect = []
    for start in (0, 64):
        width = min(64, cols - start)
        for p in range(n // 2):
            expect += [w[start + c, 2 * p + j].item() for c in range(width) for j in (0, 1)]
        expect += [w[start + c, n - 1].item() for c in range(width)]
    assert prepack(w).tolist() == expect


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


def test_bf16_portable_chain_equals_the_instruction(monkeypatch):
    """A library built without AVX512-BF16 computes the same pair chains with FMAs: the same
    bits as the instruction's, in the dense and expert GEMMs and attention's q . k (on a
    machine without the instruction both builds are the portable one)."""
    from vllm.kernels.cpu.ops import paged_attention
    from vllm.model_executor.layers.fused_moe.cpu_kernel import expert_pairs_cpu
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 47, generator=g).bfloat16(), torch.randn(70, 47, generator=g).bfloat16()
    xe = torch.randn(6, 40, generator=g).bfloat16()
    w13 = (torch.randn(4, 2 * 21, 40, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(4, 40, 21, generator=g) * 0.2).bfloat16()
    ids, wts = torch.randint(0, 4, (6, 2), generator=g), torch.rand(6, 2, generator=g)
    cache = torch.randn(2, 8, 16, 2, 64, generator=g).bfloat16()      # 8 blocks of 16 tokens
    q = torch.randn(3, 4, 64, generator=g).bfloat16()
    tables, lens = torch.randperm(8, generator=g).view(2, 4), torch.tensor([40, 64, 7])

    def run():
        out = torch.zeros(6, 2, 40, dtype=torch.bfloat16)
        expert_pairs_cpu(xe, prepack(w13), prepack(w2), wts, ids, out)
        attn = paged_attention(q, cache, tables, lens, 0.125, 2, torch.tensor([0, 1, 1]))
        return dense_linear(x, prepack(w), 70), out, attn

    native = run()
    portable = run_with_cflags(monkeypatch, "-mno-avx512bf16", run)
    for a, b in zip(native, portable):
        assert torch.equal(a, b)
