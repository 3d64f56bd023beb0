"""The Triton elementwise ops (``vllm/kernels/triton/elementwise.py``: RMSNorm, silu/gelu-and-mul,
rotary) against plain torch references written here, in float64 with the ops' roundings.

On a GPU these run the compiled kernels on CUDA; elsewhere under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py). The interpreter truncates float32 -> bfloat16
casts (the GPU rounds to nearest even), so bf16 is checked to 2 ulps; float32 and float16 to
their roundings. Shapes: odd row counts, non-power-of-two widths, rows wider than one block,
strided rows (views into a wider buffer). The tests marked ``gpu`` add large shapes on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
"""rtol = atol per output dtype: float32 arithmetic, one f16 ulp and a half, two bf16 ulps."""


@pytest.fixture(scope="module")
def ew():
    return triton_module("elementwise")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.cpu().double(), ref.cpu().double(), rtol=tol, atol=tol)


def _randn(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def ref_rms_norm(x, w, eps):
    xd = x.double()
    y = (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)   # cast back
    return (y.double() * w.double()).to(x.dtype)


def ref_act_and_mul(gate, up, act):
    g = gate.double()
    if act == "silu":
        a = g / (1 + torch.exp(-g))
    elif act == "gelu":
        a = 0.5 * g * (1 + torch.erf(g / 2 ** 0.5))
    else:
        a = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
    return (a.to(gate.dtype).double() * up.double()).to(gate.dtype)


def ref_rotary(positions, x, inv_freq, scaling, head_dim, rotary_dim):
    """Neox rotate-half of x [T, H * D]'s first rotary_dim dims per head, in float64 from the
    float32 angles; one rounding."""
    T = x.shape[0]
    ang = (positions.float()[:, None] * inv_freq[None, :]).double()            # [T, rd/2]
    c, s = (ang.cos() * scaling)[:, None, :], (ang.sin() * scaling)[:, None, :]
    xd = x.double().view(T, -1, head_dim)
    h = rotary_dim // 2
    x1, x2 = xd[..., :h], xd[..., h:rotary_dim]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, xd[..., rotary_dim:]), dim=-1)
    return out.to(x.dtype).reshape(T, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,H", [(1, 96), (7, 129), (33, 64), (3, 4099), (5, 1)])
def test_rms_norm(ew, dtype, rows, H):
    """4099 > MAX_NORM_BLOCK: the row loops over two chunks."""
    x = _randn(rows, H, dtype=dtype, scale=3.0)
    w = _randn(H, dtype=dtype, seed=1)
    _close(ew.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_and_3d(ew, dtype):
    """Per-head norm of q (Qwen3's q_norm): [T, heads, D] views, rows strided in a wider buffer."""
    buf = _randn(9, 5 * 80 + 17, dtype=dtype)
    x = buf[:, :5 * 80].view(9, 5, 80)
    w = _randn(80, dtype=dtype, seed=2)
    out = ew.rms_norm(x, w, 1e-5)
    assert out.shape == (9, 5, 80) and out.is_contiguous()
    _close(out, ref_rms_norm(x, w, 1e-5))
    plain = buf[:, 3:3 + 129]                                 # [9, 129], row stride 417
    w2 = _randn(129, dtype=dtype, seed=3)
    _close(ew.rms_norm(plain, w2, 1e-5), ref_rms_norm(plain, w2, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,H", [(1, 96), (7, 129), (3, 4099)])
def test_add_rms_norm_is_the_add_then_the_norm_bitwise(ew, dtype, rows, H):
    """The fused residual add: its sum is torch's x + residual bit for bit (one rounding to the
    dtype; bf16 under the interpreter, which truncates, within an ulp: the gpu test below checks
    its bits), its output the unfused kernel's on that sum bit for bit, and close to the torch
    reference; 4099 columns loop over two chunks. The residual may be a strided view."""
    x = _randn(rows, H, dtype=dtype, scale=3.0)
    buf = _randn(rows, H + 5, dtype=dtype, seed=4, scale=3.0)
    res = buf[:, 2:2 + H]                                     # rows strided by H + 5
    w = _randn(H, dtype=dtype, seed=1)
    out, total = ew.add_rms_norm(x, res, w, 1e-6)
    assert total.is_contiguous()
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(total, x + res, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(total, x + res)
    assert torch.equal(out, ew.rms_norm(total, w, 1e-6))
    _close(out, ref_rms_norm(total, w, 1e-6))


def test_add_rms_norm_refuses_a_mismatched_residual(ew):
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"residual \(\(2, 7\), torch.float32, .*\) must match x"):
        ew.add_rms_norm(x, x[:, :7], torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"residual .*torch.float16.* must match x"):
        ew.add_rms_norm(x, x.half(), torch.ones(8, device=DEVICE), 1e-6)


def test_zero_rows_launch_nothing(ew):
    x = torch.empty(0, 64, device=DEVICE)
    assert ew.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert ew.silu_and_mul(x, x).shape == (0, 64)
    q, pos = torch.empty(0, 128, device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)
    inv = torch.ones(32, device=DEVICE)
    assert [t.shape for t in ew.rotary_embedding(pos, q, q, inv, 1.0, 64, 64)] == [(0, 128)] * 2


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy's
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,N", [(1, 64), (7, 77), (4, 2500)])
def test_act_and_mul(ew, act, dtype, rows, N):
    """gate and up are the halves of one [rows, 2N] projection (strided rows); N = 2500 spans
    three column blocks; |gate| up to ~20 reaches exp's overflow side."""
    gate, up = _randn(rows, 2 * N, dtype=dtype, scale=5.0).chunk(2, dim=-1)
    _close(ew.act_and_mul(gate, up, act), ref_act_and_mul(gate, up, act))


def test_silu_and_gelu_entry_points(ew):
    gate, up = _randn(2, 3, 50, dtype=torch.float32), _randn(2, 3, 50, dtype=torch.float32, seed=4)
    out = ew.silu_and_mul(gate, up)
    assert out.shape == (2, 3, 50)
    _close(out, ref_act_and_mul(gate, up, "silu"))
    _close(ew.gelu_and_mul(gate, up), ref_act_and_mul(gate, up, "gelu"))
    _close(ew.gelu_and_mul(gate, up, "tanh"), ref_act_and_mul(gate, up, "gelu_tanh"))


ROPE_SHAPES = [(1, 4, 2, 64, 64), (7, 5, 3, 80, 40), (33, 3, 1, 96, 64), (5, 40, 8, 128, 128),
               (3, 2, 2, 72, 0)]
"""(T, Hq, Hkv, head_dim, rotary_dim): full and partial rotary (non-pow2 halves and rests), more
heads than one program's tile (40 + 8 at 64 half-dims), and no rotary dims (a copy)."""


def _inv_freq(rotary_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / max(rotary_dim, 1)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,D,rd", ROPE_SHAPES)
def test_rotary(ew, dtype, T, Hq, Hk, D, rd):
    """q and k are column slices of one qkv buffer (strided rows); positions up to 1e5."""
    g = torch.Generator().manual_seed(T)
    positions = torch.randint(0, 100_000, (T,), generator=g).to(DEVICE)
    qkv = _randn(T, (Hq + 2 * Hk) * D, dtype=dtype)
    q, k = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + Hk) * D]
    inv = _inv_freq(rd).to(DEVICE)
    qo, ko = ew.rotary_embedding(positions, q, k, inv, 0.7, D, rd)
    assert qo.is_contiguous() and ko.is_contiguous()
    _close(qo, ref_rotary(positions, q, inv, 0.7, D, rd))
    _close(ko, ref_rotary(positions, k, inv, 0.7, D, rd))
    for out, x in ((qo, q), (ko, k)):                         # pass-through dims: exact copies
        assert torch.equal(out.view(T, -1, D)[..., rd:], x.reshape(T, -1, D)[..., rd:])


def test_rotary_int32_positions(ew):
    pos = torch.tensor([0, 5, 2047], dtype=torch.int32, device=DEVICE)
    q, k = _randn(3, 2 * 64, dtype=torch.float32), _randn(3, 64, dtype=torch.float32, seed=5)
    inv = _inv_freq(64).to(DEVICE)
    qo, ko = ew.rotary_embedding(pos, q, k, inv, 1.0, 64, 64)
    _close(qo, ref_rotary(pos, q, inv, 1.0, 64, 64))
    _close(ko, ref_rotary(pos, k, inv, 1.0, 64, 64))
    assert torch.equal(qo[0], q[0])                           # position 0: the identity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,D,rd", ROPE_SHAPES)
def test_qk_norm_rotary(ew, dtype, T, Hq, Hk, D, rd):
    """Qwen3's per-head q/k RMSNorm then rotary, one launch: against the two references composed
    (q's and k's norm weights differ, so a swap fails), and within an ulp of the norm and rotary
    kernels run one after the other."""
    g = torch.Generator().manual_seed(D + rd)
    positions = torch.randint(0, 100_000, (T,), generator=g).to(DEVICE)
    qkv = _randn(T, (Hq + 2 * Hk) * D, dtype=dtype, seed=T, scale=3.0)
    q, k = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + Hk) * D]
    wq, wk = _randn(D, dtype=dtype, seed=1) + 1, _randn(D, dtype=dtype, seed=2)
    inv = _inv_freq(rd).to(DEVICE)
    qo, ko = ew.qk_norm_rotary(positions, q, k, wq, wk, 1e-6, inv, 0.7, D, rd)
    assert qo.is_contiguous() and ko.is_contiguous()
    # The interpreter truncates bf16 at each of the three roundings (norm, weight, rotation),
    # which the rotation can amplify where it cancels: 4x the tolerance there, not on a GPU.
    slack = 4 if dtype == torch.bfloat16 and DEVICE == "cpu" else 1
    for out, x, w in ((qo, q, wq), (ko, k, wk)):
        ref = ref_rotary(positions, ref_rms_norm(x.reshape(T, -1, D), w, 1e-6).reshape(T, -1),
                         inv, 0.7, D, rd)
        tol = TOL[dtype] * slack
        torch.testing.assert_close(out.cpu().double(), ref.cpu().double(), rtol=tol, atol=tol)
    nq, nk = (ew.rms_norm(x.reshape(T, -1, D), w, 1e-6).reshape(T, -1) for x, w in ((q, wq),
                                                                                 (k, wk)))
    for out, unfused in zip((qo, ko), ew.rotary_embedding(positions, nq, nk, inv, 0.7, D, rd)):
        _close(out, unfused)


