"""The Triton kernels between the router logits and the expert GEMMs compile for each CI
architecture (SM90, SM120) without a GPU: the softmax top-k router (``kernels/triton/router.py``;
16-bit and float32 logits, the expert counts and top-k of the shipped architectures) and the
one-launch ``moe_align_block_size`` (``kernels/triton/moe_align.py``; the blocks and warps the
wrapper picks for E = 8 to its limit of 1024, 8 to 4096 pairs and the tables' block sizes, with
a barrier between its fill and its scatter, within the target's shared memory, and without
spills). Compiling is not running: results are checked under the interpreter
(tests/kernels/triton/test_triton_router.py, test_moe_align.py) and on a GPU through the ``gpu``
tests."""
from __future__ import annotations

import pytest
from triton_compile import SHARED_LIMIT, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

ROUTER = [("bf16", 64, 8), ("fp32", 128, 8), ("fp16", 256, 6)]
ALIGN = [(8, 8, 16), (64, 256, 64), (512, 512, 16), (1024, 64, 128)]     # (E, P, block_m)

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
import triton
from vllm.kernels.triton import moe_align, router

def compile_one(fn, types, consts, cc):
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    return compile_kernel(fn, sig, consts, cc, {"num_warps": 4})

for cc in (90, 120):
    for elem, E, k in ROUTER:
        types = {"logits_ptr": "*" + elem, "weights_ptr": "*fp32", "ids_ptr": "*i64",
                 "E": "i32", "stride_t": "i32"}
        consts = dict(K=k, RENORM=True, BLOCK_E=triton.next_power_of_2(E),
                      BLOCK_K=triton.next_power_of_2(k))
        out[f"router/{cc}/{elem}/{E}/{k}"] = compile_one(router._topk_softmax_kernel, types,
                                                         consts, cc)
    for E, P, block_m in ALIGN:
        types = {"ids_ptr": "*i64", "sorted_ptr": "*i64", "block_expert_ptr": "*i64",
                 "num_padded_ptr": "*i64", "P": "i32", "E": "i32", "S": "i32"}
        block_p, block_e, block_fill, num_warps = moe_align.launch_blocks(P, E)
        consts = dict(BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p, BLOCK_FILL=block_fill)
        fn = moe_align._align_kernel
        sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        out[f"align/{cc}/{E}/{P}/{block_m}"] = compile_kernel(fn, sig, consts, cc,
                                                              {"num_warps": num_warps})
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"ROUTER = {ROUTER!r}\nALIGN = {ALIGN!r}\n" + SCRIPT)


@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("elem,E,k", ROUTER)
def test_router_kernel_compiles(compiled, cc, elem, E, k):
    got = compiled[f"router/{cc}/{elem}/{E}/{k}"]
    assert got["cubin"] > 0 and f".target sm_{cc}a" in got["ptx"]


@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("E,P,block_m", ALIGN)
def test_align_kernel_compiles(compiled, cc, E, P, block_m):
    got = compiled[f"align/{cc}/{E}/{P}/{block_m}"]
    assert got["cubin"] > 0 and f".target sm_{cc}a" in got["ptx"]
    assert "bar.sync" in got["ptx"]                 # the fill precedes the scatter
    assert got["shared"] <= SHARED_LIMIT[cc]


# As the JIT specializes a launch (BLOCK_M 16, the H100 table's entry for <= 32 tokens), with the
# wrapper's blocks and warps: on SM90, E = 64 (Qwen3-MoE, DeepSeek-V2-Lite), 128 and 256
# (DeepSeek-V3 class) at 8 pairs (batch 1, top-8; one warp), 256 (32 tokens; four warps) and
# 4096 (the kernel's limit; sixteen warps), and E = 1024 (its limit); a decode and a limit
# launch on SM120. A 4096-pair compile takes about 10 s here.
SPILLS = [(90, E, P) for E in (64, 128, 256) for P in (8, 256, 4096)] + \
    [(90, 1024, 4096), (120, 64, 256), (120, 256, 4096)]
SPILL_SCRIPT = r"""
from vllm.kernels.triton import moe_align as m
for cc, E, P in SPILLS:
    S = m.padded_size(P, E, 16)
    block_p, block_e, block_fill, num_warps = m.launch_blocks(P, E)
    values = dict(ids_ptr="*i64", sorted_ptr="*i64", block_expert_ptr="*i64",
                  num_padded_ptr="*i64", P=P, E=E, S=S)
    consts = dict(BLOCK_M=16, BLOCK_E=block_e, BLOCK_P=block_p, BLOCK_FILL=block_fill)
    out[f"{cc}/{E}/{P}"] = compile_like_jit(m._align_kernel, values, consts, cc,
                                            {"num_warps": num_warps})
"""


@pytest.fixture(scope="module")
def align_spills():
    return compile_in_subprocess(f"SPILLS = {SPILLS!r}\n" + SPILL_SCRIPT)


@pytest.mark.parametrize("cc,E,P", SPILLS)
def test_align_kernel_does_not_spill(align_spills, cc, E, P):
    """Compiled as the JIT specializes the launch: no stack (spilled registers). The one-hot
    version with 8192-element int64 tiles sat at 255 registers with 576 (E = 64) and 2240
    (E = 256) bytes of spills per thread under Triton 3.6 (the GPU machine's); the sort-based
    one spilled at 4096 pairs on 8 warps (128 registers), hence 16 there. Not run: spills are a
    compile-time fact."""
    k = align_spills[f"{cc}/{E}/{P}"]
    assert k["stack"] == 0 and k["registers"] < 255, (k["registers"], k["stack"])
