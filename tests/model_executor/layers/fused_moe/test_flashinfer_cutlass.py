"""The "flashinfer_cutlass" MoE backend (FlashInfer's CUTLASS fused MoE; NOT YET RUN ON A GPU,
forced only). On CPU: the FlashInfer entry points take every argument the backend passes (when
flashinfer-python is installed), the layout conversion against references written here from
FlashInfer's documented layout, the registry's refusals and that "auto" never picks it, the
missing-package error, and the whole pair path against the torch backend through a stand-in
for ``flashinfer.fused_moe`` that computes FlashInfer's documented contract in float32 (weights,
scales and alphas as FlashInfer reads them; activations not quantized). The tests marked
``gpu`` run the real kernel against the torch backend and inside CUDA graphs."""
from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import pytest
import torch
from model_executor.layers.fused_moe.flashinfer_standin import (fake_flashinfer, fi_weights,
                                                                  unswizzle)
from model_executor.tiny_checkpoints import layer_config
from pair_checks import assert_pairs_independent

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe import flashinfer_cutlass as fc
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import (MoEActivation, MoEKernelQuery,
                                                                 capture_warm_up,
                                                                 capture_warm_up_tokens)
from vllm.model_executor.layers.fused_moe.registry import get_moe_backend, select_moe_backend
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod, quantize_fp8
from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod, quantize_nvfp4
from vllm.platforms import DeviceCapability, platform_for
from vllm.platforms.cuda import CudaPlatform

E, H, N, TOP_K = 4, 128, 128, 2


# ---- layers ----------------------------------------------------------------------------------
SCHEMES = {"unquantized": None,
           "fp8-block": lambda act: Fp8MoEMethod("block", (128, 128), act),
           "nvfp4": lambda act: Nvfp4MoEMethod(act)}


def load_experts(layer, scheme, w13, w2, bias):
    """Random weights through the method's own quantizer and load_transform, as the loader
    does. NVFP4 quantizes each expert's fused [gate; up] once: one global scale for both."""
    method = layer.quant_method
    for e in range(E):
        if scheme == "unquantized":
            layer.load_expert_weight("w13_weight", w13[e], e, None)
            layer.load_expert_weight("w2_weight", w2[e], e, None)
            continue
        quant = quantize_nvfp4 if scheme == "nvfp4" else lambda w: quantize_fp8(w, "block")
        for kind, w in (("w13", w13[e]), ("w2", w2[e])):
            for suffix, t in quant(w).items():
                layer.load_expert_weight(f"{kind}_{suffix}", method.load_transform(
                    suffix, kind, t.expand(2) if suffix == "weight_scale_2" and kind == "w13"
                    else t), e, None)
    if bias:
        layer.load_expert_weight("w13_bias", bias[0], None, None)
        layer.load_expert_weight("w2_bias", bias[1], None, None)
    if scheme == "nvfp4":
        layer.w13_input_scale.data.fill_(0.01)
        layer.w2_input_scale.data.fill_(0.02)


