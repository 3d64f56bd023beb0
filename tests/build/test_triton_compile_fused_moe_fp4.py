"""The Triton FP4 fused-MoE GEMM (``_moe_fp4_gemm_kernel`` in
``vllm/kernels/triton/fused_moe_fp4.py``) compiles for SM90 and SM120 without a GPU: NVFP4 (e2m1
codes, e4m3 scale bytes per 16 inputs, float32 global scales) and MXFP4 (e8m0 scale bytes per 32,
no global scale), the gate-up GEMM (rows gathered by ROW_DIV, bias on MXFP4 as GPT-OSS) and the
down GEMM (routing weight), at the largest block sizes of the shipped tables (BLOCK_K as
``_fp4_gemm`` derives it), within each target's shared memory per block; 16-bit activations
reach the tensor cores in their own dtype, fp32 (IEEE products) does not, and no fp8 conversion
instruction is emitted (the scale bytes decode with integer arithmetic). What the interpreter
cannot check: lowering, shared memory, tl.dot on the dequantized B tile. Compiling is not
running: results are checked by the ``gpu`` tests.

A representative set, to keep CI cheap (~2 s a compile, ~4 s in fp32; ~40 s in all): SM90 bf16 on
the default and H100 tables, SM90 fp16 and SM120 bf16 on the default table, each in both formats
and both GEMMs; SM90 fp32 once per format (NVFP4 gate-up, MXFP4 down)."""
from __future__ import annotations

import re

import pytest
from triton_compile import assert_gemm_compiled, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
import torch
from vllm.kernels.triton import fused_moe_fp4 as m
from vllm.kernels.triton.fused_moe_config import load_table

