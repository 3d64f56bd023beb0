"""setup.py's choice of target device, and that a CPU install builds no extension."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup_py(monkeypatch):
    spec = importlib.util.spec_from_file_location("vllm_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)          # not __main__: setup() does not run
    return module


@pytest.mark.parametrize("nvcc,cuda,expected", [(True, "13.0", "cuda"), (True, None, "cpu"),
                                                (False, "13.0", "cpu"), (False, None, "cpu")])
def test_default_target(setup_py, monkeypatch, nvcc, cuda, expected):
    monkeypatch.setattr(setup_py.shutil, "which", lambda name: "/x/nvcc" if nvcc else None)
    monkeypatch.setattr(setup_py, "_torch_cuda_version", lambda: cuda)
    assert setup_py.target_device({}) == expected


def test_explicit_target_wins_and_is_checked(setup_py, monkeypatch):
    monkeypatch.setattr(setup_py, "_torch_cuda_version", lambda: None)
    assert setup_py.target_device({"VLLM_TARGET_DEVICE": "cuda"}) == "cuda"
    assert setup_py.target_device({"VLLM_TARGET_DEVICE": "CPU"}) == "cpu"
    with pytest.raises(SystemExit, match=r"VLLM_TARGET_DEVICE='rocm' is invalid: must be one "
                                         r"of \['cpu', 'cuda'\]"):
        setup_py.target_device({"VLLM_TARGET_DEVICE": "rocm"})


def test_cpu_build_has_no_extension(tmp_path):
    """What `pip install -e .` runs on a CPU machine: build_ext with nothing to build."""
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "build_ext",
                           "--build-temp", str(tmp_path / "tmp"), "--build-lib",
                           str(tmp_path / "lib")], capture_output=True, text=True, cwd=ROOT,
                          env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "building for VLLM_TARGET_DEVICE=cpu" in proc.stderr
    assert not list(tmp_path.rglob("*.so"))


def test_cuda_build_without_cuda_torch_says_how(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "setup.py"), "build_ext",
                           "--build-temp", str(tmp_path / "tmp"), "--build-lib",
                           str(tmp_path / "lib")], capture_output=True, text=True, cwd=ROOT,
                          env={"VLLM_TARGET_DEVICE": "cuda", "PATH": "/usr/bin:/bin"})
    try:
        import torch
        if torch.version.cuda is not None:
            pytest.skip("torch here is a CUDA build")
    except ImportError:
        pass
    assert proc.returncode != 0
    assert "needs a CUDA build of torch" in proc.stderr + proc.stdout
