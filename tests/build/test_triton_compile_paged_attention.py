"""The Triton paged-attention kernels (``vllm/kernels/triton/paged_attention.py``) compile for
SM90 and SM120 without a GPU, in bf16 and fp16, plain and with a sliding window and sinks,
decode-only and mixed (the per-token reference kernel, ``tiled=False``; the tiled prefill
kernel mixed steps run is test_triton_compile_paged_prefill.py's), and at MLA's one-plane
D = 576: what the interpreter cannot catch (a
non-constexpr global, an op without a lowering, a loop-carried type mismatch). So do the
split-context decode kernels (``paged_decode.py``, also fp32), within the target's shared memory
and on the tensor cores for 16-bit caches. Compiling is not running: results on a GPU are the
``gpu`` test of tests/kernels/triton/test_triton_paged_attention.py.
"""
from __future__ import annotations


import pytest
from triton_compile import SHARED_LIMIT, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
from vllm.kernels.triton import paged_attention as m

SCALARS = {"scale_log2": "fp32", "window": "i32", "B": "i32", "num_slots": "i64"}
INDEX = {"block_tables_ptr", "seq_lens_ptr", "qsl_ptr", "slot_ptr"}


def compile_one(fn, dtype, cc, consts):
    sig = kernel_signature(fn, consts, dtype, SCALARS, INDEX)
    return compile_kernel(fn, sig, consts, cc, {"num_warps": m.NUM_WARPS})


def attention(d, shared, decode_only, window_sinks, bs=16):
    return dict(GROUP=8 if shared else 4, NUM_KV_HEADS=1 if shared else 2, HEAD_DIM=d,
                BLOCK_SIZE=bs, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=m.block_n_for(d),
                BLOCK_B=m.BLOCK_B, DECODE_ONLY=decode_only, HAS_WINDOW=window_sinks,
                HAS_SINKS=window_sinks)


for cc in (90, 120):
    for dtype in ("bf16", "fp16"):
        for variant, consts in (("decode", attention(128, False, True, False)),
                                ("mixed_window_sinks", attention(128, False, False, True)),
                                ("mla576", attention(576, True, True, True))):
            out[f"attn/{cc}/{dtype}/{variant}"] = compile_one(m._paged_attention_kernel, dtype,
                                                              cc, consts)
        for d, has_v in ((128, True), (576, False)):
            consts = dict(NUM_KV_HEADS=2, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
                          HAS_V=has_v)
            out[f"write/{cc}/{dtype}/{d}"] = compile_one(m._write_kv_kernel, dtype, cc, consts)

DECODE_SCALARS = {"scale_log2": "fp32", "window": "i32", "base": "i32", "num_chunks": "i32"}


def compile_decode(fn, dtype, cc, consts, options):
    sig = kernel_signature(fn, consts, dtype, DECODE_SCALARS,
                           ("block_tables_ptr", "seq_lens_ptr"),
                           ("m_ptr", "l_ptr", "acc_ptr", "sinks_ptr"))
    return compile_kernel(fn, sig, consts, cc, options)


from vllm.kernels.triton import paged_decode as pd

for cc in (90, 120):
    for dtype in ("bf16", "fp16", "fp32"):
        for group, hkv, d in ((1, 8, 128), (8, 1, 128), (16, 1, 576), (128, 1, 576)):
            consts = pd.partial_consts(group, hkv, d, 16, pd.decode_block_n(d),
                                       f32_cache=dtype == "fp32", has_window=group == 8,
                                       v_is_k=d == 576)    # MLA's one plane
            launch = pd.decode_launch(d, dtype == "fp32")
            out[f"decode/{cc}/{dtype}/{group}/{d}"] = compile_decode(
                pd._decode_partial_kernel, dtype, cc, consts, launch)
            consts = dict(HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HAS_SINKS=group == 8)
            out[f"reduce/{cc}/{dtype}/{group}/{d}"] = compile_decode(
                pd._decode_reduce_kernel, dtype, cc, consts,
                {"num_warps": launch["num_warps"]})
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(SCRIPT)


@pytest.mark.triton
@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("variant", ["decode", "mixed_window_sinks", "mla576"])
def test_paged_attention_compiles(compiled, cc, dtype, variant):
    k = compiled[f"attn/{cc}/{dtype}/{variant}"]
    assert k["cubin"] > 0
    assert f".target sm_{cc}a" in k["ptx"]
    assert "ex2.approx" in k["ptx"]                      # the softmax's exp2


