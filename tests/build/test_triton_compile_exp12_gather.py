"""The exp12 decode-gather (``vllm/kernels/triton/exp12_gather.py``) compiles for each CI
architecture (SM90, SM120) without a GPU, as the JIT specializes a batch-1 decode launch (8 plan
entries, a probe-shaped w13 of 3,145,728 weights per expert), with no spills, and its row
offsets are 64-bit. Compiling is not running: the ``gpu`` test of
tests/kernels/triton/test_exp12_gather.py checks results on a GPU."""
from __future__ import annotations

import re

import pytest
from triton_compile import compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

SCRIPT = r"""
from vllm.kernels.triton import exp12_gather as m
fn = m._exp12_gather_kernel
values = dict(lo_ptr="*u8", code_ptr="*u8", base_ptr="*u8", idx_ptr="*i32", bits_ptr="*i16",
              dst_ptr="*i16", experts_ptr="*i64", slots_ptr="*i64", valid_ptr="*u8", n=8, E=64,
              N=16, NW=3145728, X=400, CHUNKS=192)
consts = dict(ITERS=m.ITERS, FLAGS=m.flags_per_row(8), ESC_BLOCK=m.ESC_BLOCK)
for cc in (90, 120):
    out[str(cc)] = compile_with_spills(fn, values, consts, cc, m.LAUNCH_OPTIONS)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(SCRIPT)


@pytest.mark.parametrize("cc", ["90", "120"])
def test_compiles_without_spills(compiled, cc):
    k = compiled[cc]
    assert f".target sm_{cc}a" in k["ptx"]
    assert k["spills"] == 0, k


@pytest.mark.parametrize("cc", ["90", "120"])
def test_row_offsets_are_64_bit(compiled, cc):
    assert re.search(r"\b(mul|mad)\.lo\.s64\b", compiled[cc]["ptx"])
