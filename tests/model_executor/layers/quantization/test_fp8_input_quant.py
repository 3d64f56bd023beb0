"""A static per-tensor fp8 activation scheme through the real loader: the checkpoint's
input_scale is required (missing -> error naming it) and lands as the max over experts."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.quantize_checkpoint import main as quantize_main
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.model_loader import get_model
from model_executor.tiny_checkpoints import build_checkpoint, make_vllm_config

STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
          "dynamic": False, "observer": "static_minmax"}
PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def static_fp8(tmp_path_factory):
    """fp8-tensor experts whose config declares static per-tensor activations; no input_scale."""
    src, out = tmp_path_factory.mktemp("float"), tmp_path_factory.mktemp("fp8") / "ck"
    build_checkpoint("Qwen3MoeForCausalLM", src, moe_intermediate_size=32)
    quantize_main(["--model", str(src), "--out", str(out), "--scheme", "fp8-tensor"])
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = STATIC
    cfg_path.write_text(json.dumps(cfg))
    return out


def test_static_input_scale_missing_is_named(static_fp8):
    with pytest.raises(ValueError, match=r"lacks .*experts\.0\.w1\.input_scale \(gate projection "
                                         r"of expert 0\)"):
        get_model(make_vllm_config(static_fp8))


def test_static_input_scale_loads_as_max_over_experts(static_fp8, tmp_path):
    f = os.path.join(static_fp8, "model.safetensors")
    tensors = load_file(f)
    experts = sorted({n.rsplit(".", 2)[0] for n in tensors if ".mlp.experts." in n})
    # one small value per projection, then the peaks of layer 1's w13 and w2
    for i, e in enumerate(experts):
        for j, p in enumerate(PROJS):
            tensors[f"{e}.{p}.input_scale"] = torch.tensor(0.01 * i + 0.001 * j)
    tensors["model.layers.1.mlp.experts.2.up_proj.input_scale"] = torch.tensor(0.75)
    tensors["model.layers.1.mlp.experts.5.down_proj.input_scale"] = torch.tensor(0.5)
    out = tmp_path / "with_scale"
    out.mkdir()
    for name in os.listdir(static_fp8):
        if name != "model.safetensors":
            (out / name).write_bytes((static_fp8 / name).read_bytes())
    save_file(tensors, str(out / "model.safetensors"))
    model = get_model(make_vllm_config(out))
    layer = [m for m in model.modules() if isinstance(m, FusedMoE)][1]
    assert isinstance(layer.quant_method, Fp8MoEMethod)
    assert layer.quant_method.input_quant == "tensor"
    assert float(layer.w13_input_scale) == 0.75 and float(layer.w2_input_scale) == 0.5
