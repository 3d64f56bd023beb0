"""exp12's C encoder (``vllm/kernels/cpu/exp12.c``) against the torch encoder it replaces at
load (``link_codec._encode_expert``): the same planes, plane for plane; both round-trip to the
original bits (tests/model_executor/layers/fused_moe/expert_cache/test_link_codec.py)."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import encode
from vllm.platforms import native_kernels

pytestmark = pytest.mark.skipif(not native_kernels(torch.float32, torch.device("cpu")),
                                reason="the CPU kernels are not built here (no C compiler?)")


def _specials(t: torch.Tensor) -> torch.Tensor:
    flat = t.view(t.shape[0], -1)
    flat[0, :8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40,
                                -3e-39, 1e30], dtype=torch.bfloat16)
    flat[2, 128:256] = 0.0
    return t


def test_the_c_encoder_writes_the_torch_encoders_planes():
    """Blocks holding an infinity escape nearly all their weights: more escapes than the C
    wrapper's first guess of room (n / 64), so its retry runs too."""
    g = torch.Generator().manual_seed(2)
    t = _specials(torch.randn(4, 64, 256, generator=g).mul_(0.02).to(torch.bfloat16))
    t.view(4, -1)[1, ::128] = float("inf")
    a, b = encode(t, native=True), encode(t, native=False)
    assert int((a.esc_index[1] >= 0).sum()) > t[0].numel() // 64
    for x, y in zip(a.planes, b.planes):
        assert torch.equal(x, y)


def test_the_c_encoder_refuses_bad_planes_by_name():
    from vllm.kernels.cpu.exp12 import exp12_encode_expert
    w = torch.zeros(256, dtype=torch.bfloat16)
    u8 = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="planes must be"):
        exp12_encode_expert(w, u8, u8, u8[:2])
    with pytest.raises(ValueError, match="w must be"):
        exp12_encode_expert(w.float(), u8, u8[:128], u8[:2])




def _rows(c, e: int, shape: tuple[int, int]):
    from vllm.kernels.cpu.exp12 import Exp12Rows
    return Exp12Rows(c.lo[e], c.codes[e], c.base[e], c.esc_index[e], c.esc_bits[e], shape)


@pytest.mark.parametrize("R,C", [(64, 256), (37, 384), (6, 64), (2, 192), (600, 2048)])
def test_the_c_decode_gives_the_original_bits(R, C):
    """exp12_decode (one expert's planes -> bf16) returns the encoded weights bit for bit:
    escapes (subnormals, an infinity's block), zeros of both signs and NaN included; shapes
    whose rows do not start on a block of 128 too. The escape list is padded with -1 past an
    expert's count (expert 1 has fewer escapes than expert 0)."""
    from vllm.kernels.cpu.exp12 import exp12_decode
    g = torch.Generator().manual_seed(3)
    t = _specials(torch.randn(3, R, C, generator=g).mul_(0.05).to(torch.bfloat16))
    t.view(3, -1)[1, -1] = 1e-35
    c = encode(t)
    assert int((c.esc_index[1] >= 0).sum()) < c.esc_index.shape[1]
    for e in range(3):
        assert torch.equal(exp12_decode(_rows(c, e, (R, C))).view(torch.int16),
                           t[e].view(torch.int16)), e


def test_exp12_rows_refuse_a_bad_layout_by_name():
    from vllm.kernels.cpu.exp12 import exp12_decode
    c = encode(torch.zeros(2, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"exp12 planes of a \[4, 32\] weight"):
        exp12_decode(_rows(c, 0, (4, 32)))            # lo has 256 bytes, not 128
    bad = _rows(c, 0, (4, 64))
    with pytest.raises(ValueError, match="must be contiguous 1-D CPU tensors"):
        exp12_decode(type(bad)(c.lo, bad.codes, bad.base, bad.esc_index, bad.esc_bits, (4, 64)))
