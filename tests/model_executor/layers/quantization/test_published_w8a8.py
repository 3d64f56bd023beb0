"""compressed-tensors FP8 checkpoints that declare FP8 activations, written by the library
itself (presets FP8: static per-tensor input scales; FP8_DYNAMIC: per token; FP8_BLOCK with
1 x 32 input groups), on the triton backend where the platform multiplies e4m3 (W8A8; the CPU
platform is made to claim it and the kernels run under Triton's interpreter). Each MoE layer
matches a reference written here from the format: both projections' inputs quantized to e4m3
with the scale the scheme defines, then dequantize-then-matmul in float32; and the greedy
tokens are the same with the expert cache as without."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

ct = pytest.importorskip("compressed_tensors", minversion="0.20")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationConfig,  # noqa: E402
                                             apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, ModelConfig,  # noqa: E402
                         MoECacheConfig, SchedulerConfig, VllmConfig)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE  # noqa: E402
from vllm.model_executor.model_loader import get_model  # noqa: E402
from vllm.platforms import platform_for  # noqa: E402
from model_executor.layers.quantization.published_ckpt import (  # noqa: E402
    E, IGNORE, TINY, TOP_K, greedy, save_quantized, split_experts)
from model_executor.layers.quantization.test_published_compressed_tensors import (  # noqa: E402
    _calibrate, _linear_tree, reference)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]

# case -> (library preset, weight overrides, input overrides)
CASES = {
    "fp8-tensor-static": ("FP8", {}, {}),
    "fp8-channel-token": ("FP8_DYNAMIC", {}, {}),
    "fp8-block16x32-group32": ("FP8_BLOCK", {"block_structure": [16, 32]}, {"group_size": 32}),
}
INPUT_RANGE = {"gate_proj": 4.0, "up_proj": 4.0, "down_proj": 0.5}
"""Static cases: the activation range a calibration observed per projection (random unit
inputs; the intermediate of O(0.1) weights), times 1 + expert / 10 so the layer's max over
experts is the last expert's."""


def write_with_library(src: str, out: str, preset: str, weights: dict, inputs: dict):
    """``test_published_compressed_tensors.write_with_library`` with the inputs' args
    overridden and, for static inputs, the library's ``calculate_qparams`` on INPUT_RANGE
    written as each projection's input_scale; -> (path, {module: scheme})."""
    experts, rest = split_experts(src)
    tree = _linear_tree(experts)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=weights)
    scheme.input_activations = scheme.input_activations.model_copy(update=inputs)
    apply_quantization_config(tree, QuantizationConfig(config_groups={"group_0": scheme}),
                              show_progress=False)
    schemes = {}
    for name, m in tree.named_modules():
        if hasattr(m, "quantization_scheme"):
            _calibrate(m)
            args = m.quantization_scheme.input_activations
            if not args.dynamic:
                amax = INPUT_RANGE[name.split(".")[-1]] * (1 + int(name.split(".")[-2]) / 10)
                scale, _ = calculate_qparams(torch.tensor(-amax), torch.tensor(amax), args)
                m.input_scale.data.copy_(scale.reshape(m.input_scale.shape))
            schemes[name] = m.quantization_scheme
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.quantization_config.ignore = IGNORE
    compressor.compress_model(tree)
    save_quantized(src, out, {**rest, **tree.state_dict()}, None)
    compressor.update_config(out)
    return out, schemes


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    root = tmp_path_factory.mktemp("w8a8")
    return {case: write_with_library(src, str(root / case), *CASES[case]) for case in CASES}


@pytest.fixture
def fp8_matmul(monkeypatch):
    monkeypatch.setattr(type(platform_for("cpu")), "has_fp8_matmul", lambda self, d=None: True)


def qdq(x: torch.Tensor, kind: str, group: int, static: float | None) -> torch.Tensor:
    """x [T, K] float32 rounded through e4m3: per row (and group of ``group`` columns) amax /
    448, or the static scale; x / scale clamped to +-448 and rounded, times the scale."""
    width = group if kind == "group" else x.shape[1]
    out = torch.empty_like(x)
    for c in range(0, x.shape[1], width):
        part = x[:, c:c + width]
        if static is not None:
            s = torch.full((x.shape[0], 1), static)
        else:
            s = part.abs().amax(1, keepdim=True).clamp(min=1e-10) / 448
        q = (part / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[:, c:c + width] = q.float() * s
    return out


def reference_w8a8(x, weights, ids, w, kind, group, statics):
    out = torch.zeros_like(x)
    xq = qdq(x, kind, group, statics[0])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = torch.nn.functional.silu(w(e, "gate_proj") @ xq[t]) * (w(e, "up_proj") @ xq[t])
            hq = qdq(h[None], kind, group, statics[1])[0]
            out[t] += weights[t, k] * (w(e, "down_proj") @ hq)
    return out


def _statics(path: str, layer: str, kind: str) -> tuple:
    """The layer's static input scales as the format defines them for one fused projection:
    the max over its experts (and over gate and up for w13)."""
    if kind != "tensor":
        return None, None
    t = load_file(os.path.join(path, "model.safetensors"))
    at = lambda projs: max(float(t[f"{layer}.{e}.{p}.input_scale"])           # noqa: E731
                           for e in range(E) for p in projs)
    return at(("gate_proj", "up_proj")), at(("down_proj",))


@pytest.mark.parametrize("case", list(CASES))
def test_layers_match_the_w8a8_reference(checkpoints, fp8_matmul, case):
    path, schemes = checkpoints[case]
    acts = json.load(open(os.path.join(path, "config.json")))["quantization_config"][
        "config_groups"]["group_0"]["input_activations"]
    kind = "tensor" if not acts["dynamic"] else acts["strategy"]
    group = acts["group_size"] or 0
    model = get_model(VllmConfig(ModelConfig(path, dtype="float32"), CacheConfig(),
                                 SchedulerConfig(), MoECacheConfig(), DeviceConfig("cpu"),
                                 kernel_config=KernelConfig(moe_backend="triton")))
    dequant = reference(path, schemes)
    g = torch.Generator().manual_seed(0)
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)):
        x = torch.randn(12, layer.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(12)])
        weights = torch.rand(12, TOP_K, generator=g)
        got = layer.forward_experts(x, weights, ids)
        assert layer.quant_method.kernel.quantizes_inputs(torch.device("cpu")) is True
        want = reference_w8a8(x, weights, ids, lambda e, p: dequant(f"{name}.{e}.{p}").float(),
                              kind, group, _statics(path, name, kind))
        # An intermediate element near the midpoint of two e4m3 values may round the other way
        # (fp32 sums in another order): rare, and one element's step.
        off = ~torch.isclose(got, want, rtol=1e-4, atol=1e-5)
        assert off.float().mean() <= 0.02, f"{name}: {int(off.sum())} of {off.numel()}"
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", list(CASES))
def test_cache_equals_no_cache(checkpoints, fp8_matmul, case):
    path = checkpoints[case][0]
    want, llm = greedy(path, moe_backend="triton")
    assert all(m.quant_method.kernel.quantizes_inputs(torch.device("cpu"))
               for m in llm.llm_engine.runner.moe_layers)
    got, llm = greedy(path, moe_backend="triton", moe_expert_cache_size=TOP_K)
    assert got == want and llm.get_moe_cache_stats()["misses"] > 0
