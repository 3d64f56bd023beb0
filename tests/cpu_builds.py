"""Run C-kernel code under another build of the kernels (other compiler flags), for tests that
check every build computes the same bits (vllm/kernels/cpu/build.py caches one build per flags)."""
from __future__ import annotations

from vllm.kernels.cpu import build


def run_with_cflags(monkeypatch, flags: str, fn):
    """fn() with the kernels built with ``VLLM_CPU_KERNEL_CFLAGS=flags``; the default build is
    back afterwards, however fn ends."""
    monkeypatch.setenv("VLLM_CPU_KERNEL_CFLAGS", flags)
    build.load_cpu_kernels.cache_clear()
    try:
        return fn()
    finally:
        monkeypatch.delenv("VLLM_CPU_KERNEL_CFLAGS")
        build.load_cpu_kernels.cache_clear()
