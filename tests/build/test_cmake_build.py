"""CMakeLists.txt builds vllm._C (the CUDA kernels plus the torch binding) against the installed
torch, and loading it registers the ops under torch.ops._C. The binding uses only
device-generic torch headers, so this runs even where torch is a CPU build; the ops can only be
called on a GPU (tests/kernels/cuda)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None,
                                reason="needs nvcc and cmake")


def _cmake(build: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build),
                           f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}", *args],
                          capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    build = tmp_path_factory.mktemp("cmake")
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": ""}
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = _cmake(build, *gen, env=env)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    proc = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build, configure.stdout


def test_default_archs_are_sm90a_and_sm120a(built):
    _, log = built
    assert "CUDA architectures: 90a;120a" in log


def test_torch_cuda_arch_list_overrides(tmp_path):
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0a"}
    proc = _cmake(tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA architectures: 90a\n" in proc.stdout


def test_cpu_target_builds_nothing(tmp_path):
    proc = _cmake(tmp_path, "-DVLLM_TARGET_DEVICE=cpu")
    assert proc.returncode == 0, proc.stderr
    assert "VLLM_TARGET_DEVICE=cpu: nothing to build" in proc.stdout
    assert "CUDA architectures" not in proc.stdout


def test_module_registers_the_ops(built):
    build, _ = built
    [lib] = build.glob("_C*.so")
    code = ("import torch, sys; torch.ops.load_library(sys.argv[1]); "
            "print(torch.ops._C.expert_gather.default._schema); "
            "print(torch.ops._C.expert_gather_many.default._schema)")
    proc = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "_C::expert_gather(Tensor src, Tensor(a!) dst, Tensor experts, Tensor slots, "
        "Tensor valid) -> ()",
        "_C::expert_gather_many(Tensor[] srcs, Tensor(a!)[] dsts, Tensor experts, Tensor slots, "
        "Tensor valid) -> ()"]


def test_module_imports_as_vllm_C(built, tmp_path):
    """`import vllm._C` (what kernels/cuda/ops.py does) finds the module's init function."""
    build, _ = built
    [lib] = build.glob("_C*.so")
    pkg = tmp_path / "pkg" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    shutil.copy(lib, pkg / lib.name)
    code = "import torch, vllm._C; print(hasattr(torch.ops._C, 'expert_gather'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path / "pkg", env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_w4a16_moe_mm_is_built_with_cutlass(built):
    """With nvidia-cutlass installed, the CUTLASS W4A16 grouped GEMM is compiled (9.0a) and its
    two ops registered; without it, the build says so and leaves them out."""
    build, log = built
    try:
        import cutlass_library  # noqa: F401
    except ImportError:
        assert "W4A16 grouped GEMM (CUTLASS, SM90): not built" in log
        return
    assert "W4A16 grouped GEMM (CUTLASS, SM90): built" in log
    [lib] = build.glob("_C*.so")
    code = ("import torch, sys; torch.ops.load_library(sys.argv[1]); "
            "print(torch.ops._C.w4a16_moe_mm.default._schema); "
            "print(torch.ops._C.w4a16_moe_mm_workspace_size.default._schema)")
    proc = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "_C::w4a16_moe_mm(Tensor a, Tensor w, Tensor scales, Tensor(a!) d, "
        "Tensor expert_offsets, int group_size, Tensor(b!) workspace) -> ()",
        "_C::w4a16_moe_mm_workspace_size(int num_groups, int device) -> int"]


def test_empty_pinned_is_registered_and_fails_cleanly_without_a_gpu(built):
    """The exact-size pinned allocator: its schema, a zero-size tensor needs no CUDA call, and on
    a machine without a GPU the allocation returns status 2 (a CUDA error, not 1, out of memory,
    which would let the expert store fall back quietly) and an empty tensor, twice in a row,
    without raising; the C++ size check still raises (the Python wrapper checks first)."""
    build, _ = built
    [lib] = build.glob("_C*.so")
    code = """if True:
        import torch, sys
        torch.ops.load_library(sys.argv[1])
        print(torch.ops._C.try_empty_pinned.default._schema)
        print(torch.ops._C.cuda_error_string.default._schema)
        t, status, error = torch.ops._C.try_empty_pinned([0, 3], torch.bfloat16)
        print(tuple(t.shape), t.dtype, t.device, status, error)
        for _ in range(2):
            t, status, error = torch.ops._C.try_empty_pinned([5, 7], torch.float32)
            print(tuple(t.shape), status, error > 0, torch.ops._C.cuda_error_string(error))
        try:
            torch.ops._C.try_empty_pinned([-1], torch.float32)
        except RuntimeError as e:
            print(str(e).splitlines()[0])
    """
    proc = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == ("_C::try_empty_pinned(int[] size, ScalarType dtype) -> "
                        "(Tensor, int, int)")
    assert lines[1] == "_C::cuda_error_string(int code) -> str"
    assert lines[2] == "(0, 3) torch.bfloat16 cpu 0 0"
    if shutil.which("nvidia-smi") is None:
        for line in lines[3:5]:
            assert line.startswith("(0,) 2 True ") and len(line) > len("(0,) 2 True ")
    assert lines[5] == "empty_pinned: sizes must be non-negative, got [-1]"
