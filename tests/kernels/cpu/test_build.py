"""Building and loading the CPU kernel library, and the fallbacks when it cannot be built."""
from __future__ import annotations

import pytest

from vllm.kernels.cpu import build


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    build.load_cpu_kernels.cache_clear()
    yield tmp_path
    build.load_cpu_kernels.cache_clear()


def test_builds_into_the_cache_root_and_reuses_it(fresh_loader):
    lib = build.load_cpu_kernels()
    assert lib is not None and lib.pack_block_width() > 0
    built = list(fresh_loader.glob("cpu_kernels/*/libvllm_cpu.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    build.load_cpu_kernels.cache_clear()
    assert build.load_cpu_kernels() is not None
    assert built[0].stat().st_mtime_ns == mtime                   # loaded, not rebuilt


def test_disabled_by_env(fresh_loader, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KERNELS", "0")
    assert build.load_cpu_kernels() is None


def test_failed_build_falls_back_with_a_warning(fresh_loader, monkeypatch, tmp_path, vllm_log):
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'fake cc: cannot compile' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    assert build.load_cpu_kernels() is None
    assert "CPU kernels unavailable" in vllm_log.text and "cannot compile" in vllm_log.text


def test_backend_selection_falls_back_without_kernels(fresh_loader, monkeypatch):
    import torch
    from vllm.model_executor.layers.fused_moe.modular_kernel import MoEKernelQuery
    from vllm.model_executor.layers.fused_moe.registry import select_moe_backend
    from vllm.platforms import platform_for
    query = MoEKernelQuery("unquantized", "silu", torch.float32, 32, 16, platform_for("cpu"))
    assert select_moe_backend(query).name == "cpu_kernel"
    build.load_cpu_kernels.cache_clear()
    monkeypatch.setenv("VLLM_CPU_KERNELS", "0")
    assert select_moe_backend(query).name == "grouped_mm"