def build(scheme, backend, activation="silu", cache=0, bias=False, api=None, seed=0,
          dtype=torch.float32, device="cpu", config=None):
    """One FusedMoE layer; ``api``: run the flashinfer_cutlass experts over this stand-in (the
    layer selects ``backend`` first, then its kernel is replaced before loading)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if MoEActivation.of(activation).gated else N
    w13, w2 = torch.randn(E, rows, H, generator=g) * 0.1, torch.randn(E, H, N, generator=g) * 0.1
    b = (torch.randn(E, rows, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1)
    method = SCHEMES[scheme](activation) if SCHEMES[scheme] else None
    with set_current_vllm_config(config or layer_config(cache, moe_backend=backend)), \
            torch.device(device):                     # cached experts are born on the host
        layer = FusedMoE(E, TOP_K, H, N, activation=activation, params_dtype=dtype,
                         quant_method=method, bias=bias)
        if api is not None:
            layer.quant_method.kernel = fc.FlashInferCutlassExperts(layer.activation, api)
            layer.quant_method.kernel.bind_scheme(layer.quant_method)
        load_experts(layer, scheme, w13.to(dtype), w2.to(dtype),
                     bias and tuple(t.to(dtype) for t in b))
    layer.finish_loading(torch.device(device))
    return layer


def inputs(T, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g).to(device, dtype),
            torch.randn(T, E, generator=g).to(device))


# ---- (a) the entry points ---------------------------------------------------------------------
def test_flashinfer_entry_points_take_what_the_backend_passes():
    real = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer-python is not "
                               "installed (pip install -e '.[cuda]'); it imports without a GPU")
    api = fake_flashinfer()
    for scheme, act, bias in (("unquantized", "swigluoai", True), ("unquantized", "relu2_no_mul",
                                                                   False),
                              ("fp8-block", "silu", False), ("nvfp4", "gelu", False)):
        layer = build(scheme, "torch", act, bias=bias, api=api)
        with capture_warm_up(3):
            layer(*inputs(2, 0))
    names = {n for n, _, _ in api.calls}
    assert names == {"cutlass_fused_moe", "cutlass_fused_moe_workspace_size"}
    for name, args, kwargs in api.calls:       # positions and keywords as the real functions
        inspect.signature(getattr(real, name)).bind(*args, **kwargs)
    for member in fc._ACTIVATION_TYPES.values():
        assert isinstance(getattr(real.ActivationType, member), int)
    assert "workspace_buffer" in inspect.signature(real.cutlass_fused_moe).parameters


# ---- (b) the layout conversion ----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 8), (200, 5), (3, 40, 3)])
def test_swizzle_matches_flashinfers_byte_formula(shape):
    s = (torch.rand(*shape) * 100).to(torch.float8_e4m3fn)
    z = fc.swizzle_block_scales(s)
    rows, cols = shape[-2:]
    assert z.shape[-2:] == (-(-rows // 128) * 128, -(-cols // 4) * 4)
    got = unswizzle(z.view(torch.uint8).reshape(-1, *z.shape[-2:]), rows, cols)
    assert torch.equal(got, s.view(torch.uint8).reshape(-1, rows, cols))
    padding = z.view(torch.uint8).sum() - s.view(torch.uint8).sum()
    assert padding == 0                                          # zero padding
    try:                    # FlashInfer's own pure-torch inverse, where this version ships it
        from flashinfer.trace.templates.gemm import _unswizzle_batched_sf_128x4 as inverse
    except ImportError:
        return
    batch = z.numel() // (z.shape[-2] * z.shape[-1])
    assert torch.equal(inverse(z.view(torch.uint8).reshape(-1), batch, rows, cols),
                       s.view(torch.uint8).reshape(batch, rows, cols))


@pytest.mark.parametrize("equal_globals", [True, False])
def test_nvfp4_conversion_dequantizes_to_the_same_weights(equal_globals):
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)
    up = up if equal_globals else up * 5
    q = quantize_nvfp4(torch.cat([gate, up])) if equal_globals else None
    if q is None:                                  # separately quantized: two global scales
        qg, qu = quantize_nvfp4(gate), quantize_nvfp4(up)
        q = {"weight": torch.cat([qg["weight"], qu["weight"]]),
             "weight_scale": torch.cat([qg["weight_scale"], qu["weight_scale"]]),
             "weight_scale_2": torch.stack([qg["weight_scale_2"], qu["weight_scale_2"]])}
    w2q = quantize_nvfp4(torch.randn(H, N, generator=g))
    t = {"w13_weight": q["weight"], "w13_weight_scale": q["weight_scale"],
         "w13_weight_scale_2": q["weight_scale_2"].reshape(-1).expand(2).contiguous(),
         "w2_weight": w2q["weight"], "w2_weight_scale": w2q["weight_scale"],
         "w2_weight_scale_2": w2q["weight_scale_2"].reshape(1)}
    want13, want2 = Nvfp4MoEMethod().dequantize(t, torch.float32)
    got = fc.nvfp4_to_flashinfer({n: v[None] for n, v in t.items()})        # a stack of one
    a_gs, s13 = torch.tensor(4.0), torch.tensor(0.25)                        # a_gs = 1 / s13
    w31, w2 = fi_weights(got["w13_weight"].view(torch.int64), got["w2_weight"].view(torch.int64),
                         [a_gs, got["w13_weight_scale"].view(torch.int32),
                          got["w13_weight_scale_2"][:, 0] * s13, a_gs,
                          got["w2_weight_scale"].view(torch.int32),
                          got["w2_weight_scale_2"][:, 0] * s13], False)
    want31 = torch.cat([want13[N:], want13[:N]])                             # [up; gate]
    if equal_globals:
        torch.testing.assert_close(w31[0], want31, rtol=1e-6, atol=0)
    else:       # the gate half's block scales are re-rounded to e4m3 on the up half's scale
        torch.testing.assert_close(w31[0], want31, rtol=0.07, atol=1e-3 * want31.abs().max())
    torch.testing.assert_close(w2[0], want2, rtol=1e-6, atol=0)


def test_fp8_block_and_unquantized_conversion_swap_gate_and_up():
    g = torch.Generator().manual_seed(0)
    q13, q2 = quantize_fp8(torch.randn(2 * N, H, generator=g), "block"), \
        quantize_fp8(torch.randn(H, N, generator=g), "block")
    t = {"w13_weight": q13["weight"], "w13_weight_scale_inv": q13["weight_scale_inv"],
         "w2_weight": q2["weight"], "w2_weight_scale_inv": q2["weight_scale_inv"]}
    want13, want2 = Fp8MoEMethod("block", (128, 128)).dequantize(t, torch.float32)
    got = fc.fp8_block_to_flashinfer({n: v[None] for n, v in t.items()}, "weight_scale_inv")
    w31, w2 = fi_weights(got["w13_weight"], got["w2_weight"],
                         [got["w13_weight_scale_inv"], got["w2_weight_scale_inv"]], True)
    assert torch.equal(w31[0], torch.cat([want13[N:], want13[:N]]))
    assert torch.equal(w2[0], want2)
    w, b = torch.randn(3, 2 * N, H), torch.randn(3, 2 * N)
    u = fc.unquantized_to_flashinfer({"w13_weight": w, "w13_bias": b}, gated=True)
    assert torch.equal(u["w13_weight"][:, :N], w[:, N:]) and torch.equal(u["w13_bias"][:, N:],
                                                                         b[:, :N])
    assert fc.unquantized_to_flashinfer({"w13_weight": w}, gated=False)["w13_weight"] is w


# ---- (c) the registry -------------------------------------------------------------------------
class FakeCuda(CudaPlatform):
    def __init__(self, sm: int, order=None):
        self.sm = sm
        if order is not None:
            self.moe_backends = order

    def get_device_capability(self, device=None):
        return DeviceCapability(self.sm // 10, self.sm % 10)


def query(scheme="unquantized", dtype=torch.bfloat16, platform=None, hidden=H, inter=N,
          bias=False, activation="silu"):
    return MoEKernelQuery(scheme, activation, dtype, hidden, inter,
                          platform or platform_for("cpu"), bias)


@pytest.fixture
def installed(monkeypatch):
    """flashinfer-python found by the refusal's check, installed or not (selection never
    imports it)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer" else real(name, *a))


