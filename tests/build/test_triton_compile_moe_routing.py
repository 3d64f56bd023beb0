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
        consts = dict(BLOCK_M=block_m, BLOCK_E=block_e,
                      BLOCK_P=max(16, min(128, moe_align.ONE_HOT_ELEMENTS // block_e)),
                      BLOCK_FILL=moe_align.BLOCK_FILL)
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
