"""Bit-level helpers against plain-Python references: int4 packing, e2m1 codes and packing, e4m3."""
import pytest
import torch

from vllm.model_executor.layers.quantization.utils import (e2m1_to_float, expand_block_scale,
                                                           float_to_e2m1, pack_e2m1, pack_int4,
                                                           to_e4m3, unpack_e2m1, unpack_int4)

# e2m1 as the OCP MX spec defines it: 1 sign, 2 exponent (bias 1), 1 mantissa bit.
def e2m1_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def test_int4_pack_matches_bit_loop_and_round_trips():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 24), generator=g, dtype=torch.int32)
    packed = pack_int4(q, dim=1)                                   # [5, 3]
    assert packed.dtype == torch.int32 and packed.shape == (5, 3)
    for r in range(5):
        for w in range(3):
            word = sum(int(q[r, 8 * w + k]) << (4 * k) for k in range(8))
            assert int(packed[r, w]) & 0xFFFFFFFF == word
    assert torch.equal(unpack_int4(packed, dim=1), q)
    # along dim 0 (GPTQ qweight layout [in/8, out])
    assert torch.equal(unpack_int4(pack_int4(q.t(), dim=0), dim=0), q.t())


def test_int4_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(3, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 15\].*16"):
        pack_int4(torch.full((8,), 16, dtype=torch.int32))


def test_e2m1_codes_values_and_packing():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_to_float(codes).tolist() == [e2m1_value(c) for c in range(16)]
    # nearest-value rounding: every representable value maps to itself (except -0 -> +0)
    vals = torch.tensor([e2m1_value(c) for c in range(16)])
    back = float_to_e2m1(vals)
    assert e2m1_to_float(back).tolist() == [abs(v) if v == 0 else v for v in vals.tolist()]
    assert e2m1_to_float(float_to_e2m1(torch.tensor([0.74, 0.76, 2.4, 2.6, 5.1, 9.0, -3.4]))
                         ).tolist() == [0.5, 1.0, 2.0, 3.0, 6.0, 6.0, -3.0]
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, 16, (3, 10), generator=g).to(torch.uint8)
    p = pack_e2m1(c)
    assert p.shape == (3, 5)
    assert all(int(p[r, j]) == int(c[r, 2 * j]) | (int(c[r, 2 * j + 1]) << 4)
               for r in range(3) for j in range(5))
    assert torch.equal(unpack_e2m1(p), c)


def test_e4m3_saturates_instead_of_nan():
    x = to_e4m3(torch.tensor([1000.0, -1000.0, 1.0]))
    assert x.float().tolist() == [448.0, -448.0, 1.0]


def test_expand_block_scale_crops_edge_blocks():
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    full = expand_block_scale(s, 3, 5, 2, 4)
    want = torch.tensor([[1, 1, 1, 1, 2], [1, 1, 1, 1, 2], [3, 3, 3, 3, 4]], dtype=torch.float32)
    assert torch.equal(full, want)
