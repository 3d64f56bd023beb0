"""Compiling Triton kernels for the CI architectures without a GPU (tests/build/test_triton_compile*).

Triton's frontend, its LLVM lowering and the ptxas it ships run on any machine, so a kernel can
be compiled for SM90 / SM120 here; compiling is not running (the ``gpu`` tests check results).
Each test module writes a script body that fills ``out`` (name -> ``compile_kernel``'s dict)
using ``triton``, ``GPUTarget`` and ``compile_kernel`` from ``PREAMBLE``; it runs in a fresh
interpreter because the test session sets TRITON_INTERPRET=1 (tests/conftest.py) and kernels
decorated under it cannot be compiled."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PREAMBLE = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget


def compile_kernel(fn, sig, consts, cc, options, attrs=None):
    # sig: arg name -> Triton type ("*fp16", "i32", "constexpr"); consts: constexpr name -> value
    src = triton.compiler.ASTSource(
        fn=fn, signature=sig, attrs=attrs or {},
        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    return {"ptx": k.asm["ptx"], "cubin": len(k.asm["cubin"]), "shared": k.metadata.shared}


def kernel_signature(fn, consts, dtype, scalars, index, f32_ptrs=("sinks_ptr",)):
    # Arg name -> Triton type: constexprs; scalars (name -> type; other stride* are i32);
    # int64 index pointers; float32 pointers; every other pointer of the kernel's dtype.
    def arg_type(a):
        if a in consts:
            return "constexpr"
        if a in scalars or a.startswith("stride"):
            return scalars.get(a, "i32")
        return "*i64" if a in index else "*fp32" if a in f32_ptrs else "*" + dtype
    return {a: arg_type(a) for a in fn.arg_names}


def compile_like_jit(fn, values, consts, cc, options):
    # As Triton's JIT specializes a launch with these argument values: an int equal to 1 becomes
    # a constexpr, a multiple of 16 (and every pointer: "*fp16" etc. in values, assumed
    # 16-byte aligned as torch allocates) gets tt.divisibility 16. Without this, a compile sees
    # no unit stride, vectorizes nothing and spills where the launched kernel would not.
    from triton.backends.compiler import BaseBackend
    from triton._C.libtriton import native_specialize_impl
    sig, constexprs, attrs = {}, {}, {}
    for i, a in enumerate(fn.arg_names):
        v = consts.get(a, values.get(a))
        if a in consts:
            sig[a], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, str):
            sig[a], attrs[(i,)] = v, [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[a] = "fp32"
        else:
            ty, spec = native_specialize_impl(BaseBackend, v, False, True, True)
            sig[a] = ty
            if ty == "constexpr":
                constexprs[(i,)] = spec
            elif "D" in spec:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    return {"ptx": k.asm["ptx"], "shared": k.metadata.shared, **resource_usage(k.asm["cubin"])}


def compile_with_spills(fn, values, consts, cc, options):
    # compile_like_jit's result plus "spills": the bytes of spill stores per thread in ptxas's
    # log (the cubin's stack also holds local arrays, e.g. libdevice's sin/cos reduction). The
    # kernel is compiled even when cached, so that ptxas runs and logs.
    import contextlib, io, re
    knobs = triton.knobs
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    knobs.compilation.always_compile = knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            k = compile_like_jit(fn, values, consts, cc, options)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    stores = re.findall(r"(\d+) bytes spill stores", log.getvalue())
    assert stores, "ptxas logged no spill stores line"
    return dict(k, spills=int(stores[-1]))


def capture_launches(kernels, call):
    # Runs call() with each (module, name) kernel of kernels replaced by a recorder, so that a
    # launcher runs (on "meta" tensors: no data, no device) and its launches are kept, not run.
    # Returns [(name, values, consts, options)] in launch order, as compile_like_jit takes them:
    # a tensor becomes its pointer type ("*bf16"), options are the launch's other keywords.
    from triton.backends.compiler import BaseBackend
    from triton._C.libtriton import native_specialize_impl
    launches, saved = [], {(mod, n): getattr(mod, n) for mod, n in kernels}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, args, kw))
    for mod, n in kernels:
        setattr(mod, n, Recorder(n))
    try:
        call()
    finally:
        for (mod, n), fn in saved.items():
            setattr(mod, n, fn)
    fns, out = {n: fn for (_, n), fn in saved.items()}, []
    for name, args, kw in launches:
        fn = fns[name]
        given = {**dict(zip(fn.arg_names, args)), **kw}
        values, consts = {}, {}
        for p in fn.params:
            v = given.get(p.name, p.default)
            if p.is_constexpr:
                consts[p.name] = v
            else:
                values[p.name] = native_specialize_impl(BaseBackend, v, False, True, True)[0] \
                    if hasattr(v, "data_ptr") else v
        options = {k: v for k, v in kw.items() if k not in fn.arg_names}
        out.append((name, values, consts, options))
    return out


def resource_usage(cubin):
    # Registers and stack bytes (register spills) per thread, from the cubin (Triton's cuobjdump).
    import re, subprocess, tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(m.group(1)), "stack": int(m.group(2))}


out = {}
"""


def compile_in_subprocess(body: str, timeout: int = 600) -> dict:
    """Runs PREAMBLE + ``body`` in a fresh interpreter and returns its ``out`` dict; skips the
    test where Triton's ptxas is missing."""
    script = PREAMBLE + body + "\njson.dump(out, sys.stdout)\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


SHARED_LIMIT = {90: 227 * 1024, 120: 99 * 1024}
"""Shared memory a block may use (opt-in maximum): H100 227 KiB, consumer Blackwell 99 KiB."""


def assert_gemm_compiled(k: dict, cc: int, elem: str) -> None:
    """A ``compile_kernel`` result of a GEMM: a cubin for sm_{cc}a within the target's shared
    memory; 16-bit operands reach the tensor cores (mma)."""
    assert k["cubin"] > 0
    assert f".target sm_{cc}a" in k["ptx"]
    assert 0 < k["shared"] <= SHARED_LIMIT[cc], f"{k['shared']} bytes of shared memory"
    if elem != "fp32":
        assert "mma" in k["ptx"]
