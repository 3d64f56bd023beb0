"""The one-launch ``moe_align_block_size`` kernel (``vllm/kernels/triton/moe_align.py``)
compiles for each CI architecture (SM90, SM120) without a GPU, at the one-hot tiles the wrapper
picks for E = 8 to 512 experts and every block size of the tables, with a barrier between the
fill and the scatter, within the target's shared memory. Compiling is not running: the kernel's
results are checked under the interpreter (tests/kernels/triton/test_moe_align.py) and on a GPU
through the fused-MoE ``gpu`` tests."""
from __future__ import annotations

import pytest
from triton_compile import SHARED_LIMIT, compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

CASES = [(8, 16), (64, 64), (512, 16)]

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
import triton
from vllm.kernels.triton import moe_align as m

fn = m._align_kernel
types = {"ids_ptr": "*i64", "sorted_ptr": "*i64", "block_expert_ptr": "*i64",
         "num_padded_ptr": "*i64", "P": "i32", "E": "i32", "S": "i32"}
for cc in (90, 120):
    for E, block_m in CASES:
        block_e = triton.next_power_of_2(E)
        consts = dict(BLOCK_M=block_m, BLOCK_E=block_e,
                      BLOCK_P=max(16, min(128, m.ONE_HOT_ELEMENTS // block_e)),
                      BLOCK_FILL=m.BLOCK_FILL)
        sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        out[f"{cc}/{E}/{block_m}"] = compile_kernel(fn, sig, consts, cc, {"num_warps": 4})
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"CASES = {CASES!r}\n" + SCRIPT)


@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("E,block_m", CASES)
def test_align_kernel_compiles(compiled, cc, E, block_m):
    k = compiled[f"{cc}/{E}/{block_m}"]
    assert k["cubin"] > 0 and f".target sm_{cc}a" in k["ptx"]
    assert "bar.sync" in k["ptx"]                 # the fill precedes the scatter
    assert k["shared"] <= SHARED_LIMIT[cc]