def test_qk_norm_rotary_refuses_a_bad_norm_weight(ew):
    pos, inv = torch.zeros(2, dtype=torch.int64, device=DEVICE), _inv_freq(8).to(DEVICE)
    x, w = torch.zeros(2, 16, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"qk_norm_rotary: weight .*7 elements.* 8 elements"):
        ew.qk_norm_rotary(pos, x, x, w, w[:7], 1e-6, inv, 1.0, 8, 8)
    with pytest.raises(ValueError, match=r"weight \(torch.float16.* must be x's dtype"):
        ew.qk_norm_rotary(pos, x, x, w.half(), w, 1e-6, inv, 1.0, 8, 8)


def test_bad_input_is_refused_naming_the_value(ew):
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"dtype=torch.float64 is not supported"):
        ew.rms_norm(x.double(), torch.zeros(8, dtype=torch.float64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"weight .*7 elements.* must be x's dtype .*8 elements"):
        ew.rms_norm(x, torch.zeros(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"act='relu' is not supported"):
        ew.act_and_mul(x, x, "relu")
    with pytest.raises(ValueError, match=r"gate \(2, 8\) .* and up \(2, 7\)"):
        ew.silu_and_mul(x, x[:, :7])
    with pytest.raises(ValueError, match=r"approximate='fast' is invalid"):
        ew.gelu_and_mul(x, x, "fast")
    pos, inv = torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"rotary_dim=7 is invalid"):
        ew.rotary_embedding(pos, x, x, inv, 1.0, 8, 7)
    with pytest.raises(ValueError, match=r"q \(3, 8\) .* must be \[T=2, heads \* 8\]"):
        ew.rotary_embedding(pos, torch.zeros(3, 8, device=DEVICE), x, inv, 1.0, 8, 8)
    with pytest.raises(ValueError, match=r"inv_freq \(torch.float32, 4 elements\) .* = 2\]"):
        ew.rotary_embedding(pos, x, x, inv, 1.0, 8, 4)
    with pytest.raises(ValueError, match=r"positions must be \[T\] int32/int64, got torch.float32"):
        ew.rotary_embedding(pos.float(), x, x, inv, 1.0, 8, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_sum_is_torchs_add_bitwise_on_cuda(ew, dtype):
    """Compiled, the sum rounds to nearest as torch's add does, bf16 included."""
    x, r = _randn(257, 2048, dtype=dtype, scale=3.0), _randn(257, 2048, dtype=dtype, seed=7)
    w = _randn(2048, dtype=dtype, seed=1)
    out, total = ew.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(total, x + r) and torch.equal(out, ew.rms_norm(x + r, w, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_shapes_on_cuda(ew, dtype):
    """Prefill-sized rows and model-sized widths, compiled (on CUDA bf16 rounds to nearest, so
    this also checks what the interpreter cannot)."""
    x, w = _randn(4097, 7168, dtype=dtype, scale=2.0), _randn(7168, dtype=dtype, seed=1)
    _close(ew.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
    gate, up = _randn(4097, 2 * 2816, dtype=dtype, scale=4.0).chunk(2, dim=-1)
    for act in ew.ACTS:
        _close(ew.act_and_mul(gate, up, act), ref_act_and_mul(gate, up, act))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_far_positions_on_cuda(ew, dtype):
    """Angles up to ~1.3e5 rad: precise sin/cos (the approximate instructions are off by ~1e-2
    there) and 64 + 8 heads of 128 over 4096 tokens."""
    T, Hq, Hk, D = 4096, 64, 8, 128
    positions = torch.randint(0, 131_072, (T,), device=DEVICE)
    q, k = _randn(T, Hq * D, dtype=dtype), _randn(T, Hk * D, dtype=dtype, seed=1)
    inv = _inv_freq(D).to(DEVICE)
    qo, ko = ew.rotary_embedding(positions, q, k, inv, 1.0, D, D)
    _close(qo, ref_rotary(positions, q, inv, 1.0, D, D))
    _close(ko, ref_rotary(positions, k, inv, 1.0, D, D))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_on_cuda(ew, dtype):
    """Compiled, at the probe model's heads (32 + 4 of 128) over 4096 tokens, and Phi-2-like
    partial rotary: the interpreter test's checks (bf16 without its slack)."""
    test_qk_norm_rotary(ew, dtype, 4096, 32, 4, 128, 128)
    test_qk_norm_rotary(ew, dtype, 257, 32, 32, 80, 32)
