"""Quantized checkpoints through the real loader: scales land in the right experts; missing or
mis-shaped scales fail naming the tensor; dense layers stay unquantized."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.quantize_checkpoint import main as quantize_main
from vllm.kernels.cpu.ops import prepack
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.model_loader import get_model
from model_executor.tiny_checkpoints import build_checkpoint, make_vllm_config


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    build_checkpoint("Qwen3MoeForCausalLM", path, moe_intermediate_size=32)
    return path


def quantized(float_dir, tmp_path, scheme, *extra):
    out = tmp_path / scheme
    quantize_main(["--model", str(float_dir), "--out", str(out), "--scheme", scheme, *extra])
    return out


def rewrite(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


@pytest.mark.parametrize("scheme", ["fp8-channel", "fp8-block", "w4a16-gptq", "nvfp4"])
def test_loaded_expert_tensors_equal_checkpoint(float_dir, tmp_path, scheme):
    path = quantized(float_dir, tmp_path, scheme)
    cfg = make_vllm_config(path)
    cfg.kernel_config.moe_backend = "torch"      # keeps the checkpoint layout (cpu_kernel packs)
    model = get_model(cfg)
    ck = load_file(os.path.join(path, "model.safetensors"))
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(type(m.quant_method).__name__ != "UnquantizedFusedMoEMethod" for m in moe)
    layer, prefix = moe[1], "model.layers.1.mlp.experts.4"
    for n in layer.quant_method.expert_tensor_names():
        kind, suffix = n.split("_", 1)
        proj = "down_proj" if kind == "w2" else "up_proj"
        want = layer.quant_method.load_transform(suffix, kind, ck[f"{prefix}.{proj}.{suffix}"])
        got = getattr(layer, n)[4]
        got = got if kind == "w2" else got[got.shape[0] // 2:]          # up = second half
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.to(got.dtype).view(torch.uint8) if got.element_size() == 1
                           else want.to(got.dtype)), n
    # dense layers stay unquantized
    q_proj = model.model.layers[0].self_attn.q_proj
    want = ck["model.layers.0.self_attn.q_proj.weight"]
    packed = q_proj._buffers.get("packed_weight")          # the CPU kernel's layout, when used
    got, want = (packed, prepack(want)) if packed is not None else (q_proj.weight, want)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_missing_scale_named(float_dir, tmp_path):
    path = quantized(float_dir, tmp_path, "fp8-block")
    rewrite(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"experts\.3\.w3\.weight_scale_inv \(up projection of "
                                         r"expert 3\)"):
        get_model(make_vllm_config(path))


@pytest.mark.parametrize("scheme,name,bad", [
    ("fp8-channel", "model.layers.0.mlp.experts.2.down_proj.weight_scale", torch.ones(47, 1)),
    ("w4a16-gptq", "model.layers.1.mlp.experts.5.gate_proj.scales",
     torch.ones(2, 32, dtype=torch.float16)),
    ("nvfp4", "model.layers.0.mlp.experts.0.up_proj.weight_scale",
     torch.ones(32, 4).to(torch.float8_e4m3fn)),
])
def test_misshaped_scale_named(float_dir, tmp_path, scheme, name, bad):
    path = quantized(float_dir, tmp_path, scheme)
    rewrite(path, lambda t: t.__setitem__(name, bad))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        get_model(make_vllm_config(path))


def test_wrong_dtype_and_unexpected_tensor_named(float_dir, tmp_path):
    path = quantized(float_dir, tmp_path, "fp8-tensor")
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    rewrite(path, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*float8_e4m3fn"):
        get_model(make_vllm_config(path))
    path = quantized(float_dir, tmp_path / "b", "fp8-tensor")
    extra = "model.layers.0.mlp.experts.1.gate_proj.qzeros"
    rewrite(path, lambda t: t.__setitem__(extra, torch.zeros(1)))
    with pytest.raises(ValueError, match=extra.replace(".", r"\.") + ".*unexpected.*'qzeros'"):
        get_model(make_vllm_config(path))


def test_shared_input_scale_is_max_over_experts_and_stays_put(float_dir, tmp_path):
    path = quantized(float_dir, tmp_path, "nvfp4")
    vals = {}

    def add(t):
        for k in [k for k in t if k.endswith(".weight_scale_2")]:
            vals[k] = float(len(vals) % 7 + 1)
            t[k.replace("weight_scale_2", "input_scale")] = torch.tensor(vals[k])
    rewrite(path, add)
    cfg = make_vllm_config(path)
    cfg.moe_cache_config.cache_size = 2
    model = get_model(cfg)
    layer = [m for m in model.modules() if isinstance(m, FusedMoE)][0]
    want13 = max(v for k, v in vals.items() if "layers.0." in k and "down_proj" not in k)
    assert layer.w13_input_scale.item() == want13 and layer.w13_input_scale.dim() == 0
    assert "w13_input_scale" not in layer.expert_cache.names
    assert "w13_weight_scale_2" in layer.expert_cache.names      # per-expert global scale moves
