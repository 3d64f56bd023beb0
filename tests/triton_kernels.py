"""The Triton kernel modules for the kernel tests: compiled on a GPU, else interpreted (tests/
conftest.py sets TRITON_INTERPRET before triton is first imported)."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch


def triton_module(name: str) -> ModuleType:
    """``vllm.kernels.triton.<name>``; the test skips where its kernels cannot run (no GPU and
    TRITON_INTERPRET is not 1)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: the kernels cannot run here")
    return importlib.import_module(f"vllm.kernels.triton.{name}")
