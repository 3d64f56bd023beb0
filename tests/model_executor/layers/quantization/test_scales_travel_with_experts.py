"""Scales and zero points travel with their experts: after load, corrupt the expert cache's HOST
copy (the store) of one expert's scale / zero tensors. The layer's output must not change while
that expert stays resident in a slot, nor for experts never loaded; once the expert is evicted
and loaded again, the output must be exactly that of an uncached layer holding the corrupted
values. So the compute reads the slot copies, and a miss copies every scale with its expert.
For every scheme: fp8 tensor / channel / block, w4a16-gptq (asym, desc_act), nvfp4 (through the
real loader on a tiny Qwen3-MoE), and mxfp4 (a GPT-OSS-style layer); and the GPU-only
cutlass_w4a16 backend through its op's CPU stand-in."""
from __future__ import annotations

import pytest
import torch

from tools.quantize_checkpoint import main as quantize_main
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from vllm.model_executor.model_loader import get_model
from model_executor.layers.quantization.published_ckpt import TINY
from model_executor.tiny_checkpoints import make_vllm_config

SCHEMES = {"fp8-tensor": [], "fp8-channel": [], "fp8-block": ["--block-size", "16", "32"],
           "w4a16-gptq": ["--asym", "--desc-act", "--group-size", "32"], "nvfp4": []}
N_SLOTS, BAD, NEVER = 2, 0, 5          # slots; the corrupted expert; one never routed to


def corrupt_(t: torch.Tensor) -> None:
    """Change every value of one expert's tensor in place (any scale / zero dtype)."""
    if t.dtype in (torch.float8_e4m3fn,):
        t.copy_((t.float() * 0.5).to(t.dtype))
    elif t.is_floating_point():
        t.mul_(0.5)
    elif t.dtype == torch.uint8:                   # e8m0 exponents: halve the scale
        t.sub_(1)
    else:                                          # packed int4 zero points: each zero +-1
        t.bitwise_xor_(0x11111111)


def scale_names(layer: FusedMoE) -> list[str]:
    """Every expert tensor holding scales or zero points (whatever layout the backend packs)."""
    names = [n for n in layer.quant_method.expert_tensor_names()
             if "scale" in n or "zeros" in n]
    assert names, layer.quant_method.expert_tensor_names()
    return names


