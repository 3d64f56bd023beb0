"""Every CUDA kernel in csrc/ compiles on its own with nvcc for each CI architecture (SM90 H100,
SM120 RTX 50-series), without torch: the .cu files hold plain CUDA/C++ entry points."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CU_SOURCES = sorted((ROOT / "csrc").rglob("*.cu"))
ARCHS = ["sm_90a", "sm_120a"]
NVCC = shutil.which("nvcc")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (CUDA toolkit)")


def test_there_are_kernels_to_check():
    assert CU_SOURCES, "csrc/ holds no .cu file"


def test_cmake_builds_every_kernel():
    """A .cu left out of CMakeLists.txt would compile here but never reach vllm._C."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for src in CU_SOURCES:
        assert str(src.relative_to(ROOT)) in cmake, f"{src} is not in CMakeLists.txt"


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", CU_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nvcc_compiles(tmp_path, src, arch):
    out = tmp_path / (src.stem + ".o")
    proc = subprocess.run([NVCC, "-c", f"-arch={arch}", "-std=c++17", "-O3", "-Werror",
                           "all-warnings", "-I", str(ROOT / "csrc"), str(src), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:                      # the object holds SASS for exactly this architecture
        dump = subprocess.run([cuobjdump, "--list-elf", str(out)], capture_output=True, text=True)
        assert arch in dump.stdout, dump.stdout