def test_refused_on_cpu_with_a_reason():
    with pytest.raises(ValueError, match=r"'flashinfer_cutlass' cannot run .* on cpu: it runs "
                                         r"on \['cuda'\], not 'cpu'"):
        select_moe_backend(query(), "flashinfer_cutlass")


@pytest.mark.parametrize("scheme,sm,dtype", [("unquantized", 90, torch.bfloat16),
                                             ("unquantized", 120, torch.float16),
                                             ("fp8-block", 90, torch.bfloat16),
                                             ("nvfp4", 100, torch.bfloat16),
                                             ("nvfp4", 120, torch.float16)])
def test_selectable_when_forced_never_by_auto(installed, scheme, sm, dtype):
    q = query(scheme, dtype, FakeCuda(sm))
    assert select_moe_backend(q, "flashinfer_cutlass").name == "flashinfer_cutlass"
    assert select_moe_backend(q).name != "flashinfer_cutlass"
    # Even first in the platform's order, and before the torch fallback: still not auto's.
    first = query(scheme, dtype, FakeCuda(sm, ("flashinfer_cutlass",)))
    assert select_moe_backend(first).name != "flashinfer_cutlass"


def test_auto_fails_rather_than_pick_it(installed, monkeypatch):
    """The only backend able to run the layer is flashinfer_cutlass: auto refuses."""
    from vllm.model_executor.layers.backend_registry import BackendRegistry
    from vllm.model_executor.layers.fused_moe import registry
    only = BackendRegistry("MoE", "moe_backend")
    only.register(get_moe_backend("flashinfer_cutlass"))
    only.register(registry.MoEBackend("torch", get_moe_backend("torch").make,
                                      platforms=("cpu",)))
    monkeypatch.setattr(registry, "_REGISTRY", only)
    q = query("nvfp4", platform=FakeCuda(100, ("flashinfer_cutlass", "torch")))
    assert get_moe_backend("flashinfer_cutlass").refusal(q) is None
    with pytest.raises(ValueError, match=r"no MoE backend can run") as err:
        select_moe_backend(q)
    assert "flashinfer_cutlass" not in str(err.value)