I64 = {"sorted_ptr", "block_expert_ptr", "num_padded_ptr"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
fn = m._moe_fp4_gemm_kernel

def compile_(cc, elem, fmt, consts, warps, stages):
    def ty(a):
        if a in consts: return "constexpr"
        if not a.endswith("_ptr"): return "i32"
        if a in I64: return "*i64"
        if a in ("q_ptr", "s_ptr"): return "*u8"        # codes; scales viewed as bytes
        if a == "gs_ptr" and fmt == "nvfp4": return "*fp32"
        return "*" + elem                               # mxfp4's gs_ptr is a (unused)
    sig = {a: ty(a) for a in fn.arg_names}
    return compile_kernel(fn, sig, consts, cc, {"num_warps": warps, "num_stages": stages})

tables = {"default": "", "h100": "NVIDIA H100 80GB HBM3"}
largest = {t: load_table(d)[1]["default"][-1][1] for t, d in tables.items()}
# gemm -> (ROW_DIV, MUL_WEIGHT); bias on mxfp4 only (GPT-OSS has biases, ModelOpt NVFP4 none)
GEMM = {"gate_up": (8, False), "down": (1, True)}
for cc, elem, table, fmt, gemm in CASES:
    cfg = largest[table]
    div, weight = GEMM[gemm]
    consts = dict(E8M0=fmt == "mxfp4", GROUP=m.FP4_GROUPS[fmt], ROW_DIV=div,
                  MUL_WEIGHT=weight, HAS_BIAS=fmt == "mxfp4",
                  PRECISION="ieee" if elem == "fp32" else "tf32", BLOCK_M=cfg["BLOCK_M"],
                  BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_K=max(m._block_k(DTYPES[elem], cfg), m.FP4_GROUPS[fmt]),  # _fp4_gemm's
                  GROUP_M=cfg["GROUP_M"])
    out[f"{cc}/{elem}/{table}/{fmt}/{gemm}"] = compile_(
        cc, elem, fmt, consts, cfg["num_warps"], cfg["num_stages"])
"""
GEMMS = [(90, "bf16", "default"), (90, "bf16", "h100"), (90, "fp16", "default"),
         (120, "bf16", "default")]
CASES = [(cc, elem, table, fmt, gemm) for cc, elem, table in GEMMS
         for fmt in ("nvfp4", "mxfp4") for gemm in ("gate_up", "down")] + \
    [(90, "fp32", "default", "nvfp4", "gate_up"), (90, "fp32", "default", "mxfp4", "down")]
PTX_ELEM = {"bf16": "bf16", "fp16": "f16"}


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"CASES = {CASES!r}\n" + SCRIPT, timeout=900)


@pytest.mark.parametrize("cc,elem,table,fmt,gemm", CASES)
def test_fused_moe_fp4_gemm_compiles(compiled, cc, elem, table, fmt, gemm):
    k = compiled[f"{cc}/{elem}/{table}/{fmt}/{gemm}"]
    ptx = k["ptx"]
    assert_gemm_compiled(k, cc, elem)
    # e4m3 / e8m0 bytes decode with integer arithmetic: no fp8 cvt (SM89+), no minimum SM
    assert "e4m3" not in ptx
    if elem == "fp32":              # IEEE products: FMAs, not tf32 tensor cores
        assert "mma" not in ptx and "fma.rn.f32" in ptx
    else:                           # the dequantized tile is rounded to the activation dtype
        t = PTX_ELEM[elem]
        assert re.search(rf"mma[\w.]*\.f32\.{t}\.{t}\b", ptx), "no mma on 16-bit operands"


# As the JIT specializes a launch at the probe shape (hidden 2048, moe_intermediate 768), the
# gate-up GEMM in the quant method's layout (codes [G, R, C/2] bytes, scale bytes per group,
# NVFP4's [G, 2] global scales), at each entry of the H100 table on SM90 and at the default
# table's largest tile on SM120, with the warps ``_fp4_gemm`` launches.
SPILL_SCRIPT = r"""
from vllm.kernels.triton import fused_moe_fp4 as m
from vllm.kernels.triton.fused_moe_config import load_table
N, K, I = 1536, 2048, 768
for fmt, group in (("nvfp4", 16), ("mxfp4", 32)):
    values = dict(a_ptr="*bf16", q_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", bias_ptr="*bf16",
                  c_ptr="*bf16", w_ptr="*bf16", sorted_ptr="*i64", block_expert_ptr="*i64",
                  num_padded_ptr="*i64", N=N, K=K, P=17, num_m_blocks=9, half_rows=I,
                  stride_am=K, stride_ak=1, stride_qe=N * K // 2, stride_qn=K // 2, stride_qk=1,
                  stride_se=N * K // group, stride_sn=K // group, stride_sk=1, stride_ge=2,
                  stride_gh=1, stride_bias_e=N, stride_cm=N, stride_cn=1)
    h100 = load_table("NVIDIA H100 80GB HBM3")[1]["default"]
    h100 = [(90, i, cfg) for i, (_, cfg) in enumerate(h100)]
    for cc, i, cfg in h100 + [(120, "sm120", load_table("")[1]["default"][-1][1])]:
        consts = dict(E8M0=fmt == "mxfp4", GROUP=group, ROW_DIV=8, MUL_WEIGHT=False,
                      HAS_BIAS=True, PRECISION="tf32", BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_K=max(cfg["BLOCK_K"], group),
                      GROUP_M=cfg["GROUP_M"])
        out[f"{fmt}/{i}"] = compile_like_jit(
            m._moe_fp4_gemm_kernel, values, consts, cc,
            {"num_warps": m.dequant_warps(cfg, gathers=False), "num_stages": cfg["num_stages"]})
"""


@pytest.fixture(scope="module")
def spills():
    return compile_in_subprocess(SPILL_SCRIPT, timeout=900)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_gemm_does_not_spill_at_the_tables_entries(spills, fmt):
    """Compiled as the JIT specializes a launch: no spilled bytes and registers under ptxas's
    255 cap at every entry. Each code byte used to be loaded twice (once per nibble): under
    Triton 3.6 (the GPU machine's) NVFP4 then sat at the cap with 56-144 B of spills at three
    of the four entries. SM120's 64 x 128 tile at 4 warps: 255 registers and 208 B of spills
    (NVFP4, Triton 3.9); at 8, none. Not run: spills are a compile-time fact."""
    got = {k: (v["registers"], v["stack"]) for k, v in spills.items() if k.startswith(fmt)}
    assert len(got) >= 5
    assert all(stack == 0 and regs < 255 for regs, stack in got.values()), got