@pytest.mark.triton
@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [128, 576])
def test_write_kv_cache_compiles(compiled, cc, dtype, d):
    k = compiled[f"write/{cc}/{dtype}/{d}"]
    assert k["cubin"] > 0 and f".target sm_{cc}a" in k["ptx"]


@pytest.mark.triton
@pytest.mark.parametrize("cc,dtype,group,d", [
    (cc, dtype, group, d) for cc in (90, 120) for dtype in ("bf16", "fp16", "fp32")
    for group, d in ((1, 128), (8, 128), (16, 576), (128, 576))])
def test_paged_decode_compiles(compiled, cc, dtype, group, d):
    """The split-context decode kernels (paged_decode.py): GQA 1:1 (16 padded rows) and 8:1 with
    a window and sinks at D = 128, MLA-like 16:1 and DeepSeek-V2's 128:1 (split over 8
    programs of 16 heads) at D = 576, one plane (fp32 too: 74,816 B on SM120, its two column
    tiles); 16-bit caches on the tensor cores, fp32 ones with no TF32."""
    for name in ("decode", "reduce"):
        k = compiled[f"{name}/{cc}/{dtype}/{group}/{d}"]
        assert k["cubin"] > 0 and f".target sm_{cc}a" in k["ptx"]
        assert k["shared"] <= SHARED_LIMIT[cc], f"{name}: {k['shared']} bytes of shared memory"
    ptx = compiled[f"decode/{cc}/{dtype}/{group}/{d}"]["ptx"]
    assert "ex2.approx" in ptx
    if dtype != "fp32":
        assert "mma" in ptx
    else:
        assert "tf32" not in ptx


# Qwen3-MoE (32 query heads, 4 kv heads, D = 128) and DeepSeek-V2-Lite MLA (16 heads, one
# plane of D = 576), bf16, block_size 16: (Hq, Hkv, D).
DECODE_SHAPES = {"qwen3_moe": (32, 4, 128), "mla576": (16, 1, 576)}

SPILL_SCRIPT = r"""
from vllm.kernels.triton import paged_decode as pd

out["triton"] = triton.__version__
for (name, (hq, hkv, d)), cc in ((x, cc) for x in DECODE_SHAPES.items() for cc in (90, 120)):
    launch = pd.decode_launch(d, False)
    consts = pd.partial_consts(hq // hkv, hkv, d, 16, pd.decode_block_n(d), f32_cache=False,
                               has_window=False, v_is_k=d == 576)
    # paged_decode's launch: contiguous q [T, Hq, D]; num_chunks and stride_bt are
    # do_not_specialize (17: neither 1 nor a multiple of 16, a plain i32 as the JIT types them).
    values = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", q_ptr="*bf16",
                  k_cache_ptr="*bf16", v_cache_ptr="*bf16", block_tables_ptr="*i64",
                  seq_lens_ptr="*i64", scale_log2=0.1, window=0, base=pd.MIN_CHUNK,
                  num_chunks=17, stride_qt=hq * d, stride_qh=d, stride_bt=17)
    out[f"partial/{name}/{cc}"] = compile_like_jit(pd._decode_partial_kernel, values, consts,
                                                   cc, launch)
    values = dict(out_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32",
                  sinks_ptr="*fp32", num_chunks=17)
    consts = dict(HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HAS_SINKS=False)
    out[f"reduce/{name}/{cc}"] = compile_like_jit(pd._decode_reduce_kernel, values, consts, cc,
                                                  {"num_warps": launch["num_warps"]})
"""


@pytest.fixture(scope="module")
def decode_spills():
    return compile_in_subprocess(f"DECODE_SHAPES = {DECODE_SHAPES!r}\n" + SPILL_SCRIPT)


# The MLA partial kernel's registers per thread before the head-dim split (D = 576 padded to
# one 1024-column tile), by Triton version and compute capability, as compiled here.
PADDED_MLA_PARTIAL_REGISTERS = {"3.6": {90: 152, 120: 152}, "3.9": {90: 128, 120: 126}}


