"""The "flashinfer_cutlass" backend's MXFP4 (GPT-OSS) path: FlashInfer's SM90 mixed-input
W4A16 GEMM (NOT YET RUN ON A GPU, forced only), and the GPTQ W4A16 path it does not take.

On CPU: the entry points (cutlass_fused_moe with use_w4_group_scaling, its workspace size, the
weight interleave and the scale fold) take what the backend passes; the stand-in's port of the
interleave kernel against bytes traced by hand from its CUDA source, its port of the scale fold
against FlashInfer's own (pure torch); ``pack``'s layout read back from FlashInfer's layout by
hand equals the method's dequantized weights; a layer (biases, swigluoai, padded and unpadded
sizes) equals the torch backend through the stand-in, uncached and cached at several
capacities; the refusals. On a GPU (``gpu``): the port against the real interleave kernel, and
the real kernel against the torch backend."""
from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from model_executor.layers.fused_moe import flashinfer_standin as standin
from model_executor.layers.fused_moe.flashinfer_standin import fake_flashinfer
from model_executor.tiny_checkpoints import layer_config

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe import flashinfer_cutlass as fc
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import (MoEActivation, MoEKernelQuery,
                                                                 capture_warm_up)
from vllm.model_executor.layers.fused_moe.registry import get_moe_backend, select_moe_backend
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from vllm.platforms import DeviceCapability, platform_for
from vllm.platforms.cuda import CudaPlatform

E, TOP_K = 4, 2
SWIGLUOAI = MoEActivation("swigluoai", 1.702, 7.0)
SHAPES = [(128, 128), (160, 96)]          # (H, N): aligned, and padded to (256, 128)


