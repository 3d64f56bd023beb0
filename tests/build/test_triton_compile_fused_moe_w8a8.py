"""The Triton W8A8 fused-MoE kernels (``vllm/kernels/triton/fused_moe_w8a8.py``) compile for
SM90 and SM120 without a GPU, as the JIT specializes a launch at the probe shape (hidden 2048,
moe_intermediate 768, FP8 128 x 128 blocks or per-channel scales), at every entry of the H100
table on SM90 and the default table's largest tile on SM120: both operands of the dot reach
the matrix units as e4m3 (``wgmma ... e4m3.e4m3`` on SM90 for tiles of 64 rows or more,
``mma ... e4m3.e4m3`` on SM120; SM90's smaller tiles widen them exactly to f16 for an f16 MMA),
within shared memory, without spills; and the activation quantizers (``quantize_rows``, and
the activation fused with it) convert with the hardware's rounding cast (``cvt.rn.satfinite``).
What the interpreter cannot check: lowering, the e4m3 MMA, registers. Compiling is not
running: results are checked by the ``gpu`` tests."""
from __future__ import annotations

import pytest
from triton_compile import SHARED_LIMIT, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

SCRIPT = r"""
from vllm.kernels.triton import fused_moe_w8a8 as m
from vllm.kernels.triton.fused_moe_config import load_table
N, K, I = 1536, 2048, 768
base = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", q_ptr="*fp8e4nv", s_ptr="*fp32",
            bias_ptr="*bf16", c_ptr="*bf16", w_ptr="*bf16", sorted_ptr="*i64",
            block_expert_ptr="*i64", num_padded_ptr="*i64", N=N, K=K, P=17, num_m_blocks=9,
            half_rows=I, stride_am=K, stride_qe=N * K, stride_qn=K, stride_qk=1,
            stride_bias_e=N, stride_cm=N, stride_cn=1)
block = dict(base, rows_per_half=6, block_out=128, block_in=128, a_width=128,
             stride_asm=16, stride_se=192, stride_sn=16, stride_sk=1)
channel = dict(base, rows_per_half=1, block_out=1, block_in=K, a_width=K, stride_asm=1,
               stride_se=N, stride_sn=1, stride_sk=1)
VARIANTS = [("block_group", block, True), ("channel_token", channel, False)]
h100 = [(90, i, cfg) for i, (_, cfg) in enumerate(load_table("NVIDIA H100 80GB HBM3")[1]
                                                    ["default"])]
for cc, i, table_cfg in h100 + [(120, "sm120", load_table("")[1]["default"][-1][1])]:
    for name, values, per_tile in VARIANTS:
        cfg = m.w8a8_config(table_cfg, per_tile)
        consts = dict(ROW_DIV=8, MUL_WEIGHT=False, HAS_BIAS=True, SCALE_EACH_TILE=per_tile,
                      BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      BLOCK_K=max(cfg["BLOCK_K"], m.MIN_BLOCK_K), GROUP_M=cfg["GROUP_M"])
        k = compile_like_jit(m._moe_w8a8_gemm_kernel, values, consts, cc,
                             {"num_warps": m.w8a8_warps(cfg, per_tile),
                              "num_stages": cfg["num_stages"]})
        out[f"gemm/{name}/{cc}/{i}"] = dict(k, block_m=cfg["BLOCK_M"])
quant = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", static_ptr="*fp32", M=17, K=K,
             width=128, stride_xm=K, stride_qm=K, stride_sm=16)
act = dict(in_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", static_ptr="*fp32",
           sorted_ptr="*i64", num_padded_ptr="*i64", N=I, P=17, width=128, stride_in=2 * I,
           stride_q=I, stride_s=6, alpha=1.702, limit=7.0)
for cc in (90, 120):
    for static in (False, True):
        kind = "static" if static else "dynamic"
        consts = dict(STATIC=static, ROUND_FIRST=False, ROWS=8, BLOCK=128)
        out[f"quant/{kind}/{cc}"] = compile_like_jit(
            m._quant_rows_kernel, quant, consts, cc, {"num_warps": 4, "num_stages": 1})
        for block_m in (16, 64):
            consts = dict(ACT=0, STATIC=static, ROUND_FIRST=False, BLOCK_M=block_m, BLOCK_N=128)
            out[f"act_quant/{kind}/{block_m}/{cc}"] = compile_like_jit(
                m._act_quant_kernel, act, consts, cc, {"num_warps": 4, "num_stages": 1})
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(SCRIPT, timeout=900)


@pytest.mark.parametrize("name", ["block_group", "channel_token"])
def test_w8a8_gemm_multiplies_e4m3_on_the_matrix_units(compiled, name):
    """SM120, and SM90 tiles of 64 rows or more: e4m3 x e4m3 MMAs. SM90's smaller tiles go
    through Triton's MMA v2, which widens e4m3 to f16 pairs (exact) for an f16 MMA."""
    got = {k: v for k, v in compiled.items() if k.startswith(f"gemm/{name}/")}
    assert len(got) >= 5
    for key, k in got.items():
        cc = int(key.split("/")[2])
        assert f".target sm_{cc}a" in k["ptx"] and 0 < k["shared"] <= SHARED_LIMIT[cc], key
        lines = k["ptx"].splitlines()
        if cc == 90 and k["block_m"] < 64:
            mma = [ln for ln in lines if "mma.sync" in ln]
            assert mma and all(".f16.f16." in ln for ln in mma), (key, mma[:1])
            assert any("cvt.rn.f16x2.e4m3x2" in ln for ln in lines), key
        else:
            mma = [ln for ln in lines if ("wgmma.mma_async" if cc == 90 else "mma.sync") in ln]
            assert mma and all("e4m3.e4m3" in ln for ln in mma), (key, mma[:1])
        assert k["stack"] == 0 and k["registers"] <= 255, (key, k["registers"], k["stack"])


@pytest.mark.parametrize("cc", [90, 120])
def test_quantizers_cast_with_the_hardware_rounding(compiled, cc):
    """``quantize_rows`` and the fused activation quantizer (silu, 16 and 64 pair rows); the
    scale and the codes' quotients with IEEE division (``tl.div_rn``): a float32 ``/``
    lowered to ``div.full.f32`` / ``div.approx`` put the H100's scales an ulp off (2026-11-27).
    The activation quantizer keeps silu's ``div.full`` (``fused_moe.act_values``)."""
    keys = [k for k in compiled if k.startswith(("quant/", "act_quant/")) and
            k.endswith(f"/{cc}")]
    assert len(keys) == 6
    for key in keys:
        k = compiled[key]
        assert "cvt.rn.satfinite.e4m3x2.f32" in k["ptx"], key
        assert "div.rn.f32" in k["ptx"] and "div.approx" not in k["ptx"], key
        if key.startswith("quant/"):
            assert "div.full" not in k["ptx"], key
        assert k["stack"] == 0, (key, k["registers"], k["stack"])
