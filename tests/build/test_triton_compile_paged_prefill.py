"""The query-tiled prefill kernel (``vllm/kernels/triton/paged_prefill.py``) compiles for SM90 and
SM120 without a GPU at its default tile shapes (``prefill_config``): D = 64, 128 and 256 in
bf16, fp16 and fp32, GQA 1:1, 3:1 (padded rows), 4:1 and 8:1, with and without a sliding window
and sinks, and MLA's one-plane D = 576 (16:1, and 64:1 and 128:1 with the query heads split
over programs) in bf16 / fp16; within the target's shared memory,
16-bit caches on the tensor cores, fp32 ones without TF32. Compiling is not running: nothing
here says the kernel is right or fast on a GPU (tests/kernels/triton/test_triton_paged_prefill.py
checks results under the interpreter).
"""
from __future__ import annotations

import pytest
from triton_compile import SHARED_LIMIT, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

CASES = [(64, 1, 8, "bf16", False), (64, 4, 2, "fp16", True), (64, 8, 1, "fp32", True),
         (128, 8, 1, "bf16", True), (128, 3, 2, "fp16", True), (128, 1, 8, "fp32", False),
         (128, 4, 2, "fp32", True), (256, 4, 2, "bf16", True), (256, 1, 8, "fp16", False),
         (256, 8, 1, "fp32", True), (576, 16, 1, "bf16", True), (576, 16, 1, "fp16", False),
         (576, 128, 1, "bf16", True), (576, 64, 1, "fp16", False), (192, 8, 1, "bf16", True),
         (96, 4, 2, "fp16", False)]
"""(D, GROUP, Hkv, dtype, window and sinks): every D in every dtype, GQA 1:1, 3:1 (rows
padded), 4:1, 8:1, MLA-like 16:1, and DeepSeek-V2's 128:1 and 64:1 at D = 576, whose heads
are split over programs, and D = 192 and 96 in two column tiles (paged_tiles.py); the tile
shapes (hence shared memory) are the defaults."""

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
from vllm.kernels.triton import paged_prefill as pp

SCALARS = {"scale_log2": "fp32", "window": "i32"}
INDEX = {"block_tables_ptr", "seq_lens_ptr", "qsl_ptr", "tile_seq_ptr", "tile_start_ptr"}


def compile_prefill(dtype, cc, d, group, hkv, extras):
    f32 = dtype == "fp32"
    config = pp.prefill_config(d, group, f32, cc)
    consts = pp.prefill_consts(group, hkv, d, 16, tile_m=config["TILE_M"], keys=config["KEYS"],
                               f32_cache=f32, has_window=extras, has_sinks=extras,
                               heads=config["HEADS"], v_is_k=d == 576)
    fn = pp._prefill_kernel
    sig = kernel_signature(fn, consts, dtype, SCALARS, INDEX)
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    return compile_kernel(fn, sig, consts, cc, options)


for cc in (90, 120):
    for d, group, hkv, dtype, extras in CASES:
        out[f"{cc}/{d}/{group}/{dtype}/{extras}"] = compile_prefill(dtype, cc, d, group, hkv,
                                                                     extras)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"CASES = {CASES!r}\n" + SCRIPT)


@pytest.mark.triton
@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("d,group,hkv,dtype,extras", CASES)
def test_paged_prefill_compiles(compiled, cc, d, group, hkv, dtype, extras):
    k = compiled[f"{cc}/{d}/{group}/{dtype}/{extras}"]
    assert k["cubin"] > 0 and f".target sm_{cc}a" in k["ptx"]
    assert 0 < k["shared"] <= SHARED_LIMIT[cc], f"{k['shared']} bytes of shared memory"
    assert "ex2.approx" in k["ptx"]                      # the softmax's exp2
    if dtype != "fp32":
        assert "mma" in k["ptx"]
    else:
        assert "tf32" not in k["ptx"]


# Qwen3-MoE (32 query heads, 4 kv heads, D = 128) and DeepSeek-V2-Lite MLA (16 heads, one
# plane of D = 576), bf16, block_size 16: (Hq, Hkv, D).
SPILL_SHAPES = {"qwen3_moe": (32, 4, 128), "mla576": (16, 1, 576)}

SPILL_SCRIPT = r"""
from vllm.kernels.triton import paged_prefill as pp

out["triton"] = triton.__version__
for (name, (hq, hkv, d)), cc in ((x, cc) for x in SPILL_SHAPES.items() for cc in (90, 120)):
    config = pp.prefill_config(d, hq // hkv, False, cc)
    consts = pp.prefill_consts(hq // hkv, hkv, d, 16, tile_m=config["TILE_M"],
                               keys=config["KEYS"], f32_cache=False, has_window=False,
                               has_sinks=False, heads=config["HEADS"], v_is_k=d == 576)
    # paged_prefill's launch: contiguous q [T, Hq, D], sinks_ptr = q; stride_bt is
    # do_not_specialize (17: neither 1 nor a multiple of 16, a plain i32 as the JIT types it).
    values = dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
                  block_tables_ptr="*i64", seq_lens_ptr="*i64", qsl_ptr="*i64",
                  tile_seq_ptr="*i64", tile_start_ptr="*i64", sinks_ptr="*bf16",
                  scale_log2=0.1, window=0, stride_qt=hq * d, stride_qh=d, stride_bt=17)
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    out[f"{name}/{cc}"] = compile_like_jit(pp._prefill_kernel, values, consts, cc, options)
"""


@pytest.fixture(scope="module")
def spills():
    return compile_in_subprocess(f"SPILL_SHAPES = {SPILL_SHAPES!r}\n" + SPILL_SCRIPT)


# The MLA prefill kernel's registers per thread before the head-dim split (D = 576 padded to
# one 1024-column tile, 16 keys per step), by Triton version and compute capability.
PADDED_MLA_REGISTERS = {"3.6": {90: 195, 120: 198}, "3.9": {90: 166, 120: 174}}


@pytest.mark.triton
@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("shape", sorted(SPILL_SHAPES))
def test_paged_prefill_does_not_spill(spills, shape, cc):
    """Compiled as the JIT specializes paged_prefill's launch at the default config: no register
    spills and under ptxas's 255 cap. Measured at SM90: Qwen3-MoE (128 rows x 128 dims, 8 warps)
    227 registers under Triton 3.6 (the GPU machine's), 210 under 3.9. MLA (16 rows, 8 warps,
    one plane loaded once per key tile: V_IS_K) in two column tiles of 512 + 64
    (paged_tiles.py) with 32 keys per step: 141 / 148 registers (SM90 / SM120) under 3.6, 128 /
    138 under 3.9, 56,320 B of shared memory; padded to one tile of 1024 with 16 keys it took
    66,048 B and the registers of PADDED_MLA_REGISTERS, which these bounds exclude."""
    k = spills[f"{shape}/{cc}"]
    assert k["stack"] == 0 and k["registers"] < 255, k["registers"]
    assert 0 < k["shared"] <= SHARED_LIMIT[cc], k["shared"]
    if shape == "mla576":
        assert k["shared"] <= 58 * 1024, k["shared"]
        padded = PADDED_MLA_REGISTERS.get(spills["triton"][:3], {}).get(cc, 255)
        assert k["registers"] < padded, (k["registers"], padded)