# ---- an MXFP4 layer ------------------------------------------------------------------------------
def random_mxfp4(g, rows, cols):
    """GPT-OSS's published layout: e2m1 bytes [rows, cols/32, 16], e8m0 [rows, cols/32]."""
    return (torch.randint(0, 256, (rows, cols // 32, 16), generator=g, dtype=torch.uint8),
            torch.randint(118, 124, (rows, cols // 32), generator=g, dtype=torch.uint8))


def build(H, N, cache=0, api=None, device="cpu", dtype=torch.float32, config=None, seed=0):
    """A GPT-OSS-like FusedMoE layer (swigluoai, biases) selected on "torch"; ``api``: its
    kernel replaced by flashinfer_cutlass over that stand-in before loading."""
    g = torch.Generator().manual_seed(seed)
    experts = [{f"{kind}_{n}": t for kind, rows, cols in (("w13", 2 * N, H), ("w2", H, N))
                for n, t in zip(("blocks", "scales"), random_mxfp4(g, rows, cols))}
               for _ in range(E)]
    biases = {"w13_bias": torch.randn(E, 2 * N, generator=g) * 0.1,
              "w2_bias": torch.randn(E, H, generator=g) * 0.1}
    method = Mxfp4MoEMethod(SWIGLUOAI)
    with set_current_vllm_config(config or layer_config(cache, moe_backend="torch")), \
            torch.device(device):
        layer = FusedMoE(E, TOP_K, H, N, activation=SWIGLUOAI, params_dtype=dtype,
                         quant_method=method, bias=True)
        if api is not None:
            layer.quant_method.kernel = fc.FlashInferCutlassExperts(layer.activation, api)
            layer.quant_method.kernel.bind_scheme(method)
        for e, tensors in enumerate(experts):
            for name, t in tensors.items():
                layer.load_expert_weight(name, t, e, None)
        for name, t in biases.items():
            layer.load_expert_weight(name, t.to(dtype), None, None)
    layer.finish_loading(torch.device(device))
    return layer


def inputs(T, H, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g).to(device, dtype),
            torch.randn(T, E, generator=g).to(device))


# ---- the entry points ----------------------------------------------------------------------------
def test_mxfp4_entry_points_take_what_the_backend_passes():
    real = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer-python is not "
                               "installed (pip install -e '.[cuda]'); it imports without a GPU")
    api = fake_flashinfer()
    layer = build(*SHAPES[1], api=api)
    with capture_warm_up(3):
        layer(*inputs(2, SHAPES[1][0], 0))
    names = {n for n, _, _ in api.calls}
    assert names == {"cutlass_fused_moe", "cutlass_fused_moe_workspace_size", *fc.MXFP4_API}
    for name, args, kwargs in api.calls:       # positions and keywords as the real functions
        inspect.signature(getattr(real, name)).bind(*args, **kwargs)
    run = [kw for n, _, kw in api.calls if n == "cutlass_fused_moe"]
    assert all(kw["use_w4_group_scaling"] and "use_packed_weights" not in kw for kw in run)
    assert inspect.signature(real.interleave_moe_weights_for_sm90_mixed_gemm).parameters[
        "quant_type"].default == "fp4"


# ---- the layout ----------------------------------------------------------------------------------
def test_interleave_port_moves_bytes_as_traced_from_the_kernel():
    """Single set bits followed by hand through interleave_fp4_weights_for_sm90_mixed_gemm_kernel:
    thread (block 0, partition 0, lane 0) packs [0,0], [8,0], [0,4], [8,4]; bit 0 of the word
    moves to bit 6 (mask 0x7 << 6), bit 31 to bit 30 (>> 1); lane 4 reads [0,8] into the word
    it writes at row 8 (mma_id 1), bit 4 going to bit 22 (mask 0x70 << 18)."""
    w = torch.zeros(1, 16, 32, dtype=torch.uint8)
    w[0, 0, 0], w[0, 8, 4], w[0, 0, 8] = 0x01, 0x80, 0x10
    got = standin.interleave_fp4(w)
    assert got.nonzero().tolist() == [[0, 0, 0], [0, 0, 3], [0, 8, 2]]
    assert got[0, 0, 0] == got[0, 0, 3] == got[0, 8, 2] == 0x40
    r = torch.randint(0, 256, (2, 32, 64), dtype=torch.uint8)
    assert torch.equal(standin.deinterleave_fp4(standin.interleave_fp4(r)), r)


def test_scale_fold_port_equals_flashinfers():
    real = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer-python is not "
                               "installed; its scale fold is pure torch and runs on CPU")
    s = torch.randint(0, 256, (3, 256, 12), dtype=torch.uint8)
    assert torch.equal(standin.fold_scales(s), real.interleave_moe_scales_for_sm90_mixed_gemm(s))
    assert torch.equal(standin.unfold_scales(standin.fold_scales(s)), s)


def dequant_published(blocks, scales):
    """Test-side MXFP4 reader of our layout (no vllm code): [.., R, C/32, 16], [.., R, C/32]."""
    lo, hi = blocks & 0xF, blocks >> 4
    codes = torch.stack([lo, hi], -1).flatten(-3).long()                  # [.., R, C]
    mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * (2.0 ** (scales.float() - 127)).repeat_interleave(32, -1)


@pytest.mark.parametrize("H,N", SHAPES)
@pytest.mark.parametrize("stacked", [True, False])
def test_mxfp4_conversion_reads_back_to_the_methods_weights(H, N, stacked):
    """pack's output read back by hand in FlashInfer's layout (de-interleave, unfold, e2m1 x
    2^(e8m0 - 127)) is [up; gate], zero padded, equal to the method's dequantized experts."""
    g = torch.Generator().manual_seed(1)
    (b13, s13), (b2, s2) = random_mxfp4(g, 2 * N, H), random_mxfp4(g, H, N)
    t = {"w13_blocks": b13, "w13_scales": s13, "w2_blocks": b2, "w2_scales": s2,
         "w13_bias": torch.randn(2 * N, generator=g), "w2_bias": torch.randn(H, generator=g)}
    want13, want2 = Mxfp4MoEMethod().dequantize(t, torch.float32)
    torch.testing.assert_close(want13, dequant_published(b13, s13), rtol=0, atol=0)
    api = fake_flashinfer()
    kernel = fc.FlashInferCutlassExperts(SWIGLUOAI, api)
    kernel.bind_scheme(Mxfp4MoEMethod())
    got = kernel.pack({n: v[None] for n, v in t.items()} if stacked else t)
    if not stacked:
        got = {n: v[None] for n, v in got.items()}
    Hp, Np = -(-H // 128) * 128, -(-N // 128) * 128
    assert got["w13_blocks"].shape == (1, 2 * Np, Hp // 2)
    assert got["w2_scales"].shape == (1, Hp // 64, Np // 128, 16, 16)
    w31, w2 = standin.fi_weights(got["w13_blocks"], got["w2_blocks"],
                                 [got["w13_scales"].view(torch.int32),
                                  got["w2_scales"].view(torch.int32)], False, True)
    pad = torch.zeros(2, Np, Hp)
    pad[0, :N, :H], pad[1, :N, :H] = want13[N:], want13[:N]               # [up; gate]
    assert torch.equal(w31[0], pad.reshape(2 * Np, Hp))
    assert torch.equal(w2[0, :H, :N], want2) and not w2[0, H:].any() and not w2[0, :, N:].any()
    b31 = got["w13_bias"][0]
    assert torch.equal(b31[:N], t["w13_bias"][N:]) and torch.equal(b31[Np:Np + N],
                                                                    t["w13_bias"][:N])
    assert not b31[N:Np].any() and torch.equal(got["w2_bias"][0, :H], t["w2_bias"])


# ---- the layer through the stand-in --------------------------------------------------------------
@pytest.mark.parametrize("H,N", SHAPES)
@pytest.mark.parametrize("cache", [0, 1, TOP_K, 3])
def test_mxfp4_layer_equals_the_torch_backend(H, N, cache):
    """Biases and swigluoai; cache 1 < top_k: several waves over slot ids."""
    ref = build(H, N)
    got = build(H, N, cache=cache, api=fake_flashinfer())
    if cache:
        assert got.expert_cache is not None
        assert got.w13_blocks.shape[0] == cache and got.w13_blocks.dim() == 3   # packed slots
    for T in (1, 5):
        x, logits = inputs(T, H, T)
        torch.testing.assert_close(got(x, logits), ref(x, logits), rtol=1e-4, atol=1e-5)


def test_mxfp4_capture_warm_up_sizes_the_padded_workspace():
    api = fake_flashinfer()
    layer = build(160, 96, api=api)
    with capture_warm_up(4):
        layer(*inputs(2, 160, 0))
    (_, args, kw), = [c for c in api.calls if c[0] == "cutlass_fused_moe_workspace_size"]
    assert args == (4 * TOP_K, 256, 128, E, 1)
    assert kw["weight_dtype"] == torch.uint8 and kw["use_w4_group_scaling"] is True


# ---- the registry and binding --------------------------------------------------------------------
class FakeCuda(CudaPlatform):
    def __init__(self, sm: int):
        self.sm = sm

    def get_device_capability(self, device=None):
        return DeviceCapability(self.sm // 10, self.sm % 10)


def query(scheme="mxfp4", dtype=torch.bfloat16, sm=90, activation="swigluoai", bias=True,
          hidden=2880, inter=2880):
    return MoEKernelQuery(scheme, activation, dtype, hidden, inter, FakeCuda(sm), bias)


@pytest.fixture
def installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer" else real(name, *a))


def test_mxfp4_selectable_when_forced_never_by_auto(installed):
    q = query()                                          # GPT-OSS's 2880: padded by pack
    assert select_moe_backend(q, "flashinfer_cutlass").name == "flashinfer_cutlass"
    assert select_moe_backend(q).name != "flashinfer_cutlass"


@pytest.mark.parametrize("q,reason", [
    (query(sm=100), r"it runs mxfp4 on SM 90, not SM 100"),
    (query(sm=120), r"it runs mxfp4 on SM 90, not SM 120"),
    (query(dtype=torch.float16), r"it runs mxfp4 with bfloat16 activations only, not "
                                 r"torch.float16"),
    (query(activation="relu2_no_mul", bias=False), r"mxfp4 with gated activations only"),
    (query("nvfp4", sm=100), r"biases to unquantized and mxfp4 experts only, not nvfp4"),
    (query("w4a16-gptq", bias=False), r"it does not run w4a16-gptq: FlashInfer's INT4 "
                                      r"W4A16 path .* is not an SM90 mixed-input GEMM"),
])
def test_refusals_name_scheme_sm_and_what_is_allowed(installed, q, reason):
    with pytest.raises(ValueError, match=r"'flashinfer_cutlass' cannot run .*" + reason):
        select_moe_backend(q, "flashinfer_cutlass")


def test_bind_refuses_gptq_and_an_old_flashinfer():
    kernel = fc.FlashInferCutlassExperts(MoEActivation(), fake_flashinfer())
    with pytest.raises(ValueError, match=r"does not run w4a16-gptq: FlashInfer's INT4 W4A16 path"
                                         r".*SM80 fpA_intB grouped GEMM"):
        kernel.bind_scheme(GptqMoEMethod(128, True, False))
    old = fake_flashinfer()
    del old.interleave_moe_scales_for_sm90_mixed_gemm
    with pytest.raises(ValueError, match=r"has no interleave_moe_scales_for_sm90_mixed_gemm"):
        fc.FlashInferCutlassExperts(SWIGLUOAI, old).bind_scheme(Mxfp4MoEMethod(SWIGLUOAI))


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_interleave_port_equals_the_kernel_on_gpu():
    real = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer-python is not installed")
    w = torch.randint(0, 256, (3, 256, 96), dtype=torch.uint8)
    got = real.interleave_moe_weights_for_sm90_mixed_gemm(w.cuda(), "fp4").cpu()
    assert torch.equal(got, standin.interleave_fp4(w))


@pytest.mark.gpu
@pytest.mark.parametrize("H,N", SHAPES)
@pytest.mark.parametrize("cache", [0, 2])
def test_mxfp4_matches_the_torch_backend_on_gpu(H, N, cache):
    """bf16 activations stay bf16 (W4A16): a bf16 error bound, not the CPU tests' equality."""
    pytest.importorskip("flashinfer.fused_moe", reason="flashinfer-python is not installed")
    reason = get_moe_backend("flashinfer_cutlass").refusal(
        MoEKernelQuery("mxfp4", "swigluoai", torch.bfloat16, H, N, platform_for("cuda"), True))
    if reason is not None:
        pytest.skip(f"flashinfer_cutlass cannot run mxfp4 on this GPU: {reason}")
    from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig,
                             SchedulerConfig, VllmConfig)

    def layer(backend):
        cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache),
                         DeviceConfig("cuda"), kernel_config=KernelConfig(moe_backend=backend))
        return build(H, N, cache, device="cuda", dtype=torch.bfloat16, config=cfg)
    ref, got = layer("torch"), layer("flashinfer_cutlass")
    assert got.quant_method.backend_name == "flashinfer_cutlass"
    for T in (1, 7, 64):
        x, logits = inputs(T, H, T, torch.bfloat16, "cuda")
        want, y = ref(x, logits).float(), got(x, logits).float()
        assert ((y - want).norm() / want.norm()).item() < 0.02