def check_scales_travel(cached: FusedMoE, twin: FusedMoE, never: int | None = NEVER,
                        dtype: torch.dtype = torch.float32) -> None:
    """``cached`` has N_SLOTS slots; ``twin`` is the same layer without a cache; ``never``: an
    expert never routed to (None: the layer has none to spare)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, cached.hidden_size, generator=g).to(dtype)
    w = torch.rand(5, 2, generator=g)

    def run(layer, experts):
        ids = torch.tensor([experts] * x.shape[0])
        return layer.forward_experts(x, w, ids)
    cache = cached.expert_cache
    assert cache is not None and cache.store.tensors
    names = scale_names(cached)
    want01, want23 = run(twin, [0, 1]), run(twin, [2, 3])
    assert torch.equal(run(cached, [0, 1]), want01)              # experts 0, 1 now resident
    for n in names:                                              # host copies only
        corrupt_(cache.store.tensors[n][BAD])
        if never is not None:
            corrupt_(cache.store.tensors[n][never])
    assert torch.equal(run(cached, [0, 1]), want01), "resident expert read the host store"
    assert torch.equal(run(cached, [2, 3]), want23)              # evicts 0 and 1 (N = 2)
    slots = twin.weight_provider.slot_weights()                  # the twin's compute tensors
    for n in names:
        corrupt_(slots[n][BAD])
    bad01 = run(twin, [0, 1])
    assert not torch.equal(bad01, want01)                        # the corruption matters
    misses = cache.stats()["misses"]
    assert torch.equal(run(cached, [0, 1]), bad01), "reloaded expert's scales did not travel"
    assert cache.stats()["misses"] == misses + 2                 # 0 and 1 loaded again


def _moe_layer(path, cache_size: int, backend: str) -> FusedMoE:
    cfg = make_vllm_config(path)
    cfg.moe_cache_config.cache_size = cache_size
    cfg.kernel_config.moe_backend = backend
    model = get_model(cfg)
    return next(m for m in model.modules() if isinstance(m, FusedMoE))


# "torch" is the dequantizing reference; "auto" is whatever backend the platform picks for the
# scheme (the C kernel on CPU where it runs the scheme), so each kernel is shown to read slots.
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scales_travel_with_experts(tiny_model_factory, tmp_path, scheme, backend):
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    path = str(tmp_path / scheme)
    quantize_main(["--model", src, "--out", path, "--scheme", scheme, *SCHEMES[scheme]])
    cached, twin = _moe_layer(path, N_SLOTS, backend), _moe_layer(path, 0, backend)
    assert cached.quant_method.backend_name == twin.quant_method.backend_name
    # On CPU "auto" is the C kernel for every scheme here (FP8, INT4, NVFP4).
    assert cached.quant_method.backend_name == ("torch" if backend == "torch" else "cpu_kernel")
    check_scales_travel(cached, twin)


def _mxfp4_layer(cache_size: int, backend: str) -> FusedMoE:
    from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig,
                             SchedulerConfig, VllmConfig)
    E, H, N = 6, 64, 32
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache_size),
                     DeviceConfig("cpu"), kernel_config=KernelConfig(moe_backend=backend))
    g = torch.Generator().manual_seed(3)
    act = MoEActivation("swigluoai", 1.702, 7.0)
    with set_current_vllm_config(cfg):
        method = Mxfp4MoEMethod(act)
        layer = FusedMoE(E, 2, H, N, activation=act, bias=True, quant_method=method,
                         params_dtype=torch.float32)
        for e in range(E):
            for shard, rows, cols in (("w1", N, H), ("w3", N, H), ("w2", H, N)):
                kind = "w2" if shard == "w2" else "w13"
                blocks = torch.randint(0, 256, (rows, cols // 32, 16), generator=g,
                                       dtype=torch.uint8)
                scales = torch.randint(119, 125, (rows, cols // 32), generator=g).to(torch.uint8)
                for suffix, t in (("blocks", blocks), ("scales", scales)):
                    layer.load_expert_weight(f"{kind}_{suffix}",
                                             method.load_transform(suffix, kind, t), e, shard)
                layer.load_expert_weight(f"{kind}_bias", torch.randn(rows, generator=g), e, shard)
        layer.finish_loading(torch.device("cpu"))
    return layer


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_mxfp4_scales_travel_with_experts(backend):
    cached, twin = _mxfp4_layer(N_SLOTS, backend), _mxfp4_layer(0, backend)
    assert cached.quant_method.backend_name == ("torch" if backend == "torch" else "cpu_kernel")
    check_scales_travel(cached, twin)


def test_cutlass_w4a16_scales_travel_with_experts():
    """cutlass_w4a16 (no GPU here: its op's torch stand-in, which reads what it is given) packs
    bf16 scales per expert (symmetric: the zero points are unread), with act order's
    permutation beside them; the slots' copies are what it reads. Four experts, all routed: no
    never-routed one to corrupt."""
    from model_executor.layers.fused_moe.cutlass_w4a16_standin import standin_ops
    from model_executor.layers.fused_moe.test_cutlass_w4a16_act_order import build
    cached = build("torch", True, cache=N_SLOTS, ops=standin_ops())
    twin = build("torch", True, ops=standin_ops())
    assert cached.quant_method.kernel.name == "cutlass_w4a16"
    assert {"w13_scales", "w13_qzeros", "w2_scales", "w2_qzeros"} <= set(scale_names(cached))
    check_scales_travel(cached, twin, never=None, dtype=torch.bfloat16)
