"""The MoE backend registry: declarations, the one selection function, its refusals, and a
registered backend plugging into FusedMoE without other changes."""
from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig, SchedulerConfig,
                         VllmConfig, set_current_vllm_config)
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.fused_moe import registry, triton_experts
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEExperts, MoEKernelQuery
from vllm.model_executor.layers.fused_moe.registry import (MoEBackend, moe_backend_names,
                                                           register_moe_backend,
                                                           select_moe_backend)
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref
from vllm.platforms import DeviceCapability, platform_for
from vllm.platforms.cuda import CudaPlatform

E, H, I = 8, 32, 16


class FakeCuda(CudaPlatform):
    """A CUDA platform of a given SM, without a GPU (selection only asks the platform)."""

    def __init__(self, sm: int):
        self.sm = sm

    def get_device_capability(self, device=None):
        return DeviceCapability(self.sm // 10, self.sm % 10)


def query(scheme="unquantized", dtype=torch.float32, platform=None, hidden=H, inter=I):
    return MoEKernelQuery(scheme, "silu", dtype, hidden, inter, platform or platform_for("cpu"))


def test_builtin_names():
    assert {"cpu_kernel", "grouped_mm", "torch"} <= set(moe_backend_names())


@pytest.mark.parametrize("dtype,hidden,want", [(torch.float32, H, "cpu_kernel"),
                                               (torch.bfloat16, H, "cpu_kernel"),
                                               (torch.float16, H, "grouped_mm"),
                                               (torch.float16, 36, "torch")])   # 72-byte rows
def test_auto_on_cpu(dtype, hidden, want):
    assert select_moe_backend(query(dtype=dtype, hidden=hidden)).name == want


def test_auto_without_c_kernels(torch_paths):
    assert select_moe_backend(query()).name == "grouped_mm"
    with pytest.raises(ValueError, match=r"'cpu_kernel' cannot run .*kernels are not built"):
        select_moe_backend(query(), "cpu_kernel")


@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq",
                                    "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_runs_fp8_int4_fp4_and_torch_still_can(scheme, dtype):
    assert select_moe_backend(query(scheme, dtype)).name == "cpu_kernel"
    assert select_moe_backend(query(scheme, dtype), "torch").name == "torch"
    # Non-gated experts (relu2_no_mul) have no quantized C path: auto falls back to torch.
    q = MoEKernelQuery(scheme, "relu2_no_mul", dtype, H, I, platform_for("cpu"))
    assert select_moe_backend(q).name == "torch"
    with pytest.raises(ValueError, match=r"'cpu_kernel' cannot run .*gated activations only"):
        select_moe_backend(q, "cpu_kernel")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("sm,dtype,want", [(70, torch.bfloat16, "torch"),    # bf16 dot: SM 8.0
                                           (70, torch.float16, "triton"),
                                           (90, torch.bfloat16, "triton"),
                                           (120, torch.float32, "triton")])
def test_auto_on_cuda_by_capability(sm, dtype, want):
    assert select_moe_backend(query(dtype=dtype, platform=FakeCuda(sm))).name == want


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_fp8_needs_sm89():
    """Triton lowers e4m3 conversions to cvt.*.e4m3x2 (SM 8.9+): an A100 gets a refusal, not a
    compile error at the first forward; GPTQ INT4 still runs there."""
    for scheme in ("fp8-tensor", "fp8-block"):
        with pytest.raises(ValueError, match=r"FP8 e4m3 weights need SM >= 89, the device is "
                                             r"SM 86"):
            select_moe_backend(query(scheme, torch.float16, FakeCuda(86)), "triton")
        assert select_moe_backend(query(scheme, torch.float16, FakeCuda(89)),
                                  "triton").name == "triton"
    assert select_moe_backend(query("w4a16-gptq", torch.float16, FakeCuda(80)),
                              "triton").name == "triton"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq",
                                    "nvfp4", "mxfp4"])
def test_auto_on_cuda_runs_every_quantized_scheme_on_triton(scheme):
    """docs/quantization.md: on CUDA "auto" picks the Triton kernels for FP8, GPTQ and FP4."""
    assert select_moe_backend(query(scheme, torch.bfloat16, FakeCuda(90))).name == "triton"


