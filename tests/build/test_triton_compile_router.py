"""The Triton softmax top-k router (``vllm/kernels/triton/router.py``) compiles for each CI
architecture (SM90, SM120) without a GPU, for 16-bit and float32 logits and the expert counts
and top-k of the shipped architectures. Compiling is not running: results are checked under the
interpreter, and on CUDA where there is a GPU (tests/kernels/triton/test_triton_router.py)."""
from __future__ import annotations

import pytest
from triton_compile import compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

CASES = [("bf16", 64, 8), ("fp32", 128, 8), ("fp16", 256, 6)]

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
import triton
from vllm.kernels.triton import router as m

fn = m._topk_softmax_kernel
for cc in (90, 120):
    for elem, E, k in CASES:
        consts = dict(K=k, RENORM=True, BLOCK_E=triton.next_power_of_2(E),
                      BLOCK_K=triton.next_power_of_2(k))
        types = {"logits_ptr": "*" + elem, "weights_ptr": "*fp32", "ids_ptr": "*i64",
                 "E": "i32", "stride_t": "i32"}
        sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        out[f"{cc}/{elem}/{E}/{k}"] = compile_kernel(fn, sig, consts, cc, {"num_warps": 4})
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"CASES = {CASES!r}\n" + SCRIPT)


@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("elem,E,k", CASES)
def test_router_kernel_compiles(compiled, cc, elem, E, k):
    got = compiled[f"{cc}/{elem}/{E}/{k}"]
    assert got["cubin"] > 0 and f".target sm_{cc}a" in got["ptx"]
