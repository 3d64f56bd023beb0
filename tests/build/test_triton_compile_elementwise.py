"""The Triton elementwise kernels (``vllm/kernels/triton/elementwise.py``) compile for each CI
architecture (SM90, SM120) without a GPU, in every dtype, and their PTX keeps the precision the
module promises: precise sin/cos in rotary (no ``sin.approx`` / ``cos.approx``), IEEE sqrt and
division in RMSNorm, round-to-nearest float32 -> bf16/fp16 casts. Compiling is not running: the
results are checked on a GPU by the ``gpu`` tests of tests/kernels/triton/test_elementwise.py."""
from __future__ import annotations


import pytest
from triton_compile import compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
from vllm.kernels.triton import elementwise as m

FLOATS = {"eps": "fp32", "scaling": "fp32"}
INTS = {"N", "x_stride", "g_stride", "u_stride", "q_stride", "k_stride", "HQ", "HK"}

def compile_one(fn, dtype, consts, cc, ptr_types=None):
    ptr_types = ptr_types or {}
    def arg_type(a):
        if a in consts:
            return "constexpr"
        if a in FLOATS:
            return FLOATS[a]
        if a in INTS:
            return "i32"
        return ptr_types.get(a, "*" + dtype)
    sig = {a: arg_type(a) for a in fn.arg_names}
    return compile_kernel(fn, sig, consts, cc, m.LAUNCH_OPTIONS)

for cc in (90, 120):
    for dt in ("fp32", "fp16", "bf16"):
        out[f"{cc}/rms/{dt}"] = compile_one(m._rms_norm_kernel, dt, {"BLOCK": 1024}, cc)
        out[f"{cc}/rope/{dt}"] = compile_one(
            m._rotary_kernel, dt, dict(D=80, HALF=20, BLOCK_HALF=32, PASS=40, BLOCK_PASS=64,
                                       HB=32), cc,
            {"pos_ptr": "*i64", "inv_ptr": "*fp32"})
    out[f"{cc}/rms/N=1"] = compile_one(m._rms_norm_kernel, "fp32", {"N": 1, "BLOCK": 1}, cc)
    out[f"{cc}/rope/full"] = compile_one(
        m._rotary_kernel, "fp16", dict(D=128, HALF=64, BLOCK_HALF=64, PASS=0, BLOCK_PASS=1,
                                       HB=32), cc, {"pos_ptr": "*i32", "inv_ptr": "*fp32"})
    for act, code in m.ACTS.items():
        out[f"{cc}/act/{act}"] = compile_one(m._act_and_mul_kernel, "bf16",
                                             {"ACT": code, "BLOCK": 1024}, cc)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(SCRIPT)


def _kernels(compiled, cc, kind):
    return {k: v for k, v in compiled.items() if k.startswith(f"{cc}/{kind}/")}


@pytest.mark.parametrize("cc", [90, 120])
def test_every_kernel_compiles(compiled, cc):
    mine = {k: v for k, v in compiled.items() if k.startswith(f"{cc}/")}
    assert len(mine) == 11
    for name, k in mine.items():
        assert k["cubin"] > 0, name
        assert f".target sm_{cc}a" in k["ptx"], name


@pytest.mark.parametrize("cc", [90, 120])
def test_rotary_uses_precise_sin_cos(compiled, cc):
    for name, k in _kernels(compiled, cc, "rope").items():
        assert "sin.approx" not in k["ptx"] and "cos.approx" not in k["ptx"], name


@pytest.mark.parametrize("cc", [90, 120])
def test_rms_norm_divides_and_roots_in_ieee(compiled, cc):
    for name, k in _kernels(compiled, cc, "rms").items():
        ptx = k["ptx"]
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx, name
        assert "rsqrt.approx" not in ptx and "sqrt.approx" not in ptx, name


@pytest.mark.parametrize("cc", [90, 120])
def test_downcasts_round_to_nearest(compiled, cc):
    """float32 -> bf16 / fp16 stores round to nearest even (the interpreter truncates bf16)."""
    for kind, dt, cvt in (("rms", "bf16", "cvt.rn.bf16"), ("rms", "fp16", "cvt.rn.f16.f32"),
                          ("rope", "bf16", "cvt.rn.bf16"), ("rope", "fp16", "cvt.rn.f16.f32")):
        assert cvt in compiled[f"{cc}/{kind}/{dt}"]["ptx"], (kind, dt)
    for act in ("silu", "gelu", "gelu_tanh"):
        assert "cvt.rn.bf16" in compiled[f"{cc}/act/{act}"]["ptx"], act
