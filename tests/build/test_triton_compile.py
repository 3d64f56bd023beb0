"""The Triton kernels compile for each CI architecture (SM90, SM120) without a GPU: Triton's
frontend, its LLVM lowering and the ptxas it ships run on any machine. This catches what the
interpreter cannot (a non-constexpr global, an op without a lowering), and checks the float64
arithmetic the bit-exactness rests on: no FMA contraction, IEEE round-to-nearest division.
Compiling is not running: the kernels' results are checked on a GPU by the ``gpu`` tests."""
from __future__ import annotations

import pytest
from triton_compile import compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
from vllm.kernels.triton import residency_step as m

fn = m._residency_step_kernel
types = {"P": "i32", "K": "i32", "E": "i32", "N": "i32", "w": "i32", "D": "i32",
         "crf_ptr": "*fp64", "wt_ptr": "*fp64", "b_ptr": "*fp64", "prev_ptr": "*u8",
         "par_ptr": "*fp64", "pow_ptr": "*fp64", "pv_ptr": "*u8", "ks_ptr": "*fp64"}
for cc in (90, 120):
    for policy in range(5):
        consts = dict(POLICY=policy, HAS_ROWS=True, FIRST_WAVE=True, BLOCK_E=64, BLOCK_N=64,
                      BLOCK_P=m.BLOCK_P, ROW_BLOCK=m.ROW_BLOCK, ROWS_E=m.rows_e(64))
        sig = {a: "constexpr" if a in consts else types.get(a, "*i64") for a in fn.arg_names}
        out[f"{cc}/{policy}"] = compile_kernel(fn, sig, consts, cc, m.LAUNCH_OPTIONS)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(SCRIPT)


@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("policy", [0, 1, 2, 3, 4])
def test_residency_step_compiles_without_contraction(compiled, cc, policy):
    k = compiled[f"{cc}/{policy}"]
    ptx = k["ptx"]
    assert k["cubin"] > 0
    assert f".target sm_{cc}a" in ptx
    # crf * p * w1 + r * w0; lrfu_next's lrfu + p * next_weight and err * lr / norm * 2**32
    assert "fma.rn.f64" not in ptx and "fma.rz.f64" not in ptx
    assert "rcp.approx" not in ptx and "div.approx" not in ptx
    if policy >= 2:                                 # lfru, lrfu and lrfu_next divide
        assert "div.rn.f64" in ptx
    if policy == 4:     # round half to even as (x +- 2**52) -+ 2**52: not folded away
        assert "0d4330000000000000" in ptx and "cvt.rni" not in ptx
