"""Build: the Python package, plus ``vllm._C`` (the CUDA ops in csrc/, via CMakeLists.txt) when
the target device is CUDA.

VLLM_TARGET_DEVICE=cpu|cuda picks the target; unset, it is "cuda" when nvcc and a CUDA build of
torch are both present, else "cpu". A CPU install compiles nothing here (the C kernels of
vllm/kernels/cpu are built on first use), so `pip install -e .` stays fast and needs no nvcc.
A CUDA build needs the torch it will run with at build time:
    VLLM_TARGET_DEVICE=cuda pip install --no-build-isolation -e .
TORCH_CUDA_ARCH_LIST overrides the architectures (default "9.0a;12.0a": H100/H200 and
RTX 50-series); MAX_JOBS bounds the parallel compile jobs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
TARGET_DEVICES = ("cpu", "cuda")


def _torch_cuda_version() -> str | None:
    """torch.version.cuda of the torch importable here, or None (CPU build, or no torch: pip's
    isolated build environment has none unless --no-build-isolation)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def target_device(env: dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    device = env.get("VLLM_TARGET_DEVICE", "").strip().lower()
    if device:
        if device not in TARGET_DEVICES:
            raise SystemExit(f"VLLM_TARGET_DEVICE={device!r} is invalid: must be one of "
                             f"{list(TARGET_DEVICES)}")
        return device
    has_nvcc = shutil.which("nvcc") is not None or Path(env.get("CUDA_HOME", "/nonexistent"),
                                                         "bin", "nvcc").exists()
    return "cuda" if has_nvcc and _torch_cuda_version() is not None else "cpu"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures and builds CMakeLists.txt, then puts the module where Python imports it."""

    def build_extension(self, ext: Extension) -> None:
        if _torch_cuda_version() is None:
            raise SystemExit("VLLM_TARGET_DEVICE=cuda needs a CUDA build of torch importable at "
                             "build time: install it first, then "
                             "`pip install --no-build-isolation -e .`")
        if shutil.which("cmake") is None:
            raise SystemExit("VLLM_TARGET_DEVICE=cuda needs cmake (pip install cmake ninja)")
        # Not self.build_temp: an editable install gets a fresh temporary one every time, so
        # each install would rebuild everything (the CUTLASS GEMM alone takes about a minute).
        build_dir = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        args = ["-DVLLM_TARGET_DEVICE=cuda", f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}",
                f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}", "-DCMAKE_BUILD_TYPE=Release"]
        if shutil.which("ninja"):
            args.append("-GNinja")
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args])
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])


if __name__ == "__main__":
    device = target_device()
    print(f"vllm: building for VLLM_TARGET_DEVICE={device}", file=sys.stderr)
    setup(ext_modules=[CMakeExtension("vllm._C")] if device == "cuda" else [],
          cmdclass={"build_ext": CMakeBuild})
