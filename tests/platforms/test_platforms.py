"""Platforms: the one place that answers what the machine has."""
from __future__ import annotations

import pytest
import torch

import vllm.platforms as platforms
from vllm.platforms import DeviceCapability, native_kernels, platform_for, resolve_device
from vllm.platforms.cuda import CudaPlatform, _in_wsl


def test_platform_for_device_types():
    assert platform_for("cpu").name == "cpu" and platform_for(torch.device("cpu")).name == "cpu"
    assert platform_for("cuda:1") is platform_for(torch.device("cuda", 0))
    meta = platform_for("meta")               # a torch device type without a platform
    assert meta.name == "meta" and not meta.is_available() and meta.moe_backends == ()
    assert not meta.has_native_kernels(torch.float32) and not meta.is_pin_memory_available()


def test_cpu_platform_answers():
    cpu = platform_for("cpu")
    assert cpu.get_device_capability() is None and cpu.memory_info(torch.device("cpu")) is None
    assert not cpu.is_pin_memory_available()
    assert cpu.has_native_kernels(torch.float32) and cpu.has_native_kernels(torch.bfloat16)
    assert not cpu.has_native_kernels(torch.float16)          # the C kernels take f32/bf16
    assert cpu.moe_backends[0] == "cpu_kernel" and cpu.attention_backends[0] == "cpu_paged"


def test_is_capturing_during_a_cpu_graph_capture_only(monkeypatch):
    from vllm.kernels.cpu.graph import CpuGraph, capture
    cpu = platform_for("cpu")
    assert not cpu.is_capturing()
    with capture(CpuGraph()):
        assert cpu.is_capturing()
    assert not cpu.is_capturing()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not platform_for("cuda").is_capturing()


def test_without_c_kernels_nothing_native(torch_paths):
    assert not platform_for("cpu").has_native_kernels(torch.float32)
    assert not native_kernels(torch.float32, torch.device("cpu"))


