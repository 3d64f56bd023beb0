"""The Triton fused-MoE kernels (``vllm/kernels/triton/fused_moe.py``) compile for SM90 and
SM120 without a GPU, in bf16 and fp16 (fp32, with IEEE products, on SM90), within each
target's shared memory per block: what the interpreter cannot check (lowering, shared memory,
tl.dot on 16-bit operands). Each kernel is compiled as Triton's JIT specializes the launches
``fused_moe_pairs`` makes (tests/triton_compile.py ``capture_launches``, ``compile_like_jit``)
at the probe shape: hidden 2048, moe_intermediate 768, 64 experts, top-8, with the block sizes
of the table the device reads (``get_moe_config``, by token count): the H100 table's entries on
SM90, the default table's on SM120 (and its largest on SM90: SM90 parts without a table of
their own, such as the H200, read it). Compiling is not running: results are checked by the
``gpu`` tests."""
from __future__ import annotations


import pytest
from triton_compile import SHARED_LIMIT, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

H100 = "NVIDIA H100 80GB HBM3"
# (cc, dtype, device name, tokens T): T picks the table entry (max_m 32 / 256 / 2048 / null on
# the H100 table, 32 / 512 / null on the default one).
GEMMS = [(90, "bf16", H100, t) for t in (1, 64, 1024, 4096)] + \
    [(90, e, H100, 4096) for e in ("fp16", "fp32")] + [(90, "bf16", "", 4096)] + \
    [(120, "bf16", "", t) for t in (1, 128, 4096)] + [(120, "fp16", "", 4096)]
# (cc, dtype, activation) at T = 4096 on the cc's table
ACTS = [(cc, "bf16", a) for cc in (90, 120) for a in ("silu", "gelu", "swigluoai",
                                                       "relu2_no_mul")] + \
    [(cc, e, "silu") for cc in (90, 120) for e in ("fp16", "fp32")]

# The body of a script run by compile_in_subprocess (tests/triton_compile.py): fused_moe_pairs
# on meta tensors, its launches (moe_align's, the two GEMMs', the activation's) captured; past
# moe_align's KERNEL_MAX_PAIRS its torch path runs, on meta tensors too.
SCRIPT = r"""
import torch
from vllm.kernels.triton import fused_moe as m, moe_align
H, I, E, K = 2048, 768, 64, 8
DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KERNELS = [(moe_align, "_align_kernel"), (m, "_moe_gemm_kernel"), (m, "_moe_act_kernel")]

def launches(T, elem, device, act="silu"):
    dt = dict(dtype=DT[elem], device="meta")
    rows = I if act == "relu2_no_mul" else 2 * I
    x, w13, w2 = torch.empty(T, H, **dt), torch.empty(E, rows, H, **dt), torch.empty(E, H, I, **dt)
    b13, b2 = (torch.empty(E, rows, **dt), torch.empty(E, H, **dt)) if act == "swigluoai" else \
        (None, None)
    ids = torch.empty(T, K, dtype=torch.int64, device="meta")
    weights, out = torch.empty(T, K, dtype=torch.float32, device="meta"), torch.empty(T, K, H, **dt)
    got = capture_launches(KERNELS, lambda: m.fused_moe_pairs(
        x, w13, w2, weights, ids, out, act, b13=b13, b2=b2, device_name=device))
    gemms = [g for g in got if g[0] == "_moe_gemm_kernel"]
    act_launch = [g for g in got if g[0] == "_moe_act_kernel"]
    assert len(gemms) == 2 and len(act_launch) == 1, [g[0] for g in got]
    return {"gate_up": gemms[0], "down": gemms[1], "act": act_launch[0]}

def compile_(launch, cc):
    name, values, consts, options = launch
    return compile_with_spills(getattr(m, name), values, consts, cc, options)

for cc, elem, device, T in GEMMS:
    for name, launch in launches(T, elem, device).items():
        if name != "act":
            out[f"{cc}/{elem}/{device or 'default'}/{T}/{name}"] = compile_(launch, cc)
for cc, elem, act in ACTS:
    launch = launches(4096, elem, H100 if cc == 90 else "", act)["act"]
    out[f"{cc}/{elem}/act/{act}"] = compile_(launch, cc)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"GEMMS = {GEMMS!r}\nACTS = {ACTS!r}\nH100 = {H100!r}\n"
                                 + SCRIPT, timeout=900)


def _gemm(compiled, cc, elem, device, T, name):
    return compiled[f"{cc}/{elem}/{device or 'default'}/{T}/{name}"]


@pytest.mark.parametrize("cc,elem,device,T", GEMMS)
def test_fused_moe_gemm_compiles(compiled, cc, elem, device, T):
    for name in ("gate_up", "down"):
        k = _gemm(compiled, cc, elem, device, T, name)
        assert k["registers"] > 0 and f".target sm_{cc}a" in k["ptx"], name
        assert 0 < k["shared"] <= SHARED_LIMIT[cc], (name, k["shared"])
        if elem != "fp32":
            assert "mma" in k["ptx"], name           # 16-bit operands reach the tensor cores


@pytest.mark.parametrize("cc,elem,act", ACTS)
def test_fused_moe_activation_compiles(compiled, cc, elem, act):
    k = compiled[f"{cc}/{elem}/act/{act}"]
    assert k["registers"] > 0 and f".target sm_{cc}a" in k["ptx"]
    # Measured under 3.6 and 3.9: 34-96 registers on SM120; on SM90 (its 128-row tiles at 4
    # warps) up to 186 (gelu's erf, bf16) and 162 (float32 silu); no spills.
    assert k["spills"] == 0 and k["stack"] == 0 and k["registers"] < 255, k["registers"]


SPILLS = {"90/fp32/NVIDIA H100 80GB HBM3/4096": 16}
"""Spilled bytes per thread allowed (else 0), by GEMM launch: float32 at the H100 table's last
entry (128 x 128 x 32 tiles with IEEE products, 8 warps, 3 stages) sits at ptxas's register cap
and spills, gate-up and down alike: 254 registers and 16 B under Triton 3.9, 255 and 8 B under
3.6 (the GPU machine's), on SM90. Documents the current value: not an accepted cost."""


@pytest.mark.parametrize("cc,elem,device,T", GEMMS)
def test_fused_moe_gemm_does_not_spill(compiled, cc, elem, device, T):
    """At the launches fused_moe_pairs makes: no spilled bytes (ptxas's spill stores) nor stack
    but ``SPILLS``'s, under the 255-register cap. Measured 16-bit, under 3.6 and 3.9: 50-60
    registers at decode (16-row tiles), 120-143 on SM90's larger tiles, 168-176 on SM120's
    64 x 128; 60-96 KiB of shared memory on SM90, 20-48 KiB on SM120."""
    limit = SPILLS.get(f"{cc}/{elem}/{device}/{T}", 0)
    for name in ("gate_up", "down"):
        k = _gemm(compiled, cc, elem, device, T, name)
        assert k["spills"] <= limit and k["stack"] <= limit, (name, k["spills"], k["stack"])
        assert k["registers"] < 255 or limit, (name, k["registers"])