@pytest.mark.triton
@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("kernel", ["partial", "reduce"])
@pytest.mark.parametrize("shape", sorted(DECODE_SHAPES))
def test_paged_decode_does_not_spill(decode_spills, kernel, shape, cc):
    """Compiled as the JIT specializes paged_decode's launch (decode_launch's warps and stages):
    no register spills and under ptxas's 255 cap. Measured (SM90 / SM120): partial at Qwen3-MoE
    128 / 122 registers under Triton 3.6 (the GPU machine's), 118 / 107 under 3.9; at MLA 128 /
    128 under 3.6, 120 / 120 under 3.9, and 37,632 B of shared memory, since its 576 columns are
    two tiles of 512 + 64 (paged_tiles.py): padded to one tile of 1024 it took 66,176 B and the
    registers of PADDED_MLA_PARTIAL_REGISTERS, which these bounds exclude. Reduce 28 / 32. MLA's
    one plane is loaded once per key tile (V_IS_K)."""
    k = decode_spills[f"{kernel}/{shape}/{cc}"]
    assert k["stack"] == 0 and k["registers"] < 255, k["registers"]
    assert k["shared"] <= SHARED_LIMIT[cc], k["shared"]
    if f"{kernel}/{shape}" == "partial/mla576":
        assert k["shared"] <= 40 * 1024, k["shared"]
        padded = PADDED_MLA_PARTIAL_REGISTERS.get(decode_spills["triton"][:3], {}).get(cc, 255)
        assert k["registers"] < padded, (k["registers"], padded)


# fp32 caches on SM120 around its 99 KiB: (planes, D), fitting and not.
FP32_WIDE = [(1, 768), (1, 1024), (2, 512), (2, 576)]

FP32_SCRIPT = r"""
from vllm.kernels.triton import paged_decode as pd, paged_prefill as pp

DEC = {"scale_log2": "fp32", "window": "i32", "base": "i32", "num_chunks": "i32"}
PRE = {"scale_log2": "fp32", "window": "i32"}
PRE_INDEX = {"block_tables_ptr", "seq_lens_ptr", "qsl_ptr", "tile_seq_ptr", "tile_start_ptr"}
for planes, d in FP32_WIDE:
    vk = planes == 1
    consts = pd.partial_consts(16, 1, d, 16, pd.decode_block_n(d), f32_cache=True,
                               has_window=False, v_is_k=vk)
    sig = kernel_signature(pd._decode_partial_kernel, consts, "fp32", DEC,
                           ("block_tables_ptr", "seq_lens_ptr"),
                           ("m_ptr", "l_ptr", "acc_ptr", "sinks_ptr"))
    dec = compile_kernel(pd._decode_partial_kernel, sig, consts, 120, pd.decode_launch(d, True))
    cfg = pp.prefill_config(d, 16, True, 120)
    consts = pp.prefill_consts(16, 1, d, 16, tile_m=cfg["TILE_M"], keys=cfg["KEYS"],
                               f32_cache=True, has_window=False, has_sinks=False,
                               heads=cfg["HEADS"], v_is_k=vk)
    sig = kernel_signature(pp._prefill_kernel, consts, "fp32", PRE, PRE_INDEX)
    pre = compile_kernel(pp._prefill_kernel, sig, consts, 120,
                         {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    out[f"{planes}/{d}"] = {"decode": dec["shared"], "prefill": pre["shared"]}
"""


@pytest.fixture(scope="module")
def fp32_wide():
    return compile_in_subprocess(f"FP32_WIDE = {FP32_WIDE!r}\n" + FP32_SCRIPT)


@pytest.mark.triton
@pytest.mark.parametrize("planes,d", FP32_WIDE)
def test_sm120_refuses_exactly_the_fp32_caches_whose_tiles_pass_its_shared_memory(
        fp32_wide, planes, d):
    """``shared_memory_refusal`` (the registry's rule on SM120) against the shared memory the
    decode and prefill kernels compile to: refused exactly where one of them passes 99 KiB, and
    ``fp32_tile_bytes`` is the larger one to within 4 KB, never under it."""
    import torch
    from vllm.model_executor.layers.attention.triton_paged import (fp32_tile_bytes,
                                                                   shared_memory_refusal)
    need = max(fp32_wide[f"{planes}/{d}"].values())
    refused = shared_memory_refusal(torch.float32, d, 120, planes) is not None
    assert refused == (need > SHARED_LIMIT[120]), (need, refused)
    assert 0 <= fp32_tile_bytes(d, planes) - need <= 4096, (fp32_tile_bytes(d, planes), need)
