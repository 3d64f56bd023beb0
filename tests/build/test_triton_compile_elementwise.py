"""The Triton elementwise kernels (``vllm/kernels/triton/elementwise.py``) compile for each CI
architecture (SM90, SM120) without a GPU, in every dtype, and their PTX keeps the precision the
module promises: precise sin/cos in rotary (no ``sin.approx`` / ``cos.approx``), IEEE sqrt and
division in RMSNorm, round-to-nearest float32 -> bf16/fp16 casts. Each kernel is compiled as
Triton's JIT specializes the launch its wrapper makes (tests/triton_compile.py
``capture_launches``, ``compile_like_jit``) at the probe model's shapes: hidden 2048, 32 query
and 4 kv heads of head_dim 128, an MLP of 768. Compiling is not running: the results are
checked on a GPU by the ``gpu`` tests of tests/kernels/triton/test_elementwise.py."""
from __future__ import annotations

import re

import pytest
from triton_compile import compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

# The body of a script run by compile_in_subprocess (tests/triton_compile.py): each wrapper
# called on meta tensors of T = 16 tokens, its one launch compiled.
SCRIPT = r"""
import torch
from vllm.kernels.triton import elementwise as m

T = 16
DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

def empty(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")

def compile_call(kernel, call, cc):
    ((_, values, consts, options),) = capture_launches([(m, kernel)], call)
    return compile_with_spills(getattr(m, kernel), values, consts, cc, options)

def rms(H, rows, dt, cc):          # rows of H: the hidden state, or q / k heads (q_norm)
    x, w = empty(rows, H, dtype=DT[dt]), empty(H, dtype=DT[dt])
    return compile_call("_rms_norm_kernel", lambda: m.rms_norm(x, w, 1e-6), cc)

def add_rms(H, dt, cc):            # the residual add fused into the norm (HAS_RESIDUAL)
    x, r, w = empty(T, H, dtype=DT[dt]), empty(T, H, dtype=DT[dt]), empty(H, dtype=DT[dt])
    return compile_call("_rms_norm_kernel", lambda: m.add_rms_norm(x, r, w, 1e-6), cc)

def rope(hq, hk, head_dim, rotary_dim, dt, pos, cc, norm=False):
    positions = empty(T, dtype=pos)
    q, k = empty(T, hq * head_dim, dtype=DT[dt]), empty(T, hk * head_dim, dtype=DT[dt])
    inv = empty(rotary_dim // 2, dtype=torch.float32)
    if norm:                       # Qwen3's q/k norms in the same launch (HAS_NORM)
        w = empty(head_dim, dtype=DT[dt])
        return compile_call("_rotary_kernel", lambda: m.qk_norm_rotary(
            positions, q, k, w, w, 1e-6, inv, 1.0, head_dim, rotary_dim), cc)
    return compile_call("_rotary_kernel", lambda: m.rotary_embedding(
        positions, q, k, inv, 1.0, head_dim, rotary_dim), cc)

def act(name, N, cc):
    gate, up = empty(T, N, dtype=torch.bfloat16), empty(T, N, dtype=torch.bfloat16)
    return compile_call("_act_and_mul_kernel", lambda: m.act_and_mul(gate, up, name), cc)

for cc in (90, 120):
    for dt in ("fp32", "fp16", "bf16"):
        out[f"{cc}/rms/{dt}"] = rms(2048, T, dt, cc)
        out[f"{cc}/rms/add_{dt}"] = add_rms(2048, dt, cc)
        out[f"{cc}/rope/{dt}"] = rope(32, 4, 128, 128, dt, torch.int64, cc)
        out[f"{cc}/rope/norm_{dt}"] = rope(32, 4, 128, 128, dt, torch.int64, cc, norm=True)
    out[f"{cc}/rms/qk_norm"] = rms(128, T * 32, "bf16", cc)
    out[f"{cc}/rms/H=1"] = rms(1, T, "fp32", cc)            # N = 1 and unit stride: constexprs
    # Partial rotary, Phi-2's (32 + 32 heads of 80, rotary_dim 32: 48 dims copied), and the
    # old test's head_dim 80 / rotary_dim 40 (16 + 16 heads); int32 positions
    out[f"{cc}/rope/phi2"] = rope(32, 32, 80, 32, "fp16", torch.int32, cc)
    out[f"{cc}/rope/partial40"] = rope(16, 16, 80, 40, "fp16", torch.int32, cc)
    for name in m.ACTS:
        out[f"{cc}/act/{name}"] = act(name, 768, cc)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(SCRIPT)


def _kernels(compiled, cc, kind):
    return {k: v for k, v in compiled.items() if k.startswith(f"{cc}/{kind}/")}


@pytest.mark.parametrize("cc", [90, 120])
def test_every_kernel_compiles(compiled, cc):
    mine = {k: v for k, v in compiled.items() if k.startswith(f"{cc}/")}
    assert len(mine) == 19
    for name, k in mine.items():
        assert k["registers"] > 0, name
        assert f".target sm_{cc}a" in k["ptx"], name


@pytest.mark.parametrize("cc", [90, 120])
def test_rotary_uses_precise_sin_cos(compiled, cc):
    for name, k in _kernels(compiled, cc, "rope").items():
        assert "sin.approx" not in k["ptx"] and "cos.approx" not in k["ptx"], name


@pytest.mark.parametrize("cc", [90, 120])
def test_rms_norms_divide_and_root_in_ieee(compiled, cc):
    """RMSNorm, and rotary with the q/k norms in it."""
    norms = {**_kernels(compiled, cc, "rms"),
             **{k: v for k, v in _kernels(compiled, cc, "rope").items() if "/norm_" in k}}
    for name, k in norms.items():
        ptx = k["ptx"]
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx, name
        assert "rsqrt.approx" not in ptx and "sqrt.approx" not in ptx, name


@pytest.mark.parametrize("cc", [90, 120])
def test_downcasts_round_to_nearest(compiled, cc):
    """float32 -> bf16 / fp16 stores round to nearest even (the interpreter truncates bf16);
    at the launches' 16-divisible rows, two at a time (cvt.rn.bf16x2.f32, cvt.rn.f16x2.f32)."""
    bf16, fp16 = r"cvt\.rn\.bf16(x2)?\.f32", r"cvt\.rn\.f16(x2)?\.f32"
    for kind, dt, cvt in (("rms", "bf16", bf16), ("rms", "fp16", fp16), ("rms", "add_bf16", bf16),
                          ("rms", "add_fp16", fp16), ("rope", "bf16", bf16),
                          ("rope", "fp16", fp16), ("rope", "phi2", fp16),
                          ("rope", "norm_bf16", bf16), ("rope", "norm_fp16", fp16)):
        assert re.search(cvt, compiled[f"{cc}/{kind}/{dt}"]["ptx"]), (kind, dt)
    for act in ("silu", "gelu", "gelu_tanh"):
        assert re.search(bf16, compiled[f"{cc}/act/{act}"]["ptx"]), act


