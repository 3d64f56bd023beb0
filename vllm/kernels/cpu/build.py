"""Compile the C kernels in this folder into one shared library on first use, and load it.

Why C through ctypes and not a torch C++ extension: the sources include no torch headers, so a
build takes about a second and needs only a C compiler (a one-function torch C++ extension built
with ``torch.utils.cpp_extension.load_inline`` took 36 s on the 2-core dev machine).
The library is built for this machine (``-march=native``) into
``$VLLM_CACHE_ROOT/cpu_kernels/<key>/`` (default ``~/.cache/vllm``), keyed by the sources, the
flags, the compiler and the CPU, so a changed source or a different machine rebuilds.
Linked with ``-fopenmp``, it uses the OpenMP runtime torch has already loaded (same soname), so
``torch.set_num_threads`` governs its threads too.

``-ffp-contract=off``: the compiler never fuses a * b + c on its own (whether it would depends on
its tuning for the CPU); the sources write every fma they want (vec.h), so the bits do not
depend on -march/-mtune.
``VLLM_CPU_KERNEL_CFLAGS`` adds compiler flags (part of the cache key), for example
``-mno-avx512bf16`` to build the portable bf16 chain on a machine that has the instruction.
``VLLM_CPU_KERNELS=0`` disables the kernels; without a compiler, or when the build fails, callers
get ``None`` and fall back to torch (with one warning naming the reason).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from vllm.logger import init_logger

logger = init_logger(__name__)

_SRC_DIR = Path(__file__).parent
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared",
          "-std=gnu11"]
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# Exported functions -> ctypes argument types (restype is int: 0 = ok). Public: the step
# profiler (benchmarks/profile_decode_step.py) times each of these.
SIGNATURES = {
    "moe_expert_pairs": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT,
                         _INT, _PTR, _PTR, ctypes.c_float, ctypes.c_float],
    "moe_expert_pairs_quant": [_PTR] * 12 + [_I64] * 5 + [_INT, _INT, _PTR, _PTR,
                                                        ctypes.c_float, ctypes.c_float, _INT,
                                                        _I64, _I64, _I64],
    "pack_block_width": [],
    "rms_norm": [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _INT],
    "rope_cos_sin": [_PTR, _PTR, ctypes.c_float, _I64, _I64, _PTR],
    "rotary_embedding": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT],
    "dense_linear": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT],
    "paged_attention": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                        _I64, _I64, ctypes.c_float, _INT, _PTR, _I64, _INT],
    "write_kv_cache": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "argmax_rows": [_PTR, _I64, _I64, _PTR],
    "topk_softmax": [_PTR, _I64, _I64, _I64, _INT, _INT, _PTR, _PTR],
    "moe_sum": [_PTR, _PTR, _I64, _I64, _I64, _INT],
    "silu_and_mul": [_PTR, _PTR, _PTR, _I64, _I64, _INT],
    "sigmoid_gate_add": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _INT],
    "moe_residency_step": [_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR,
                           _INT, *[_PTR] * 8, _I64, _PTR, _PTR, _PTR, _PTR, _I64],
    "moe_cache_scores": [_INT, _I64, _I64, *[_PTR] * 8, _I64, _PTR],
    "expert_copy": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "run_graph": [_PTR, _I64, _PTR],
    "qgemv": [_INT, _PTR, _PTR, _INT, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
              *[_I64] * 6, _INT],
    "qgemv_bf16_chain": [],
    "gemv16": [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "exp12_encode": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR],
    "exp12_decode": [*[_PTR] * 5, _I64, _I64, _PTR],
    "gemv16_exp12": [*[_PTR] * 5, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
}


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _cache_root() -> Path:
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(Path.home(), ".cache", "vllm")
    return Path(root) / "cpu_kernels"


def _build(cc: str, flags: list[str], sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, *map(str, sources), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> ctypes.CDLL | None:
    """The kernel library, or None when disabled or unavailable (reason logged once)."""
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        logger.warning("CPU kernels unavailable: no C compiler (set CC); using torch ops")
        return None
    sources = sorted(_SRC_DIR.glob("*.c"))
    headers = sorted(_SRC_DIR.glob("*.h"))
    flags = [*_FLAGS, *os.environ.get("VLLM_CPU_KERNEL_CFLAGS", "").split()]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
        key = hashlib.sha256("\0".join(
            [*(p.read_text() for p in sources + headers), *flags, version, _cpu_id()]).encode())
        target = _cache_root() / key.hexdigest()[:20] / "libvllm_cpu.so"
        if not target.exists():
            _build(cc, flags, sources, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable (%s); using torch ops", e)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.graph_op_names.argtypes, lib.graph_op_names.restype = [], ctypes.c_char_p
    return lib
