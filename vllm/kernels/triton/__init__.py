"""Triton kernels (CUDA). Import only where a CUDA platform asks for them: ``triton`` is an
optional dependency of the CPU install (``pip install -e ".[cuda]"``).

On a machine without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
numpy on CPU tensors): how the tests check them against their torch references. Backend
registries ask ``triton_refusal`` whether a Triton kernel can run on a device."""
from __future__ import annotations

import importlib.util
import os


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_refusal(device_type: str) -> str | None:
    """Why a Triton kernel cannot run on ``device_type`` tensors here, or None: it needs the
    ``triton`` package, and CUDA, or CPU tensors under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install triton)"
    if device_type == "cuda":
        return None
    if device_type == "cpu" and interpreting():
        return None
    return (f"Triton kernels run on CUDA, or on CPU only under TRITON_INTERPRET=1; "
            f"not on {device_type!r}")
