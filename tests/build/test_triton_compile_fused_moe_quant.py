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


# As the JIT specializes a launch at the probe shape (hidden 2048, moe_intermediate 768): the
# gate-up GEMM's codes, scales, zeros and g_idx strides of the quant methods' layouts (GPTQ
# group 128; FP8 128x128 blocks), at each entry of the H100 table on SM90 and at the default
# table's largest tile on SM120, with the warps ``_quant_gemm`` launches.
SPILL_SCRIPT = r"""
from vllm.kernels.triton import fused_moe_quant as m
from vllm.kernels.triton.fused_moe_config import load_table
N, K, I = 1536, 2048, 768
base = dict(a_ptr="*bf16", bias_ptr="*bf16", c_ptr="*bf16", w_ptr="*bf16", sorted_ptr="*i64",
            block_expert_ptr="*i64", num_padded_ptr="*i64", N=N, K=K, P=17, num_m_blocks=9,
            half_rows=I, stride_am=K, stride_ak=1, stride_bias_e=N, stride_cm=N, stride_cn=1)
int4 = dict(base, q_ptr="*i32", s_ptr="*fp16", z_ptr="*i32", g_ptr="*i32", rows_per_half=1,
            block_out=1, block_in=128, zero_offset=1, stride_qe=N * K // 8, stride_qn=K // 8,
            stride_qk=1, stride_se=N * 16, stride_sn=16, stride_sk=1, stride_ze=N // 8 * 16,
            stride_zn=16, stride_zk=1, stride_ge=2 * K, stride_gh=K, stride_gk=1)
fp8 = dict(base, q_ptr="*fp8e4nv", s_ptr="*fp32", z_ptr="*i32", g_ptr="*i32", rows_per_half=6,
           block_out=128, block_in=128, zero_offset=0, stride_qe=N * K, stride_qn=K,
           stride_qk=1, stride_se=192, stride_sn=16, stride_sk=1, stride_ze=0, stride_zn=0,
           stride_zk=0, stride_ge=0, stride_gh=0, stride_gk=0)
VARIANTS = [("int4_group_per_tile", int4, True), ("int4_g_idx", int4, False),
            ("fp8_block", fp8, True)]
h100 = load_table("NVIDIA H100 80GB HBM3")[1]["default"]
h100 = [(90, i, cfg) for i, (_, cfg) in enumerate(h100)]
for cc, i, cfg in h100 + [(120, "sm120", load_table("")[1]["default"][-1][1])]:
    for name, values, per_tile in VARIANTS:
        kind = "int4" if values is int4 else "fp8"
        consts = dict(QUANT=m.QUANT_KINDS[kind], ROW_DIV=8, MUL_WEIGHT=False, HAS_BIAS=True,
                      SCALE_PER_TILE=per_tile, PRECISION="tf32", BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"])
        options = {"num_warps": m.dequant_warps(cfg, gathers=not per_tile),
                   "num_stages": cfg["num_stages"]}
        out[f"{name}/{i}"] = compile_like_jit(m._moe_quant_gemm_kernel, values, consts, cc,
                                              options)
"""
STACK_LIMIT = {"int4_group_per_tile": 16, "fp8_block": 0, "int4_g_idx": 32}
"""Spilled bytes per thread allowed. INT4 used to load each code word 8 times (once per
nibble) into a [BLOCK_K, BLOCK_N] tile: under Triton 3.6 (the GPU machine's) 255 registers and
272-656 B of spills per thread at every entry, 124-145 KB of shared memory under 3.9; with
each word loaded once, 0 B under 3.6 and 8 B at one entry under 3.9. Act order's per-element
gathers at 4 warps spilled up to 584 B (3.6) and 96 B (3.9); at 8, at most 8 B on SM90 and 24
B on SM120's 64 x 128 tile (3.6). That tile at 4 warps put INT4 per tile at 255 registers."""
UNDER_THE_CAP = ("int4_group_per_tile", "fp8_block")
"""Variants whose registers stay under ptxas's 255 cap (at the cap it is out of registers)."""


@pytest.fixture(scope="module")
def spills():
    return compile_in_subprocess(SPILL_SCRIPT, timeout=900)


@pytest.mark.parametrize("name", sorted(STACK_LIMIT))
def test_quant_gemm_does_not_spill_at_the_tables_entries(spills, name):
    """Compiled as the JIT specializes a launch (unit strides constant, 16-divisible sizes):
    registers and spilled bytes per thread, read from the cubin, at every H100 table entry
    and SM120's largest tile. Not run: spills are a compile-time fact, their cost on a GPU is
    not measured here."""
    got = {k: (v["registers"], v["stack"]) for k, v in spills.items() if k.startswith(name)}
    assert len(got) >= 5
    assert all(stack <= STACK_LIMIT[name] for _, stack in got.values()), got
    if name in UNDER_THE_CAP:
        assert all(regs < 255 for regs, _ in got.values()), got
