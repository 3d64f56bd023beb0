"""The Triton quantized fused-MoE GEMM (``vllm/kernels/triton/fused_moe_quant.py``) compiles for
SM90 and SM120 without a GPU, in bf16 and fp16 activations (fp32 with IEEE products on SM90):
FP8 e4m3 codes with float32 scales (one scale column per K tile, and scales gathered per
element) and GPTQ INT4 words with float16 scales, int32 zero points and g_idx (gathered per
element, and one group per K tile), at the largest
block sizes of the shipped tables (the default table on both, the H100 table on SM90), within
each target's shared memory per block. What the interpreter cannot check: lowering, e4m3 ->
f32 conversion, shared memory, tl.dot on 16-bit operands. Compiling is not running: results
are checked by the ``gpu`` tests."""
from __future__ import annotations

import pytest
from triton_compile import assert_gemm_compiled, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
from vllm.kernels.triton import fused_moe_quant as m
from vllm.kernels.triton.fused_moe_config import load_table

I64 = {"sorted_ptr", "block_expert_ptr", "num_padded_ptr"}
CODES = {"fp8": "*fp8e4nv", "int4": "*i32"}
SCALES = {"fp8": "*fp32", "int4": "*fp16"}
fn = m._moe_quant_gemm_kernel

def compile_(cc, elem, kind, consts, warps, stages):
    def ty(a):
        if a in consts: return "constexpr"
        if not a.endswith("_ptr"): return "i32"
        if a in I64: return "*i64"
        if a == "q_ptr": return CODES[kind]
        if a == "s_ptr": return SCALES[kind]
        return "*i32" if a in ("z_ptr", "g_ptr") else "*" + elem
    sig = {a: ty(a) for a in fn.arg_names}
    return compile_kernel(fn, sig, consts, cc, {"num_warps": warps, "num_stages": stages})

tables = {"default": "", "h100": "NVIDIA H100 80GB HBM3"}
largest = {t: load_table(d)[1]["default"][-1][1] for t, d in tables.items()}
# (kind, name, ROW_DIV, MUL_WEIGHT, HAS_BIAS, SCALE_PER_TILE)
VARIANTS = [("fp8", "gate_up_tile_scale", 8, False, True, True),
            ("fp8", "down_gathered_scale", 1, True, False, False),
            ("int4", "gate_up", 8, False, True, False), ("int4", "down", 1, True, False, False),
            ("int4", "down_group_per_tile", 1, True, False, True)]
for cc, elem, table in GEMMS:
    cfg = largest[table]
    bk = cfg["BLOCK_K"] if elem != "fp32" else cfg["BLOCK_K"] // 2     # as fused_moe_quant
    for kind, name, div, weight, bias, per_tile in VARIANTS:
        consts = dict(QUANT=m.QUANT_KINDS[kind], ROW_DIV=div, MUL_WEIGHT=weight,
                      HAS_BIAS=bias, SCALE_PER_TILE=per_tile,
                      PRECISION="ieee" if elem == "fp32" else "tf32", BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"])
        out[f"{cc}/{elem}/{table}/{kind}/{name}"] = compile_(
            cc, elem, kind, consts, cfg["num_warps"], cfg["num_stages"])
"""
GEMMS = [(90, e, t) for e in ("bf16", "fp16") for t in ("default", "h100")] + \
    [(90, "fp32", "default")] + [(120, e, "default") for e in ("bf16", "fp16")]
NAMES = ("fp8/gate_up_tile_scale", "fp8/down_gathered_scale", "int4/gate_up", "int4/down",
         "int4/down_group_per_tile")

@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"GEMMS = {GEMMS!r}\n" + SCRIPT, timeout=900)


@pytest.mark.parametrize("cc,elem,table", GEMMS)
@pytest.mark.parametrize("name", NAMES)
def test_fused_moe_quant_gemm_compiles(compiled, cc, elem, table, name):
    k = compiled[f"{cc}/{elem}/{table}/{name}"]
    assert_gemm_compiled(k, cc, elem)
    if name.startswith("fp8"):      # e4m3 codes widen in registers (cvt from e4m3x2)
        assert "e4m3" in k["ptx"]
