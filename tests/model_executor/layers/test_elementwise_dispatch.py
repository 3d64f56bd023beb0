"""RMSNorm, the gated activations and rotary take the platform's fused ops (``elementwise_ops``:
CUDA's Triton kernels) when it offers them for the dtype, and otherwise their old paths (CPU: the
C kernels, also under TRITON_INTERPRET). The platform is stubbed here: the CPU platform is made
to offer spies, or the real Triton ops run interpreted, so the wiring is checked without a GPU."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.activation import get_act_and_mul_fn, silu_and_mul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.platforms import ElementwiseOps, platform_for

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rope(head_dim=16, rotary_dim=8) -> RotaryEmbedding:
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    return RotaryEmbedding(head_dim, rotary_dim, inv, attention_scaling=0.9)


@pytest.fixture
def spies(monkeypatch):
    """The CPU platform offers ops that record their calls and return a marker."""
    calls: list[tuple] = []

    def spy(name):
        def op(*args):
            calls.append((name, args))
            return "fused"
        return op
    ops = ElementwiseOps(DTYPES, spy("rms_norm"), spy("silu_and_mul"), spy("gelu_and_mul"),
                         spy("rotary_embedding"))
    monkeypatch.setattr(type(platform_for("cpu")), "elementwise_ops", lambda self: ops)
    return calls


def test_layers_call_the_fused_ops_once(spies):
    x = torch.randn(3, 16)
    norm = RMSNorm(16, eps=1e-5)
    assert norm(x) == "fused" and spies[-1][0] == "rms_norm"
    assert spies[-1][1][1] is norm.weight and spies[-1][1][2] == 1e-5
    assert silu_and_mul(x, x) == "fused" and spies[-1][0] == "silu_and_mul"
    assert get_act_and_mul_fn("silu")(x, x) == "fused"
    assert get_act_and_mul_fn("gelu_pytorch_tanh")(x, x) == "fused"
    assert spies[-1][0] == "gelu_and_mul" and spies[-1][1][2] == "tanh"
    assert get_act_and_mul_fn("gelu")(x, x) == "fused" and spies[-1][1][2] == "none"
    rope, pos = _rope(), torch.arange(3)
    assert rope(pos, torch.randn(3, 32), torch.randn(3, 16)) == "fused"
    name, args = spies[-1]
    assert name == "rotary_embedding" and args[3] is rope.inv_freq and args[4:] == (0.9, 16, 8)
    assert len(spies) == 6


def test_a_norm_with_a_residual_calls_the_fused_add_once_or_adds_then_norms(monkeypatch):
    """``RMSNorm(x, residual)``: the platform's ``add_rms_norm`` where offered; otherwise the
    add, then the plain norm (here the CPU's), returning (norm(x + residual), x + residual)."""
    norm, x, r = RMSNorm(16, eps=1e-5), torch.randn(3, 16), torch.randn(3, 16)
    out, total = norm(x, r)
    assert torch.equal(total, x + r) and torch.equal(out, norm(x + r))
    calls = []

    def fused(*args):
        calls.append(args)
        return "normed", "sum"
    ops = ElementwiseOps(DTYPES, None, None, None, None, add_rms_norm=fused)
    monkeypatch.setattr(type(platform_for("cpu")), "elementwise_ops", lambda self: ops)
    assert norm(x, r) == ("normed", "sum")
    assert len(calls) == 1 and calls[0][0] is x and calls[0][1] is r
    assert calls[0][2] is norm.weight and calls[0][3] == 1e-5


def test_rotary_with_qk_norms_calls_the_fused_op_once_or_norms_then_rotates(monkeypatch):
    """``rope(pos, q, k, q_norm, k_norm)`` (Qwen3): the platform's ``qk_norm_rotary`` where
    offered (the norms' weights and eps passed); otherwise each head normalised by the norms,
    then rotated (here the CPU's kernels); norms of another eps or dtype keep that path."""
    rope, pos = _rope(), torch.arange(3)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    qn, kn = RMSNorm(16, eps=1e-5), RMSNorm(16, eps=1e-5)
    qn.weight.data.normal_(), kn.weight.data.normal_()
    want = rope(pos, qn(q.view(3, 2, 16)).view(3, 32), kn(k.view(3, 1, 16)).view(3, 16))
    for got, ref in zip(rope(pos, q, k, qn, kn), want):
        assert torch.equal(got, ref)
    calls = []

    def spy(name, result):
        return lambda *args: calls.append((name, args)) or result(*args)
    ops = ElementwiseOps(DTYPES, spy("rms_norm", lambda x, w, eps: x), None, None,
                         spy("rotary", lambda *a: ("rotated",)),
                         qk_norm_rotary=spy("fused", lambda *a: ("q", "k")))
    monkeypatch.setattr(type(platform_for("cpu")), "elementwise_ops", lambda self: ops)
    assert rope(pos, q, k, qn, kn) == ("q", "k") and [c[0] for c in calls] == ["fused"]
    args = calls[0][1]
    assert args[0] is pos and args[1] is q and args[2] is k
    assert args[3] is qn.weight and args[4] is kn.weight and args[5] == 1e-5
    assert args[6] is rope.inv_freq and args[7:] == (0.9, 16, 8)
    kn.variance_epsilon = 1e-6                  # one eps in the kernel: the unfused path
    assert rope(pos, q, k, qn, kn) == ("rotated",)
    assert [c[0] for c in calls] == ["fused", "rms_norm", "rms_norm", "rotary"]


def test_other_dtypes_and_mismatches_keep_the_old_paths(spies):
    norm = RMSNorm(16)
    x64 = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(norm.double()(x64), norm.forward_torch(x64))       # float64: not offered
    norm32 = RMSNorm(16)
    xb = torch.randn(3, 16).to(torch.bfloat16)
    assert torch.equal(norm32(xb), norm32.forward_torch(xb))              # weight dtype differs
    q, k = torch.randn(3, 32), torch.randn(3, 16, dtype=torch.float64)
    _rope()(torch.arange(3), q, k)                                        # q, k dtypes differ
    assert get_act_and_mul_fn("relu")(q, q).equal(F.relu(q) * q)          # no fused relu
    assert spies == []


def test_the_real_cpu_platform_offers_none():
    assert platform_for("cpu").elementwise_ops() is None


@pytest.fixture
def interpreted_triton(monkeypatch):
    """The CPU platform offers the real Triton ops, run by the interpreter."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton ops run on CPU tensors only under TRITON_INTERPRET=1")
    from vllm.platforms import cuda
    ops = cuda._triton_elementwise_ops()
    monkeypatch.setattr(type(platform_for("cpu")), "elementwise_ops",
                        lambda self: ops)
    return ops


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layers_over_the_triton_ops_match_their_torch_paths(interpreted_triton, dtype):
    """The layers hand the ops the right arguments: same results as forward_torch."""
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g).to(dtype)
    norm = RMSNorm(16, eps=1e-5).to(dtype)
    norm.weight.data.normal_(generator=g)
    torch.testing.assert_close(norm(x), norm.forward_torch(x), **tol)
    gate, up = torch.randn(2, 5, 24, generator=g).to(dtype).unbind(0)
    torch.testing.assert_close(silu_and_mul(gate, up), F.silu(gate) * up, **tol)
    torch.testing.assert_close(get_act_and_mul_fn("gelu_new")(gate, up),
                               F.gelu(gate, approximate="tanh") * up, **tol)
    rope = _rope()
    pos = torch.tensor([0, 3, 17, 100, 2048])
    q, k = torch.randn(5, 48, generator=g).to(dtype), torch.randn(5, 16, generator=g).to(dtype)
    for out, ref in zip(rope(pos, q, k), rope.forward_torch(pos, q, k)):
        torch.testing.assert_close(out, ref, **tol)
    qn, kn = RMSNorm(16, eps=1e-5).to(dtype), RMSNorm(16, eps=1e-5).to(dtype)
    qn.weight.data.normal_(generator=g), kn.weight.data.normal_(generator=g)
    normed = qn.forward_torch(q.view(5, 3, 16)).view(5, 48), kn.forward_torch(k)
    for out, ref in zip(rope(pos, q, k, qn, kn), rope.forward_torch(pos, *normed)):
        torch.testing.assert_close(out, ref, **tol)
