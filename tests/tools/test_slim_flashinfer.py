"""tools/slim_flashinfer.py on a made-up wheel of the same layout: what it keeps (the Python
package, FlashInfer's headers, CCCL, spdlog, the files directly in csrc) and drops (CUTLASS, the
csrc subdirectories), and a RECORD that lists exactly the files kept."""
from __future__ import annotations

import importlib.util
import os
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("slim_flashinfer",
                                              os.path.join(ROOT, "tools", "slim_flashinfer.py"))
slim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slim)

NAME = "flashinfer_python-0.7.2.post1-py3-none-any.whl"
RECORD = "flashinfer_python-0.7.2.post1.dist-info/RECORD"
KEPT = ["flashinfer/__init__.py", "flashinfer/decode.py", "flashinfer/experimental/k.cu",
        "flashinfer/data/build_utils.py", "flashinfer/data/include/flashinfer/page.cuh",
        "flashinfer/data/cccl/libcudacxx/include/cuda/std/x.h", "flashinfer/data/spdlog/s.h",
        "flashinfer/data/csrc/batch_decode.cu", "flashinfer/data/csrc/tvm_ffi_utils.h",
        "flashinfer_python-0.7.2.post1.dist-info/METADATA"]
DROPPED = ["flashinfer/data/cutlass/include/cutlass/cutlass.h",
           "flashinfer/data/csrc/fused_moe/cutlass_backend/binding.cu",
           "flashinfer/data/csrc/nv_internal/cpp/common/logger.cpp"]


@pytest.fixture
def wheel(tmp_path):
    path = tmp_path / "in" / NAME
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as z:
        for name in KEPT + DROPPED:
            z.writestr(name, f"contents of {name}")
        z.writestr(RECORD, "".join(f"{n},sha256=x,{len(n)}\n" for n in KEPT + DROPPED)
                   + f"{RECORD},,\n")
    return path


def test_keeps_what_the_attention_jit_reads_and_drops_the_rest(wheel, tmp_path, capsys):
    assert slim.main([str(wheel), str(tmp_path / "out")]) == 0
    out = tmp_path / "out" / NAME
    assert f"{out}:" in capsys.readouterr().out
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == sorted(KEPT + [RECORD])
        assert z.read("flashinfer/decode.py") == b"contents of flashinfer/decode.py"
        listed = [line.split(",")[0] for line in z.read(RECORD).decode().splitlines()]
    assert sorted(listed) == sorted(KEPT + [RECORD])


def test_refuses_to_overwrite_its_input_or_a_foreign_wheel(wheel, tmp_path, capsys):
    with pytest.raises(ValueError, match="would overwrite"):
        slim.slim(str(wheel), str(wheel.parent))
    other = tmp_path / "torch-2.11.0-cp312-none-any.whl"
    other.write_bytes(b"")
    with pytest.raises(SystemExit):
        slim.main([str(other), str(tmp_path / "out")])
    assert "not a flashinfer_python wheel" in capsys.readouterr().err