SPILLS = {"120/rope/fp16": 4, "120/rope/bf16": 4, "120/rope/phi2": 4}
"""Spilled bytes per thread allowed (else 0): the rotary kernel on SM120 spills 4 B at the probe
shape in fp16 / bf16 under Triton 3.6 (the GPU machine's; 48 registers) and at Phi-2's under
3.9 (64 registers); 0 elsewhere. Documents the current value: not an accepted cost."""


@pytest.mark.parametrize("cc", [90, 120])
def test_no_kernel_spills(compiled, cc):
    """At the launches the wrappers make: no spilled bytes (ptxas's spill stores) but the few of
    ``SPILLS``, and no stack but rotary's (under Triton 3.6 libdevice's precise sin/cos keep a
    32-byte local array for their slow argument reduction), well under the 255-register cap.
    Measured under 3.6 and 3.9: 17-40 registers for RMSNorm and the activations, 44-90 for
    rotary (60-64 with the q/k norms at the probe shape; 83-90 at Phi-2's 48 copied dims, which
    are loaded before the rotation since the norms need them)."""
    got = {k: (v["registers"], v["spills"], v["stack"]) for k, v in compiled.items()
           if k.startswith(f"{cc}/")}
    assert all(regs < 128 and spills <= SPILLS.get(k, 0) for k, (regs, spills, _) in got.items()
               ), got
    assert all(stack == 0 for k, (_, _, stack) in got.items() if "/rope/" not in k), got
    assert all(stack <= 40 for _, _, stack in got.values()), got