def test_native_kernels_never_while_compiling(monkeypatch):
    assert native_kernels(torch.float32, torch.device("cpu"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not native_kernels(torch.float32, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_resolve_device_without_a_gpu():
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    assert platforms.current_platform.name == "cpu"
    with pytest.raises(ValueError, match=r"device='cuda': cuda is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"device='tpu' is invalid: must be 'auto' or one of"):
        resolve_device("tpu")


def test_capability_numbers():
    assert DeviceCapability(9, 0).to_int() == 90 and DeviceCapability(12, 0).to_int() == 120
    assert str(DeviceCapability(8, 9)) == "8.9"


def test_cuda_pinning_refused_in_wsl(monkeypatch):
    class Uname:
        release = "5.15.153.1-microsoft-standard-WSL2"
    _in_wsl.cache_clear()
    monkeypatch.setattr("platform.uname", lambda: Uname())
    try:
        assert not CudaPlatform().is_pin_memory_available()
    finally:
        _in_wsl.cache_clear()
    assert CudaPlatform().is_pin_memory_available() == (not _in_wsl())


def test_cuda_residency_step_is_the_triton_kernel():
    pytest.importorskip("triton")
    from vllm.kernels.triton import residency_step as triton_step
    from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
    from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
    from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import (
        select_residency_step)
    assert platform_for("cuda").residency_step_kernel() is triton_step.residency_step
    step = select_residency_step(Residency(8, 2, get_policy("lrfu")), torch.device("cuda"))
    assert (step.name, step.on_host, step.cpu_graph_node) == ("triton", False, False)
    # Its steps run the route, then the account on a side stream: the handle is made
    # here, where torch may have no CUDA (its device and stream resolve at the first fork).
    assert platform_for("cuda").residency_step_parts() and step.side is not None


def test_cuda_residency_step_without_triton_falls_back_with_a_warning(monkeypatch, vllm_log):
    import sys

    from vllm.platforms import cuda as cuda_platform
    monkeypatch.setitem(sys.modules, "vllm.kernels.triton.residency_step", None)  # ImportError
    cuda_platform._triton_residency_step.cache_clear()
    try:
        assert platform_for("cuda").residency_step_kernel() is None
        assert "'triton' package" in vllm_log.text and "pip install triton" in vllm_log.text
    finally:
        cuda_platform._triton_residency_step.cache_clear()


def test_cuda_elementwise_ops_are_the_triton_kernels():
    pytest.importorskip("triton")
    from vllm.kernels.triton import elementwise as ew
    from vllm.platforms import elementwise_ops
    ops = platform_for("cuda").elementwise_ops()
    assert (ops.rms_norm, ops.silu_and_mul, ops.gelu_and_mul, ops.rotary_embedding) == (
        ew.rms_norm, ew.silu_and_mul, ew.gelu_and_mul, ew.rotary_embedding)
    cuda = torch.device("cuda")
    assert elementwise_ops(torch.bfloat16, cuda) is ops and elementwise_ops(torch.float16, cuda)
    assert elementwise_ops(torch.float64, cuda) is None                 # not a dtype they take


def test_cpu_has_no_elementwise_ops_even_under_the_interpreter():
    """CPU keeps its C kernels (the Triton ops are tested directly, interpreted)."""
    from vllm.platforms import elementwise_ops
    assert platform_for("cpu").elementwise_ops() is None
    assert elementwise_ops(torch.float32, torch.device("cpu")) is None


def test_elementwise_ops_never_while_compiling(monkeypatch):
    pytest.importorskip("triton")
    from vllm.platforms import elementwise_ops
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert elementwise_ops(torch.float16, torch.device("cuda")) is None


def test_cuda_elementwise_ops_without_triton_are_none_with_a_warning(monkeypatch, vllm_log):
    import sys

    from vllm.platforms import cuda as cuda_platform
    monkeypatch.setitem(sys.modules, "vllm.kernels.triton.elementwise", None)  # ImportError
    cuda_platform._triton_elementwise_ops.cache_clear()
    try:
        assert platform_for("cuda").elementwise_ops() is None
        assert platform_for("cuda").elementwise_ops() is None               # cached: one warning
        assert vllm_log.text.count("'triton' package") == 1
        assert "pip install triton" in vllm_log.text and "rotary" in vllm_log.text
    finally:
        cuda_platform._triton_elementwise_ops.cache_clear()


def test_cuda_side_streams_one_stream_per_device_and_role_a_handle_per_caller(monkeypatch):
    """Every cached layer of a device forks its miss copies onto one stream and its prefetch
    copies onto another (PyTorch's pool of 32 would alias per-layer streams past 32 layers; a
    shared stream for both would queue a layer's misses behind the next layer's prefetch), at
    default priority (the graph capture stream is a high-priority one); a join waits for its
    own handle's last fork of that role, not for the stream."""
    from fake_cuda import FakeCuda

    from vllm.platforms import cuda as cuda_platform
    fake = FakeCuda(current_device=0)
    fake.install(monkeypatch)
    cuda_platform._device_side_stream.cache_clear()
    try:
        p = CudaPlatform()
        a, b = p.side_stream(torch.device("cuda", 1)), p.side_stream(torch.device("cuda:1"))
        other = p.side_stream(torch.device("cuda", 0))
        m, pf = a.streams["misses"], a.streams["prefetch"]
        assert a is not b and b.streams == a.streams and m.priority == pf.priority == 0
        assert m is not pf and m.index == pf.index == 1
        assert other.streams["misses"] is not m and other.streams["misses"].index == 0
        s, fake.log[:] = m.name, []
        with a.fork():
            assert fake.where() == (1, s)
        with b.fork():
            pass
        a.join()
        e_a, e_b = fake.log[1][1], fake.log[3][1]
        assert fake.log == [("wait_stream", s, "default:1"), ("record", e_a, s),
                            ("wait_stream", s, "default:1"), ("record", e_b, s),
                            ("wait_event", "default:1", e_a)]
        fake.log[:] = []
        with a.fork("prefetch"):
            assert fake.where() == (1, pf.name)
        a.join("prefetch")
        a.join()                                   # the misses' last fork, as before
        e_p = fake.log[1][1]
        assert fake.log == [("wait_stream", pf.name, "default:1"), ("record", e_p, pf.name),
                            ("wait_event", "default:1", e_p), ("wait_event", "default:1", e_a)]
    finally:
        cuda_platform._device_side_stream.cache_clear()


def test_select_device_makes_an_indexed_cuda_device_current(monkeypatch):
    """An engine on cuda:N makes N current (launches that take the current device follow it);
    plain "cuda" keeps the current device; the CPU platform does nothing."""
    picked = []
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    CudaPlatform().select_device(torch.device("cuda", 1))
    CudaPlatform().select_device(torch.device("cuda"))
    platform_for("cpu").select_device(torch.device("cpu"))
    assert picked == [torch.device("cuda", 1)]
