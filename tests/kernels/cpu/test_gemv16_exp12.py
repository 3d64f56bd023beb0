"""``gemv16_exp12`` (``vllm/kernels/cpu/gemv16.c`` over ``exp12.h``'s decode): the CPU's misses
computed from exp12 planes. Against a float64 matmul of the original bf16 weights written here,
and bit for bit against ``gemv16`` on those weights (its contract: the planes decoded a few
rows at a time, then gemv16's row pairs): bf16 tokens (the pair chain) and f32 (widening),
token counts around the chunk of 4, odd row counts, rows that do not start on a block of 128,
more rows than one decoded chunk, escapes (subnormals, an outlier's whole block)."""
from __future__ import annotations

import pytest
import torch

from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.kernels.cpu.exp12 import Exp12Rows
from vllm.kernels.cpu.gemv16 import gemv16, gemv16_exp12
from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import encode

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="CPU kernels not built")


def _experts(R: int, C: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(2, R, C, generator=g).mul_(C ** -0.5).to(torch.bfloat16)
    t[0, 0, :3] = torch.tensor([1e-30, 0.0, -0.0])            # an escape, zeros
    t[1].view(-1)[-1] = 1e-35                                  # the last weight escapes
    if R * C >= 512:
        t[1].view(-1)[256] = 1e4                               # its block escapes nearly all
    return t


@pytest.mark.parametrize("T", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("R,C", [(1, 128), (7, 384), (6, 64), (33, 256), (17, 2048)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_equals_float64_and_gemv16_bit_for_bit(T, R, C, xdtype):
    t = _experts(R, C, R * 100 + C)
    c = encode(t)
    x = torch.randn(T, C, generator=torch.Generator().manual_seed(T)).to(xdtype)
    if R * C >= 512:
        assert int((c.esc_index[1] >= 0).sum()) > 100
    for e in range(2):
        w = Exp12Rows(c.lo[e], c.codes[e], c.base[e], c.esc_index[e], c.esc_bits[e], (R, C))
        got = gemv16_exp12(x, w)
        x64, w64 = x.double(), t[e].double()
        bound = 2e-6 * (x64.abs() @ w64.abs().T) + 1e-30
        assert ((got.double() - x64 @ w64.T).abs() <= bound).all(), e
        assert torch.equal(got.view(torch.int32), gemv16(x, t[e]).view(torch.int32)), e


def test_no_tokens_and_bad_arguments():
    c = encode(torch.zeros(1, 4, 64, dtype=torch.bfloat16))
    w = Exp12Rows(c.lo[0], c.codes[0], c.base[0], c.esc_index[0], c.esc_bits[0], (4, 64))
    assert gemv16_exp12(torch.zeros(0, 64), w).shape == (0, 4)
    with pytest.raises(ValueError, match=r"must be a float \[T, 64\]"):
        gemv16_exp12(torch.zeros(1, 63), w)
    with pytest.raises(ValueError, match="exp12 planes of a"):
        gemv16_exp12(torch.zeros(1, 64), Exp12Rows(c.lo[0], c.codes[0], c.base[0],
                                                   c.esc_index[0], c.esc_bits[0], (8, 64)))


@pytest.mark.parametrize("flags", ["-mno-avx512vbmi", "-mno-avx512f"])
def test_every_build_decodes_the_same_bits(monkeypatch, flags):
    """The decode spreads code bytes with vpermb (AVX-512 VBMI); other builds widen to 32-bit
    lanes (GCC vectors: AVX-512F without VBMI, AVX2 in the -mno-avx512f build). Every build
    gives the original weights, and gemv16_exp12 its default build's bits."""
    from cpu_builds import run_with_cflags

    from vllm.kernels.cpu.exp12 import exp12_decode
    t = _experts(33, 256, 5)
    c = encode(t)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    rows = [Exp12Rows(c.lo[e], c.codes[e], c.base[e], c.esc_index[e], c.esc_bits[e], (33, 256))
            for e in range(2)]

    def run():
        return [(exp12_decode(w), gemv16_exp12(x, w)) for w in rows]
    native, other = run(), run_with_cflags(monkeypatch, flags, run)
    for e, ((d0, y0), (d1, y1)) in enumerate(zip(native, other)):
        assert torch.equal(d1.view(torch.int16), t[e].view(torch.int16)), e
        assert torch.equal(d0.view(torch.int16), d1.view(torch.int16)) and torch.equal(y0, y1)
