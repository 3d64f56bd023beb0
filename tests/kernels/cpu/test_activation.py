"""The C gated activations (``activation.c``) against the torch ops the model ran before them,
in the model dtype (each torch op rounds): ``F.silu(gate) * up`` and
``x + torch.sigmoid(g) * y``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.kernels.cpu import ops

# f32: vexp is about 1 ulp from torch's exp; bf16: a rounding step may land one bf16 ulp apart.
TOLS = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-3, rtol=1.6e-2)}


def _randn(*shape, gen, scale=3.0):
    return torch.randn(*shape, generator=gen) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 37), (3, 2, 16), (300, 300)])   # tails; rows in threads
def test_silu_and_mul_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    gate, up = _randn(*shape, gen=g).to(dtype), _randn(*shape, gen=g).to(dtype)
    gate.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])      # saturated and zero
    got = ops.silu_and_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype
    torch.testing.assert_close(got, F.silu(gate) * up, **TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(4, 24), (300, 256)])
def test_sigmoid_gate_add_matches_torch(dtype, T, H):
    g = torch.Generator().manual_seed(T + H)
    x, y = _randn(T, H, gen=g).to(dtype), _randn(T, H, gen=g).to(dtype)
    logits = _randn(T, 1, gen=g).to(dtype)
    logits[:2, 0] = torch.tensor([-100.0, 100.0])
    got = ops.sigmoid_gate_add(x, logits, y)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, x + torch.sigmoid(logits) * y, **TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_element_does_not_depend_on_where_it_sits(dtype):
    """A row alone, or cut to a ragged width, gives the bits it gets in the full call."""
    g = torch.Generator().manual_seed(0)
    gate, up = _randn(6, 40, gen=g).to(dtype), _randn(6, 40, gen=g).to(dtype)
    full = ops.silu_and_mul(gate, up)
    assert torch.equal(ops.silu_and_mul(gate[2:3], up[2:3]), full[2:3])
    assert torch.equal(ops.silu_and_mul(gate[:, :21].contiguous(), up[:, :21].contiguous()),
                       full[:, :21])
    x, y, logits = _randn(6, 40, gen=g).to(dtype), _randn(6, 40, gen=g).to(dtype), \
        _randn(6, 1, gen=g).to(dtype)
    full = ops.sigmoid_gate_add(x, logits, y)
    assert torch.equal(ops.sigmoid_gate_add(x[4:], logits[4:], y[4:]), full[4:])


def test_bad_shapes_name_the_op():
    a = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="silu_and_mul: gate"):
        ops.silu_and_mul(a, torch.zeros(3, 9))
    with pytest.raises(ValueError, match="sigmoid_gate_add"):
        ops.sigmoid_gate_add(a, torch.zeros(3, 2), a)
