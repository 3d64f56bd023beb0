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


