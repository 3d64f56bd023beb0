"""The "triton" MoE backend on FP8 experts whose checkpoint declares FP8 activations
(``Fp8MoEMethod.input_quant``): W8A8 (``kernels/triton/fused_moe_w8a8.py``) where the platform
multiplies e4m3 operands (``Platform.has_fp8_matmul``: CUDA SM 8.9+), weight-only elsewhere.
CPU has no FP8 matrix units, so these tests make the CPU platform claim them and run the
kernels under Triton's interpreter. The kernels' arithmetic is checked against a reference in
tests/kernels/triton/test_fused_moe_w8a8.py; here, the wiring: which path runs, the static
scales read from the layer's shared tensors, and outputs bitwise equal with and without the
expert cache, for a layer and for a tiny model through the engine."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod, quantize_fp8
from vllm.platforms import platform_for
from greedy_runs import greedy_run
from test_triton_backend_quant import TOP_K, batches, load_layer

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]

# name -> (method factory, quantizer of one [out, in] weight); H = 40, N = 24 (the layer
# helper's): w13's inputs span two 32-column groups and scale blocks, w2's fit in one.
W8A8_SCHEMES = {
    "block16x32-group32": (lambda: Fp8MoEMethod("block", (16, 32), input_quant="group",
                                                input_group=32),
                           lambda w: quantize_fp8(w, "block", (16, 32))),
    "channel-token": (lambda: Fp8MoEMethod("channel", input_quant="token"),
                      lambda w: quantize_fp8(w, "channel")),
    "tensor-static": (lambda: Fp8MoEMethod("tensor", input_quant="tensor"),
                      lambda w: quantize_fp8(w, "tensor")),
}
STATIC_SCALE = 3.0 / 448
"""input_scale of every expert projection in "tensor-static" (a calibration's amax / 448)."""


def load(scheme, backend, cache_size=0, static_scale=STATIC_SCALE):
    """``load_layer``; a static scheme's input scales are given to the layer as the model
    loader gives them (``load_shared``: max over experts), before its kernels bind them."""
    make, quantize = W8A8_SCHEMES[scheme]
    method = make()
    if method.input_quant == "tensor":
        finish = method.create_weights

        def create_weights(layer, *args, **kw):
            finish(layer, *args, **kw)
            for e in range(3):                   # a few experts, one value: the max is it
                for kind in ("w13", "w2"):
                    method.load_shared(layer, f"{kind}_input_scale",
                                       torch.tensor([static_scale * (e + 1) / 3]))
        method.create_weights = create_weights
    return load_layer(method, quantize, backend, cache_size)


@pytest.fixture
def fp8_matmul(monkeypatch):
    """The CPU platform claims FP8 matrix units (as CUDA SM 8.9+ does)."""
    monkeypatch.setattr(type(platform_for("cpu")), "has_fp8_matmul", lambda self, d=None: True)


def test_cpu_has_no_fp8_matmul():
    assert not platform_for("cpu").has_fp8_matmul()


def outputs(layer):
    return [layer(x, lg) for x, lg in batches()]


@pytest.mark.parametrize("scheme", list(W8A8_SCHEMES))
def test_w8a8_where_the_platform_has_fp8_matmul(scheme, monkeypatch):
    """Weight-only by default on CPU: the triton layer equals the torch backend's (which never
    quantizes activations). With FP8 matrix units: W8A8, close to weight-only (activations
    rounded to e4m3 per row) but not equal, and bitwise the same with the expert cache (at 1 and
    top_k slots)."""
    weight_only = outputs(load(scheme, "triton"))
    for got, want in zip(weight_only, outputs(load(scheme, "torch"))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(type(platform_for("cpu")), "has_fp8_matmul", lambda self, d=None: True)
    layer = load(scheme, "triton")
    w8a8 = outputs(layer)
    assert layer.quant_method.kernel._w8a8[torch.device("cpu")] is not None
    for got, want in zip(w8a8, weight_only):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.1)
        assert not torch.equal(got, want)
    for cache_size in (1, TOP_K):            # N < top_k: every step takes several waves
        cached = load(scheme, "triton", cache_size=cache_size)
        assert cached.expert_cache is not None
        for got, want in zip(outputs(cached), w8a8):
            assert torch.equal(got, want), f"cache size {cache_size}"


def test_the_path_is_logged_once(fp8_matmul, vllm_log):
    for _ in range(2):
        outputs(load("block16x32-group32", "triton"))
    says = [r.getMessage() for r in vllm_log.records if "run W8A8" in r.getMessage()]
    assert says == ["triton MoE: FP8 experts run W8A8 on cpu, activations quantized to e4m3 "
                    "per token and 32 columns as the checkpoint declares"]


def test_static_scale_comes_from_the_checkpoint(fp8_matmul):
    """input_quant "tensor": the kernels read the layer's loaded input scales (max over
    experts); a scale small enough to clamp most inputs at 448 changes the output."""
    layer = load("tensor-static", "triton")
    s13, s2 = layer.quant_method.kernel._static
    assert s13.item() == s2.item() == pytest.approx(STATIC_SCALE)
    base = outputs(layer)
    clamped = outputs(load("tensor-static", "triton", static_scale=0.01 / 448))
    for got, want in zip(clamped, base):
        assert not torch.allclose(got, want, atol=1e-2, rtol=1e-2)


def test_static_scheme_without_a_positive_scale_runs_weight_only(fp8_matmul, vllm_log):
    layer = load("tensor-static", "triton", static_scale=0.0)
    got = outputs(layer)
    assert layer.quant_method.kernel.quantizes_inputs(torch.device("cpu")) is False
    assert "static input_scale is missing or not positive" in vllm_log.text
    for g, w in zip(got, outputs(load("tensor-static", "torch"))):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_unaligned_blocks_run_weight_only(fp8_matmul, vllm_log):
    """A weight block width no K block of at least 32 divides: logged, and weight-only."""
    make = lambda: Fp8MoEMethod("block", (16, 24), input_quant="group", input_group=24)
    quantize = lambda w: quantize_fp8(w, "block", (16, 24))
    layer = load_layer(make(), quantize, "triton")
    got = outputs(layer)
    assert layer.quant_method.kernel._w8a8[torch.device("cpu")] is None
    assert "run weight-only (W8A16)" in vllm_log.text
    for g, w in zip(got, outputs(load_layer(make(), quantize, "torch"))):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def fp8_block_model(tiny_model_factory, tmp_path_factory):
    """A tiny Qwen3-MoE quantized to HF "fp8" with 16 x 32 blocks and activation_scheme
    "dynamic" (per token and 1 x 32 group, as DeepSeek-V3's 1 x 128)."""
    from tools.quantize_checkpoint import main as quantize_main
    src = tiny_model_factory("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    path = str(tmp_path_factory.mktemp("fp8-block-w8a8"))
    quantize_main(["--model", src, "--out", path, "--scheme", "fp8-block", "--block-size",
                   "16", "32"])
    return path


def test_tiny_model_w8a8_equal_with_and_without_the_cache(fp8_matmul, fp8_block_model):
    ref, ref_lp, backends, llm = greedy_run(fp8_block_model, moe_backend="triton")
    assert backends == {"triton"}
    assert all(m.quant_method.kernel._w8a8[torch.device("cpu")] is not None
               for m in llm.llm_engine.runner.moe_layers)
    got, got_lp, _, llm = greedy_run(fp8_block_model, moe_backend="triton",
                                     moe_expert_cache_size=TOP_K)
    assert llm.get_moe_cache_stats()["misses"] > 0
    assert got == ref and got_lp == ref_lp


def test_quantize_inputs_false_keeps_weight_only(fp8_matmul):
    """``TritonExperts.quantize_inputs = False`` (benchmark_quantization's weight-only rows):
    bf16/f32 activations even where the platform has FP8 matrix units."""
    layer = load("channel-token", "triton")
    layer.quant_method.kernel.quantize_inputs = False
    for got, want in zip(outputs(layer), outputs(load("channel-token", "torch"))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert layer.quant_method.kernel.quantizes_inputs(torch.device("cpu")) is False


def test_quantizes_inputs_matches_a_device_without_an_index(fp8_matmul):
    """The runner asks with its ``cuda``; the calls decided on ``cuda:0`` (their tensors'
    device). Asked with the bare name, the H100 run (2026-11-27) labelled its W8A8 rows
    weight-only. Here the decision is moved to a ``cuda:0`` key, as a GPU's calls store it."""
    kernel = load("block16x32-group32", "triton").quant_method.kernel
    assert kernel.quantizes_inputs(torch.device("cuda")) is None      # nothing decided yet
    kernel._w8a8[torch.device("cuda", 0)] = ("w13", "w2")
    assert kernel.quantizes_inputs(torch.device("cuda")) is True
    assert kernel.quantizes_inputs(torch.device("cuda", 0)) is True
    assert kernel.quantizes_inputs(torch.device("cuda", 1)) is None
    kernel._w8a8[torch.device("cuda", 0)] = None                      # decided: weight-only
    assert kernel.quantizes_inputs(torch.device("cuda")) is False
