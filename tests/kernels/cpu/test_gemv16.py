"""The matrix products on 16-bit weight rows (``vllm/kernels/cpu/gemv16.c``) against a float64
matmul written here: bf16 and f16 weights, bf16 / f16 / f32 tokens (bf16 with bf16 is the pair
chain, the others widen), token counts around the kernel's chunk of 4, odd row counts, columns
past the last 32- and 16-column steps, rows apart in memory (a view of a wider store); f16's
subnormals, infinities and NaN decoded exactly; bad arguments refused by name."""
from __future__ import annotations

import pytest
import torch

from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.kernels.cpu.gemv16 import gemv16

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="CPU kernels not built")


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    got = gemv16(x, w)
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T
    # f32 sums of exact products in another order: within f32 rounding of the magnitudes.
    bound = 2e-6 * (x64.abs() @ w64.abs().T) + 1e-30
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("R,C", [(1, 64), (7, 101), (16, 48), (33, 200)])
def test_gemv16_equals_float64(wdtype, xdtype, T, R, C):
    g = torch.Generator().manual_seed(R * 1000 + C + T)
    w = torch.randn(R, C, generator=g).to(wdtype)
    x = torch.randn(T, C, generator=g).to(xdtype)
    _check(x, w)


def test_rows_apart_in_memory():
    """A view of the first C columns of a wider [R, C + 40] tensor: rows ldw apart."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(9, 136, generator=g).to(torch.bfloat16)
    w = wide[:, :96]
    assert w.stride(0) == 136
    for xdtype in (torch.bfloat16, torch.float32):
        _check(torch.randn(2, 96, generator=g).to(xdtype), w)


def test_f16_special_values_decode_exactly():
    """Row r holds one weight, in column r (a diagonal), and token r is one-hot at r: y[r, r]
    is the weight's value, for subnormals, zeros, the largest finite and infinities (in the
    widening chain's vector and in the column tail); a NaN weight gives NaN."""
    vals = torch.tensor([6e-8, -6e-8, 3e-5, 0.0, 65504.0, -65504.0, float("inf"),
                         float("-inf"), 1.0, -2.5, 0.1] + [0.5] * 9, dtype=torch.float16)
    C = vals.numel()                                         # 20: one vector and a tail of 4
    got = gemv16(torch.eye(C), torch.diag(vals)).diagonal()
    assert torch.equal(got, vals.float())
    w_nan = torch.tensor([float("nan")] + [0.0] * (C - 1), dtype=torch.float16)[None]
    assert gemv16(torch.eye(C)[:1], w_nan).isnan().all()


def test_no_tokens_and_no_rows():
    assert gemv16(torch.zeros(0, 8), torch.zeros(3, 8, dtype=torch.bfloat16)).shape == (0, 3)
    assert gemv16(torch.zeros(2, 8), torch.zeros(0, 8, dtype=torch.bfloat16)).shape == (2, 0)


@pytest.mark.parametrize("x,w,needle", [
    (torch.zeros(1, 8), torch.zeros(3, 8), "must be a 2-D bf16 or float16 CPU tensor"),
    (torch.zeros(1, 8), torch.zeros(8, 3, dtype=torch.bfloat16).T, "unit column stride"),
    (torch.zeros(1, 7), torch.zeros(3, 8, dtype=torch.bfloat16), r"must be a float \[T, 8\]"),
    (torch.zeros(1, 8, dtype=torch.int32), torch.zeros(3, 8, dtype=torch.bfloat16),
     "torch.int32")])
def test_bad_arguments_are_refused(x, w, needle):
    with pytest.raises(ValueError, match=needle):
        gemv16(x, w)