@pytest.mark.parametrize("q,reason", [
    (query("nvfp4", platform=FakeCuda(90)),
     r"it runs nvfp4 on SM 100, 103, 107, 110, 120, 121, not SM 90"),
    (query("fp8-block", platform=FakeCuda(100)), r"it runs fp8-block on SM 90, not SM 100"),
    (query("fp8-block", platform=FakeCuda(120)), r"it runs fp8-block on SM 90, not SM 120"),
    (query("unquantized", platform=FakeCuda(80)), r"it runs unquantized on SM 89, 90, .*not "
                                                  r"SM 80"),
    (query("fp8-block", torch.float16, FakeCuda(90)), r"fp8-block with bfloat16 activations "
                                                      r"only"),
    (query(dtype=torch.float32, platform=FakeCuda(90)), r"it takes dtypes .*not torch.float32"),
    (query("fp8-tensor", platform=FakeCuda(90)), r"it handles schemes \['unquantized', "
                                                 r"'fp8-block', 'nvfp4', 'mxfp4', "
                                                 r"'w4a16-gptq'\], not 'fp8-tensor'"),
    (query("nvfp4", platform=FakeCuda(100), inter=64), r"nvfp4 with intermediate_size a "
                                                       r"multiple of 128, not 64"),
    (query(platform=FakeCuda(90), hidden=36), r"hidden_size a multiple of 8, not 36"),
    (query("nvfp4", platform=FakeCuda(100), bias=True), r"biases to unquantized and mxfp4 "
                                                        r"experts only"),
])
def test_refusals_name_scheme_sm_and_what_is_allowed(installed, q, reason):
    with pytest.raises(ValueError, match=r"'flashinfer_cutlass' cannot run .*" + reason):
        select_moe_backend(q, "flashinfer_cutlass")


def test_fp8_block_needs_cuda_12_8(installed, monkeypatch):
    """FlashInfer's DeepSeek FP8 block-scale GEMM raises at the first forward under older CUDA:
    the registry refuses it up front instead."""
    q = query("fp8-block", platform=FakeCuda(90))
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    with pytest.raises(ValueError, match=r"fp8-block with a CUDA 12.8 or newer build of torch, "
                                         r"not CUDA 12.6"):
        select_moe_backend(q, "flashinfer_cutlass")
    assert get_moe_backend("flashinfer_cutlass").refusal(query(platform=FakeCuda(90))) is None
    for version in ("12.8", "13.0"):
        monkeypatch.setattr(torch.version, "cuda", version)
        assert get_moe_backend("flashinfer_cutlass").refusal(q) is None


