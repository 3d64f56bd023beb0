"""The Triton expert gather (``vllm/kernels/triton/expert_gather.py``) compiles for each CI
architecture (SM90, SM120) without a GPU, for every word a row may move as, and its PTX is what
the module promises: 16-byte vector loads and stores for int64 words (Triton's specialisation of
a row length divisible by 16 words proves the alignment), and 64-bit row offsets (expert id times
words per row). Compiling is not running: the ``gpu`` tests of
tests/kernels/triton/test_triton_expert_gather.py check results on a GPU."""
from __future__ import annotations

import re

import pytest
from triton_compile import compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

# The body of a script run by compile_in_subprocess (tests/triton_compile.py).
SCRIPT = r"""
from vllm.kernels.triton import expert_gather as m

fn = m._expert_gather_kernel
POINTERS = ("src_ptr", "dst_ptr", "experts_ptr", "slots_ptr", "valid_ptr")

def compile_one(word, w_type, w_div16, cc):
    consts = dict(BLOCK=m.BLOCK, ITERS=m.ITERS, FLAGS=m.flags_per_row(63))
    types = {"src_ptr": "*" + word, "dst_ptr": "*" + word, "experts_ptr": "*i64",
             "slots_ptr": "*i64", "valid_ptr": "*u8", "n": "i32", "E": "i32", "N": "i32",
             "W": w_type}
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    aligned = POINTERS + (("W",) if w_div16 else ())
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return compile_kernel(fn, sig, consts, cc, m.LAUNCH_OPTIONS, attrs)

for cc in (90, 120):
    for word in ("i64", "i32", "i16", "u8"):
        out[f"{cc}/{word}/div16"] = compile_one(word, "i32", True, cc)
        out[f"{cc}/{word}/odd"] = compile_one(word, "i32", False, cc)
    out[f"{cc}/i64/wide_rows"] = compile_one("i64", "i64", True, cc)   # W >= 2^31 words
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(SCRIPT)


@pytest.mark.parametrize("cc", [90, 120])
def test_every_variant_compiles_to_a_cubin(compiled, cc):
    mine = {k: v for k, v in compiled.items() if k.startswith(f"{cc}/")}
    assert len(mine) == 9
    for name, k in mine.items():
        assert k["cubin"] > 0, name
        assert f".target sm_{cc}a" in k["ptx"], name


@pytest.mark.parametrize("cc", [90, 120])
def test_int64_words_move_16_bytes_per_access(compiled, cc):
    for name in (f"{cc}/i64/div16", f"{cc}/i64/wide_rows"):
        ptx = compiled[name]["ptx"]
        assert "ld.global.v2.b64" in ptx and "st.global.v2.b64" in ptx, name


@pytest.mark.parametrize("cc", [90, 120])
def test_row_offsets_are_64_bit(compiled, cc):
    """expert id (int64) times words per row: a 64-bit multiply(-add), whatever W's type, and
    no 32-bit one that could wrap."""
    for name, k in compiled.items():
        if name.startswith(f"{cc}/"):
            assert re.search(r"\b(mul|mad)\.lo\.s64\b", k["ptx"]), name
            assert not re.search(r"\b(mul|mad)\.lo\.[su]32\b", k["ptx"]), name


# expert_gather_many's kernel (vllm/kernels/triton/expert_gather_many.py), as the JIT
# specializes a launch of 18 tensors (T = 18), per word type.
MANY_SCRIPT = r"""
import triton.language as tl
from vllm.kernels.triton import expert_gather as g, expert_gather_many as m
values = dict(table_ptr="*i64", experts_ptr="*i64", slots_ptr="*i64", valid_ptr="*u8", n=63, E=64,
              N=16, T=18)
for cc in (90, 120):
    for name, word in (("i64", tl.int64), ("u8", tl.uint8)):
        consts = dict(WORD=word, BLOCK=g.BLOCK, ITERS=g.ITERS, FLAGS=g.flags_per_row(63))
        out[f"{cc}/{name}"] = compile_like_jit(m._expert_gather_many_kernel, values, consts, cc,
                                               g.LAUNCH_OPTIONS)
"""


@pytest.fixture(scope="module")
def many():
    return compile_in_subprocess(MANY_SCRIPT)


@pytest.mark.parametrize("cc", [90, 120])
def test_the_many_kernel_compiles_without_spills(many, cc):
    """Its tensors' addresses come from a device table (int64 cast to pointers): it compiles
    for both targets with 64-bit row offsets and no spilled registers."""
    for word in ("i64", "u8"):
        k = many[f"{cc}/{word}"]
        assert f".target sm_{cc}a" in k["ptx"] and k["stack"] == 0, (word, k["stack"])
        assert re.search(r"\b(mul|mad)\.lo\.s64\b", k["ptx"]), word
