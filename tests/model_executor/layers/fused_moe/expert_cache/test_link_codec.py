"""exp12 (expert_cache/link_codec.py): bf16 experts in 12 bits per weight, losslessly. The
expected values are the original tensors' bits and a layout worked out by hand."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import (decode, encode,
                                                                          refusal)
from vllm.platforms import native_kernels


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _specials(t: torch.Tensor) -> torch.Tensor:
    """Zeros of both signs, infinities, NaN, subnormals, huge and tiny values, placed in blocks
    of otherwise ordinary weights (so some fall outside their block's window)."""
    flat = t.view(t.shape[0], -1)
    flat[0, :8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40,
                                -3e-39, 1e30], dtype=torch.bfloat16)
    flat[1, 300] = 1e-20
    flat[1, 301] = -2e-25
    flat[2, 128:256] = 0.0                 # a whole block of zeros
    return t


def _native_or_skip(native: bool) -> None:
    if native and not native_kernels(torch.float32, torch.device("cpu")):
        pytest.skip("the CPU kernels are not built here (no C compiler?)")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("shape", [(3, 4, 128), (3, 96, 64), (5, 8, 16, 32)])
def test_round_trip_is_bit_exact(shape, native):
    _native_or_skip(native)
    g = torch.Generator().manual_seed(1)
    t = _specials(torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16))
    c = encode(t, native=native)
    assert torch.equal(_bits(decode(c)), _bits(t))
    rows = torch.tensor([2, 0, 2])
    assert torch.equal(_bits(decode(c, rows)), _bits(t[rows]))


def test_layout_by_hand():
    """One expert, one block: exponents chosen so each code case appears."""
    w = torch.ones(1, 128, dtype=torch.bfloat16)            # 1.0 = exponent 127, mantissa 0
    w[0, 1] = -1.5                 # exponent 127, mantissa 0x40, sign
    w[0, 2] = 2.0 ** -13           # exponent 114
    w[0, 3] = 2.0 ** -14           # exponent 113
    w[0, 4] = 0.0                  # exponent 0 -> code 14
    w[0, 5] = 4.0                  # exponent 129: the block's largest
    c = encode(w)
    assert c.base.tolist() == [[129]]
    # 129 - exponent where that is <= 13; 14 for exponent 0; else 15 (2**-13: 129 - 114 = 15)
    code = [2, 2, 15, 15, 14, 0] + [2] * 122
    packed = [code[i] | (code[i + 1] << 4) for i in range(0, 128, 2)]
    assert c.codes.tolist() == [packed]
    assert c.lo[0, :2].tolist() == [0x00, 0x80 | 0x40]
    assert c.esc_index.tolist() == [[2, 3]]
    assert _bits(w)[0, 2:4].tolist() == c.esc_bits.tolist()[0]


def test_twelve_bits_a_weight_on_gaussian_weights():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4, 256, 512, generator=g).mul_(0.03).to(torch.bfloat16)
    c = encode(t)
    per_weight = c.bytes_per_expert * 8 / t[0].numel()
    assert 12.0 < per_weight < 12.2, per_weight
    assert int((c.esc_index >= 0).sum()) < t.numel() * 1e-3


def test_planes_come_from_the_given_allocator():
    made = []

    def empty(shape, dtype):
        made.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)
    t = torch.randn(2, 256).to(torch.bfloat16)
    encode(t, empty)
    assert [d for _, d in made] == [torch.uint8] * 3 + [torch.int32, torch.int16]
    assert made[:3] == [((2, 256), torch.uint8), ((2, 128), torch.uint8), ((2, 2), torch.uint8)]


@pytest.mark.parametrize("t,needle", [(torch.zeros(2, 128), "bfloat16"),
                                      (torch.zeros(2, 100, dtype=torch.bfloat16), "multiple"),
                                      (torch.zeros(256, dtype=torch.bfloat16), "multiple")])
def test_what_exp12_cannot_hold_is_refused_by_name(t, needle):
    assert needle in refusal(t)
    with pytest.raises(ValueError, match=needle):
        encode(t)