@pytest.mark.parametrize("sm,dtype,want", [(80, torch.bfloat16, "torch"),
                                           (90, torch.bfloat16, "grouped_mm"),
                                           (90, torch.float16, "torch"),
                                           (120, torch.bfloat16, "grouped_mm")])
def test_auto_on_cuda_without_triton(monkeypatch, sm, dtype, want):
    monkeypatch.setattr(triton_experts, "triton_refusal", lambda device_type: "no triton here")
    assert select_moe_backend(query(dtype=dtype, platform=FakeCuda(sm))).name == want


def test_forced_backend_refusals_name_the_reason():
    with pytest.raises(ValueError, match=r"'grouped_mm' cannot run .* on cuda \(SM 8.0\): it "
                                         r"needs SM >= 90, the device is SM 80"):
        select_moe_backend(query(dtype=torch.bfloat16, platform=FakeCuda(80)), "grouped_mm")
    with pytest.raises(ValueError, match=r"'cpu_kernel' cannot run .*runs on \['cpu'\], not "
                                         r"'cuda'"):
        select_moe_backend(query(dtype=torch.bfloat16, platform=FakeCuda(90)), "cpu_kernel")
    with pytest.raises(ValueError, match=r"'grouped_mm' .*on cuda it takes bfloat16 only"):
        select_moe_backend(query(dtype=torch.float16, platform=FakeCuda(90)), "grouped_mm")
    with pytest.raises(ValueError, match=r"moe_backend='nope' is invalid: must be 'auto' or one "
                                         r"of \['cpu_kernel', 'grouped_mm', 'torch'"):
        select_moe_backend(query(), "nope")


def test_choice_is_logged_once(vllm_log):
    for _ in range(3):
        select_moe_backend(query(dtype=torch.bfloat16))
    msgs = [r.getMessage() for r in vllm_log.records if r.levelno == logging.INFO]
    assert sum("MoE backend cpu_kernel (requested 'auto')" in m for m in msgs) == 1


def test_engine_args_reject_unknown_backend_names_early():
    with pytest.raises(ValueError, match=r"moe_backend='fast' is invalid: must be 'auto' or one "
                                         r"of \["):
        EngineArgs(moe_backend="fast").create_engine_config()
    with pytest.raises(ValueError, match=r"attention_backend='fast' is invalid"):
        EngineArgs(attention_backend="fast").create_engine_config()


class CountingExperts(MoEExperts):
    """A third-party backend: the loop reference on a layout of its own (w2 stored transposed),
    counting its calls."""
    name = "test_counting"
    calls = 0

    def pack(self, tensors):
        return {n: t.transpose(-1, -2).contiguous() if n == "w2_weight" else t
                for n, t in tensors.items()}

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        type(self).calls += 1
        expert_pairs_ref(x, weights["w13_weight"], weights["w2_weight"].transpose(-1, -2),
                         topk_weights, ids, out)


@pytest.fixture
def counting_backend():
    register_moe_backend(MoEBackend("test_counting", lambda act, deq: CountingExperts(),
                                    schemes=("unquantized",), platforms=("cpu",)))
    CountingExperts.calls = 0
    yield "test_counting"
    registry._REGISTRY.unregister("test_counting")


def _layer(cache_size, backend, w):
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache_size),
                     DeviceConfig("cpu"), kernel_config=KernelConfig(moe_backend=backend))
    with set_current_vllm_config(cfg):
        layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32)
    layer.load_expert_weight("w13_weight", w[0], None, None)
    layer.load_expert_weight("w2_weight", w[1], None, None)
    layer.finish_loading(torch.device("cpu"))
    return layer


def test_a_registered_backend_plugs_in(counting_backend):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g))
    ref = _layer(0, "torch", w)
    uncached, cached = _layer(0, counting_backend, w), _layer(3, counting_backend, w)
    for layer in (uncached, cached):
        assert layer.quant_method.backend_name == "test_counting"
        assert layer.w2_weight.shape[1:] == (I, H)      # its own layout, made after loading
    for T in (1, 5, 17):
        x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
        want = uncached(x, logits)
        torch.testing.assert_close(want, ref(x, logits), rtol=1e-5, atol=1e-4)
        assert torch.equal(cached(x, logits), want)    # its slots hold its layout, bitwise
    assert CountingExperts.calls >= 6
    assert select_moe_backend(query()).name == "cpu_kernel"   # auto keeps the platform's order
