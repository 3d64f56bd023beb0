"""A flashinfer-python wheel cut to what the ``flashinfer_paged`` backend's JIT builds read, so it
fits the GPU machine's 64 MiB carry beside the tree (the full 0.7.2.post1 wheel is 59 MiB).

    python tools/slim_flashinfer.py flashinfer_python-0.7.2.post1-py3-none-any.whl .whl/

Kept: every file outside ``flashinfer/data/`` (the Python package imports all its modules),
``data/include`` (FlashInfer's headers), ``data/cccl`` and ``data/spdlog`` (include paths of
every JIT build), and the files directly in ``data/csrc`` (the sources and templates the
attention generators copy, and ``tvm_ffi_utils.h``). Dropped: ``data/cutlass`` and the
subdirectories of ``data/csrc`` (the CUTLASS, TRT-LLM and other kernels' sources): the
``flashinfer_cutlass`` MoE backend cannot build from this wheel. The set was read from ninja's
dependency lists of the fa2 batch decode and prefill modules (bf16, head dim 128) compiled for
sm_90a on a machine with nvcc and no GPU (2026-11-26): data/include/flashinfer (22 headers),
data/cccl/libcudacxx (564) and data/csrc/tvm_ffi_utils.h. The wheel keeps its name and
version; its RECORD lists the files kept. It also needs ``apache-tvm-ffi`` (a separate wheel).
"""
from __future__ import annotations

import argparse
import os
import sys
import zipfile

KEEP_DATA = ("flashinfer/data/include/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/")
CSRC = "flashinfer/data/csrc/"


def keep(name: str) -> bool:
    """Whether the wheel entry ``name`` goes into the slim wheel."""
    if not name.startswith("flashinfer/data/"):
        return True
    if name.startswith(KEEP_DATA):
        return True
    if name.startswith(CSRC):
        return "/" not in name[len(CSRC):]          # directly in csrc, not in a subdirectory
    return name.count("/") == 2                     # data/*.py helpers


def slim(src: str, out_dir: str) -> tuple[str, int, int]:
    """Write the slim wheel into ``out_dir`` -> (its path, entries kept, entries dropped)."""
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, os.path.basename(src))
    if os.path.abspath(dst) == os.path.abspath(src):
        raise ValueError(f"{src}: the slim wheel would overwrite it; give another directory")
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for line in zin.read(record).decode().splitlines():
            path = line.split(",", 1)[0]
            if path and (keep(path) or path == record):
                lines.append(line)
        for info in zin.infolist():
            if info.filename == record:
                continue
            if keep(info.filename):
                zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
                kept += 1
            else:
                dropped += 1
        zout.writestr(record, "\n".join(lines) + "\n")
    return dst, kept, dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", help="flashinfer_python-*.whl (pip download --no-deps)")
    ap.add_argument("out_dir", help="where the slim wheel goes, under the same file name")
    args = ap.parse_args(argv)
    if not os.path.basename(args.wheel).startswith("flashinfer_python-"):
        ap.error(f"{args.wheel}: not a flashinfer_python wheel")
    dst, kept, dropped = slim(args.wheel, args.out_dir)
    print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB, {kept} files kept, {dropped} dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