# ---- (d) the package --------------------------------------------------------------------------
def test_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)         # import and find_spec fail
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", None)
    with pytest.raises(ValueError, match=r"the flashinfer-python package is not installed \(pip "
                                         r"install flashinfer-python, or the 'cuda' extra"):
        select_moe_backend(query(platform=FakeCuda(90)), "flashinfer_cutlass")
    with pytest.raises(ImportError, match=r"needs the flashinfer-python package.*'cuda' extra"):
        get_moe_backend("flashinfer_cutlass").make(MoEActivation(), None)


def test_flashinfer_is_not_imported_by_the_registry():
    code = ("import sys, torch; import vllm.model_executor.layers.fused_moe.registry as r; "
            "from vllm.platforms import platform_for; "
            "r.select_moe_backend(r.MoEKernelQuery('unquantized', 'silu', torch.bfloat16, 128, "
            "128, platform_for('cpu'))); print('flashinfer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the pair path on CPU, through the stand-in ----------------------------------------------
@pytest.mark.parametrize("scheme,activation,bias", [
    ("unquantized", "silu", False), ("unquantized", "gelu", True),
    ("unquantized", "swigluoai", True), ("unquantized", "relu2_no_mul", False),
    ("fp8-block", "silu", False), ("nvfp4", "silu", False)])
@pytest.mark.parametrize("cache", [0, 2])
def test_layer_equals_the_torch_backend(scheme, activation, bias, cache):
    """Slot ids over 2 slots (waves) with the cache: every weight and scale read at the slot."""
    ref = build(scheme, "torch", activation, bias=bias)
    got = build(scheme, "torch", activation, cache=cache, bias=bias, api=fake_flashinfer())
    for T in (1, 5):
        x, logits = inputs(T, T)
        torch.testing.assert_close(got(x, logits), ref(x, logits), rtol=1e-4, atol=1e-5)


def test_pairs_independent_and_untouched_when_skipped():
    layer = build("unquantized", "torch", api=fake_flashinfer())
    kernel, weights = layer.quant_method.kernel, layer.weight_provider.slot_weights()
    g = torch.Generator().manual_seed(3)
    x, wts = torch.randn(5, H, generator=g), torch.rand(5, TOP_K, generator=g)
    ids = torch.randint(0, E, (5, TOP_K), generator=g)
    assert_pairs_independent(kernel, weights, x, wts, ids, E)
    out = torch.full((5, TOP_K, H), 7.0)
    kernel.apply_pairs(weights, x, wts, torch.full_like(ids, -1), out)
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_capture_warm_up_sizes_the_workspace_before_any_capture(monkeypatch):
    api = fake_flashinfer()
    layer = build("unquantized", "torch", api=api)
    with capture_warm_up(8):                         # the eager step before a capture
        layer(*inputs(2, 0))
    (_, ws_args, ws_kw), (_, warm, warm_kw) = api.calls[:2]
    assert ws_args[:5] == (8 * TOP_K, H, N, E, 1) and ws_kw["use_fused_finalize"] is False
    assert warm[0].shape == (8 * TOP_K, H) and warm_kw["workspace_buffer"].numel() >= 64 * 16
    buffer = warm_kw["workspace_buffer"]
    monkeypatch.setattr(fc, "capturing", lambda device: True)   # what a capture then calls
    del api.calls[:]
    layer(*inputs(8, 1))
    assert [n for n, _, _ in api.calls] == ["cutlass_fused_moe"]
    assert api.calls[0][2]["workspace_buffer"] is buffer
    with pytest.raises(RuntimeError, match=r"capturing 18 pair rows, but the workspace was "
                                           r"sized for 16"):
        layer(*inputs(9, 2))


def test_cuda_decode_graphs_warm_up_inside_the_seam():
    from vllm.worker.cuda_graphs import CudaDecodeGraphs
    from vllm.worker.graph_capture import EagerCapturer
    graphs = CudaDecodeGraphs(None, [1, 4, 16], 2, 32, 16, torch.device("cpu"), EagerCapturer())
    seen = []
    graphs._run = lambda P, e: seen.append((P, capture_warm_up_tokens())) or torch.zeros(P, 3)
    entry = graphs._new_entry(4)
    graphs._warm_up_and_capture(4, entry)
    entry.replay()
    assert seen == [(4, 16), (4, None)]              # eager warm-up sees the largest size


def test_bind_errors_name_what_is_missing():
    with pytest.raises(ValueError, match=r"128x128 blocks only, not \(16, 32\)"):
        fc.FlashInferCutlassExperts(MoEActivation(), fake_flashinfer()).bind_scheme(
            Fp8MoEMethod("block", (16, 32)))
    kernel = fc.FlashInferCutlassExperts(MoEActivation(), fake_flashinfer())
    kernel.bind_scheme(Nvfp4MoEMethod())
    with pytest.raises(ValueError, match=r"quantizes NVFP4 activations .*input_scale"):
        kernel.bind_shared({"w13_input_scale": torch.tensor(0.5),
                            "w2_input_scale": torch.tensor(0.0)})


# ---- (e) on a GPU -----------------------------------------------------------------------------
def gpu_layer(scheme, backend, cache=0):
    from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig,
                             SchedulerConfig, VllmConfig)
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache),
                     DeviceConfig("cuda"), kernel_config=KernelConfig(moe_backend=backend))
    return build(scheme, backend, cache=cache, dtype=torch.bfloat16, device="cuda", config=cfg)


