"""The Triton fused-MoE kernels (``vllm/kernels/triton/fused_moe.py``) compile for SM90 and
SM120 without a GPU, in bf16 and fp16 (fp32, with IEEE products, on SM90), at the largest
block sizes of the shipped tables (the default table on both, the H100 table on SM90), within
each target's shared memory per block: what the interpreter cannot check (lowering, shared
memory, tl.dot on 16-bit operands). Compiling is not running: results are checked by the
``gpu`` tests."""
from __future__ import annotations


import pytest
from triton_compile import assert_gemm_compiled, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
from vllm.kernels.triton import fused_moe as m
from vllm.kernels.triton.fused_moe_config import load_table

INTS = {"N", "K", "P", "num_m_blocks", "stride_am", "stride_ak", "stride_be", "stride_bn",
        "stride_bk", "stride_bias_e", "stride_cm", "stride_cn", "stride_in", "stride_out"}
I64 = {"sorted_ptr", "block_expert_ptr", "num_padded_ptr"}

def compile_(fn, cc, elem, consts, warps, stages):
    def ty(a):
        if a in consts: return "constexpr"
        if a in INTS: return "i32"
        if a in I64: return "*i64"
        return "fp32" if a in ("alpha", "limit") else "*" + elem
    sig = {a: ty(a) for a in fn.arg_names}
    return compile_kernel(fn, sig, consts, cc, {"num_warps": warps, "num_stages": stages})

tables = {"default": "", "h100": "NVIDIA H100 80GB HBM3"}
largest = {t: load_table(d)[1]["default"][-1][1] for t, d in tables.items()}
for cc, elem, table in GEMMS:
    cfg = largest[table]
    bk = cfg["BLOCK_K"] if elem != "fp32" else cfg["BLOCK_K"] // 2     # as fused_moe._gemm
    for name, div, weight, bias in (("gate_up", 8, False, True), ("down", 1, True, False)):
        consts = dict(ROW_DIV=div, MUL_WEIGHT=weight, HAS_BIAS=bias,
                      PRECISION="ieee" if elem == "fp32" else "tf32", BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"])
        out[f"{cc}/{elem}/{table}/{name}"] = compile_(
            m._moe_gemm_kernel, cc, elem, consts, cfg["num_warps"], cfg["num_stages"])
for cc, elem, act in ACTS:
    consts = dict(ACT=m.ACTIVATION_CODES[act], BLOCK_M=64, BLOCK_N=m.ACT_BLOCK_N)
    out[f"{cc}/{elem}/act/{act}"] = compile_(m._moe_act_kernel, cc, elem, consts, 4, 1)
"""
GEMMS = [(90, e, t) for e in ("bf16", "fp16", "fp32") for t in ("default", "h100")] + \
    [(120, e, "default") for e in ("bf16", "fp16")]
ACTS = [(cc, "bf16", a) for cc in (90, 120) for a in ("silu", "gelu", "swigluoai",
                                                       "relu2_no_mul")] + \
    [(cc, e, "silu") for cc in (90, 120) for e in ("fp16", "fp32")]

@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"GEMMS = {GEMMS!r}\nACTS = {ACTS!r}\n" + SCRIPT, timeout=900)


@pytest.mark.parametrize("cc,elem,table", GEMMS)
def test_fused_moe_gemm_compiles(compiled, cc, elem, table):
    for name in ("gate_up", "down"):
        assert_gemm_compiled(compiled[f"{cc}/{elem}/{table}/{name}"], cc, elem)


@pytest.mark.parametrize("cc,elem,act", ACTS)
def test_fused_moe_activation_compiles(compiled, cc, elem, act):
    k = compiled[f"{cc}/{elem}/act/{act}"]
    assert k["cubin"] > 0 and f".target sm_{cc}a" in k["ptx"]
