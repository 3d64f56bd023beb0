"""The Triton kernels between the router logits and the expert GEMMs compile for each CI
architecture (SM90, SM120) without a GPU: the softmax top-k router (``kernels/triton/router.py``;
16-bit and float32 logits, the expert counts and top-k of the shipped architectures) and the
one-launch ``moe_align_block_size`` (``kernels/triton/moe_align.py``; the one-hot tiles the
wrapper picks for E = 8 to 512 and the tables' block sizes, with a barrier between its fill and
its scatter, within the target's shared memory). Compiling is not running: results are checked
under the interpreter (tests/kernels/triton/test_triton_router.py, test_moe_align.py) and on a
GPU through the ``gpu`` tests."""
from __future__ import annotations

import pytest
from triton_compile import SHARED_LIMIT, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

ROUTER = [("bf16", 64, 8), ("fp32", 128, 8), ("fp16", 256, 6)]
ALIGN = [(8, 16), (64, 64), (512, 16)]

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
    for E, block_m in ALIGN:
        types = {"ids_ptr": "*i64", "sorted_ptr": "*i64", "block_expert_ptr": "*i64",
                 "num_padded_ptr": "*i64", "P": "i32", "E": "i32", "S": "i32"}
        block_e = triton.next_power_of_2(E)
        block_p, block_fill = moe_align.launch_blocks(block_e)
        consts = dict(BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p, BLOCK_FILL=block_fill)
        out[f"align/{cc}/{E}/{block_m}"] = compile_one(moe_align._align_kernel, types, consts,
                                                       cc)
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
@pytest.mark.parametrize("E,block_m", ALIGN)
def test_align_kernel_compiles(compiled, cc, E, block_m):
    got = compiled[f"align/{cc}/{E}/{block_m}"]
    assert got["cubin"] > 0 and f".target sm_{cc}a" in got["ptx"]
    assert "bar.sync" in got["ptx"]                 # the fill precedes the scatter
    assert got["shared"] <= SHARED_LIMIT[cc]


# As the JIT specializes a decode launch (BLOCK_M 16, the H100 table's entry for <= 32 tokens):
# E = 64 (Qwen3-MoE, DeepSeek-V2-Lite; 8 or 6 pairs at batch 1, 256 or 192 at 32 tokens, the
# same specialization: P is no multiple of 16, S is) and E = 256 (DeepSeek-V3 class) at 32
# tokens top-8, with the wrapper's blocks.
SPILL_SCRIPT = r"""
import triton
from vllm.kernels.triton import moe_align as m
for E, P in ((64, 8), (64, 256), (256, 256)):
    S = m.padded_size(P, E, 16)
    block_p, block_fill = m.launch_blocks(triton.next_power_of_2(E))
    values = dict(ids_ptr="*i64", sorted_ptr="*i64", block_expert_ptr="*i64",
                  num_padded_ptr="*i64", P=P, E=E, S=S)
    consts = dict(BLOCK_M=16, BLOCK_E=triton.next_power_of_2(E), BLOCK_P=block_p,
                  BLOCK_FILL=block_fill)
    out[f"{E}/{P}"] = compile_like_jit(m._align_kernel, values, consts, 90, {})
"""


@pytest.fixture(scope="module")
def align_spills():
    return compile_in_subprocess(SPILL_SCRIPT)


@pytest.mark.parametrize("E,P", [(64, 8), (64, 256), (256, 256)])
def test_align_kernel_does_not_spill_at_decode_launches(align_spills, E, P):
    """SM90, compiled as the JIT specializes the launch: no spilled bytes. With 8192-element
    int64 tiles ([128, 128] ranks at E = 64, [256, BLOCK_E] block owners) it sat at 255
    registers with 576 (E = 64) and 2240 (E = 256) bytes of spills per thread under Triton 3.6
    (the GPU machine's). Not run: spills are a compile-time fact."""
    k = align_spills[f"{E}/{P}"]
    assert k["stack"] == 0 and k["registers"] < 255, (k["registers"], k["stack"])
