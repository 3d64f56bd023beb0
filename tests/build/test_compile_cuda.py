"""Every CUDA kernel in csrc/ compiles on its own with nvcc for each CI architecture it is built
for (SM90 H100, SM120 RTX 50-series), without torch: the .cu files hold plain CUDA/C++ entry
points. Kernels on CUTLASS get its headers from the nvidia-cutlass package, as CMakeLists.txt
does, and skip without it."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CU_SOURCES = sorted((ROOT / "csrc").rglob("*.cu"))
ARCHS = ["sm_90a", "sm_120a"]
NVCC = shutil.which("nvcc")
CUTLASS_SOURCES = {"csrc/moe/w4a16_moe_mm.cu": ["sm_90a"]}
"""Sources on CUTLASS -> the architectures CMakeLists.txt builds them for (the SM90 GMMA
collective: 9.0a only)."""

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (CUDA toolkit)")


def cutlass_include_dirs() -> list[Path] | None:
    """CUTLASS's include/ and tools/util/include from nvidia-cutlass, or None."""
    try:
        import cutlass_library
    except ImportError:
        return None
    src = Path(cutlass_library.__file__).parent / "source"
    return [src / "include", src / "tools" / "util" / "include"]


def _cases():
    for src in CU_SOURCES:
        rel = str(src.relative_to(ROOT))
        for arch in CUTLASS_SOURCES.get(rel, ARCHS):
            yield pytest.param(src, arch, id=f"{rel}-{arch}")


def test_there_are_kernels_to_check():
    assert CU_SOURCES, "csrc/ holds no .cu file"


def test_cmake_builds_every_kernel():
    """A .cu left out of CMakeLists.txt would compile here but never reach vllm._C."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for src in CU_SOURCES:
        assert str(src.relative_to(ROOT)) in cmake, f"{src} is not in CMakeLists.txt"


@needs_nvcc
@pytest.mark.parametrize("src, arch", list(_cases()))
def test_nvcc_compiles(tmp_path, src, arch):
    flags = ["-I", str(ROOT / "csrc")]
    if str(src.relative_to(ROOT)) in CUTLASS_SOURCES:
        dirs = cutlass_include_dirs()
        if dirs is None:
            pytest.skip("nvidia-cutlass is not installed (CUTLASS headers)")
        # As CMakeLists.txt builds it: NDEBUG keeps CuTe's device asserts out of the pipeline.
        flags += ["--expt-relaxed-constexpr", "-DNDEBUG"] + [f"-I{d}" for d in dirs]
    out = tmp_path / (src.stem + ".o")
    proc = subprocess.run([NVCC, "-c", f"-arch={arch}", "-std=c++17", "-O3", "-Werror",
                           "all-warnings", *flags, str(src), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # ptxas reports serialized wgmma as info, not a warning: a kernel must not have it.
    assert "C7510" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert out.stat().st_size > 0
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:                      # the object holds SASS for exactly this architecture
        dump = subprocess.run([cuobjdump, "--list-elf", str(out)], capture_output=True, text=True)
        assert arch in dump.stdout, dump.stdout