def skip_unless_runs(scheme):
    pytest.importorskip("flashinfer.fused_moe", reason="flashinfer-python is not installed")
    reason = get_moe_backend("flashinfer_cutlass").refusal(
        query(scheme, torch.bfloat16, platform_for("cuda")))
    if reason is not None:
        pytest.skip(f"flashinfer_cutlass cannot run {scheme} on this GPU: {reason}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_matches_the_torch_backend_on_gpu(scheme):
    """FlashInfer quantizes activations for FP8 block (1x128) and NVFP4 (FP4, static scales):
    a relative error bound per scheme, not the CPU tests' equality."""
    skip_unless_runs(scheme)
    ref, got = gpu_layer(scheme, "torch"), gpu_layer(scheme, "flashinfer_cutlass")
    bound = {"unquantized": 0.02, "fp8-block": 0.06, "nvfp4": 0.25}[scheme]
    for T in (1, 7, 64):
        x, logits = inputs(T, T, torch.bfloat16, "cuda")
        want, y = ref(x, logits).float(), got(x, logits).float()
        assert ((y - want).norm() / want.norm()).item() < bound


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [0, 2])
def test_captured_in_a_cuda_graph(cache):
    """The seed crash: captured after the warm-up, replays equal eager calls."""
    skip_unless_runs("unquantized")
    layer = gpu_layer("unquantized", "flashinfer_cutlass", cache)
    if cache and layer.expert_cache.cuda_graph_refusal() is not None:
        pytest.skip(f"cached layer not capturable here: {layer.expert_cache.cuda_graph_refusal()}")
    x, logits = inputs(16, 0, torch.bfloat16, "cuda")
    with capture_warm_up(16):
        layer(x, logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = layer(x, logits)
    for seed in (1, 2):
        nx, nl = inputs(16, seed, torch.bfloat16, "cuda")
        x.copy_(nx)
        logits.copy_(nl)
        graph.replay()
        torch.testing.assert_close(static, layer(x, logits), rtol=0 if cache == 0 else 1e-2,
                                   atol=0 if cache == 0 else 1e-2)


@pytest.mark.gpu
def test_engine_decode_graphs_equal_eager_on_gpu(tiny_model_factory):
    """A tiny Qwen3-MoE forced onto flashinfer_cutlass: CUDA-graph decode gives eager's tokens."""
    from vllm import LLM, SamplingParams
    skip_unless_runs("unquantized")
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=8, enforce_eager=eager,
                  moe_backend="flashinfer_cutlass", cuda_graph_sizes=[1, 2, 4, 8])
        outs = llm.generate(["def f(", "import os", "The quick", "for i"] * 2, params)
        runs.append([o.outputs[0].token_ids for o in outs])
        if not eager:
            assert llm.llm_engine.runner.decode_graphs.refused is None
    assert runs[0] == runs[1]
