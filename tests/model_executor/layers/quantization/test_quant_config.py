"""quantization_config parsing (as the public tools write it) and the method chosen per layer."""
import json
from types import SimpleNamespace

import pytest

from vllm.config.quantization import (INPUT_QUANTS, QuantConfig, parse_quant_config,
                                      quant_config_from_model_dir)
from vllm.model_executor.layers.quantization import get_moe_quant_method
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod
from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod

LAYER = SimpleNamespace(prefix="model.layers.1.mlp.experts")


def ct(strategy, **extra):
    w = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, **extra}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_compressed_tensors_fp8(strategy):
    qc = parse_quant_config(ct(strategy))
    assert qc.scheme == f"fp8-{strategy}"
    m = get_moe_quant_method(qc, LAYER)
    assert isinstance(m, Fp8MoEMethod) and m.strategy == strategy and m.scale_name == "weight_scale"
    assert qc.is_ignored("model.layers.0.mlp.gate") and not qc.is_ignored(LAYER.prefix)


def test_compressed_tensors_block_uses_weight_scale():
    m = get_moe_quant_method(parse_quant_config(ct("block", block_structure=[128, 128])), LAYER)
    assert m.block == (128, 128) and m.scale_name == "weight_scale"


def test_hf_fp8_block_and_per_tensor():
    qc = parse_quant_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})
    m = get_moe_quant_method(qc, LAYER)
    assert qc.scheme == "fp8-block" and m.block == (128, 128) and m.scale_name == "weight_scale_inv"
    assert parse_quant_config({"quant_method": "fp8"}).scheme == "fp8-tensor"


def test_gptq():
    qc = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False,
                             "desc_act": True, "checkpoint_format": "gptq_v2"})
    m = get_moe_quant_method(qc, LAYER)
    assert isinstance(m, GptqMoEMethod)
    assert (m.group_size, m.sym, m.desc_act, m.zero_offset) == (64, False, True, 0)
    assert [c.suffix for c in m.checkpoint_tensors if c.required] == ["qweight", "qzeros",
                                                                       "scales", "g_idx"]


def test_modelopt_nvfp4_in_config_and_hf_quant_config(tmp_path):
    qc = parse_quant_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                             "exclude_modules": ["lm_head"]})
    assert isinstance(get_moe_quant_method(qc, LAYER), Nvfp4MoEMethod)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                         "exclude_modules": ["model.layers.1.mlp.experts*"]}}))
    qc = quant_config_from_model_dir(str(tmp_path))
    assert qc.scheme == "nvfp4" and get_moe_quant_method(qc, LAYER) is None     # excluded experts


def _ct_group(weights, fmt, acts=None):
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts, "format": fmt}},
            "ignore": ["lm_head"]}


@pytest.mark.parametrize("strategy,group_size,sym,want_gs", [
    ("group", 32, True, 32), ("group", 128, False, 128), ("channel", None, False, -1)])
def test_compressed_tensors_pack_quantized_maps_to_gptq_layout(strategy, group_size, sym,
                                                               want_gs):
    from vllm.model_executor.layers.quantization.compressed_tensors import (
        CompressedTensorsW4A16MoEMethod)
    w = {"num_bits": 4, "type": "int", "strategy": strategy, "group_size": group_size,
         "symmetric": sym}
    qc = parse_quant_config(_ct_group(w, "pack-quantized"))
    assert (qc.scheme, qc.quant_method, qc.group_size, qc.sym) == (
        "w4a16-gptq", "compressed-tensors", want_gs, sym)
    m = get_moe_quant_method(qc, LAYER)
    assert isinstance(m, CompressedTensorsW4A16MoEMethod) and m.zero_offset == 0
    assert [c.suffix for c in m.checkpoint_tensors if c.required] == (
        ["weight_packed", "weight_scale"] + ([] if sym else ["weight_zero_point"]))
    with pytest.raises(ValueError, match="quantized activations.*W4A16"):
        parse_quant_config(_ct_group(w, "pack-quantized", acts={"num_bits": 8, "type": "int"}))


def test_compressed_tensors_nvfp4_maps_to_nvfp4_layout():
    from vllm.model_executor.layers.quantization.compressed_tensors import (
        CompressedTensorsNvfp4MoEMethod)
    w = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    qc = parse_quant_config(_ct_group(w, "nvfp4-pack-quantized"))
    assert qc.scheme == "nvfp4"
    assert isinstance(get_moe_quant_method(qc, LAYER), CompressedTensorsNvfp4MoEMethod)
    w32 = dict(w, group_size=32, strategy="group")                      # MXFP4A16: not mapped
    with pytest.raises(ValueError, match="format='mxfp4-pack-quantized'"):
        parse_quant_config(_ct_group(w32, "mxfp4-pack-quantized"))


def test_unquantized_checkpoint_gives_none(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert quant_config_from_model_dir(str(tmp_path)) is None


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'.*gptq"),
    ({"quant_method": "gptq", "bits": 8}, "bits=8.*bits 4"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo='FP8'.*NVFP4"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}}, "type='int' num_bits=4"),
])
def test_unsupported_configs_named(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_quant_config(qc)


# ---- activation (input) quantization of fp8 checkpoints -------------------------------------
def ct_acts(acts, strategy="channel"):
    qc = ct(strategy)
    qc["config_groups"]["group_0"]["input_activations"] = acts
    return qc


def fp8_acts(strategy, dynamic, **extra):
    return {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
            "dynamic": dynamic, **extra}


@pytest.mark.parametrize("acts,want", [
    (fp8_acts("token", True), ("token", 0)),
    (fp8_acts("tensor", True), ("token", 0)),          # per token: finer, batch-independent
    (fp8_acts("group", True, group_size=128), ("group", 128)),
    (fp8_acts("tensor", False), ("tensor", 0)),
    (None, (None, 0)),
    ({}, (None, 0)),
])
def test_compressed_tensors_fp8_input_activations(acts, want):
    qc = parse_quant_config(ct_acts(acts))
    assert (qc.scheme, qc.input_quant, qc.input_group) == ("fp8-channel", *want)
    m = get_moe_quant_method(qc, LAYER)
    assert isinstance(m, Fp8MoEMethod) and (m.input_quant, m.input_group) == want
    required = {c.suffix: c.required for c in m.checkpoint_tensors}
    assert required["input_scale"] is (want[0] == "tensor")
    assert required["weight"] and required["weight_scale"]


@pytest.mark.parametrize("acts,match", [
    ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
     "type='int' num_bits=8.*8-bit float activations"),
    (fp8_acts("token", False), "static input_activations strategy='token'"),
    (fp8_acts("channel", True), "dynamic input_activations strategy='channel'"),
    (fp8_acts("group", True), "group_size=None.*positive int"),
    (fp8_acts("group", True, group_size=0), "group_size=0"),
    (fp8_acts("tensor", "local"), "dynamic='local'"),
    (fp8_acts("token", True, symmetric=False), "asymmetric"),
])
def test_compressed_tensors_unsupported_input_activations(acts, match):
    with pytest.raises(ValueError, match=match):
        parse_quant_config(ct_acts(acts))


def hf_fp8(**kw):
    return {"quant_method": "fp8", "modules_to_not_convert": ["lm_head"], **kw}


@pytest.mark.parametrize("qc,want", [
    (hf_fp8(activation_scheme="dynamic", weight_block_size=[128, 64]), ("group", 64)),
    (hf_fp8(activation_scheme="dynamic"), ("token", 0)),
    (hf_fp8(weight_block_size=[128, 64]), ("group", 64)),      # absent: dynamic
    (hf_fp8(), ("token", 0)),
    (hf_fp8(activation_scheme="static"), ("tensor", 0)),
])
def test_hf_fp8_activation_scheme(qc, want):
    parsed = parse_quant_config(qc)
    assert (parsed.input_quant, parsed.input_group) == want
    m = get_moe_quant_method(parsed, LAYER)
    assert (m.input_quant, m.input_group) == want
    assert m.block == (tuple(qc["weight_block_size"]) if "weight_block_size" in qc else None)
    assert {c.suffix: c.required for c in m.checkpoint_tensors}["input_scale"] is (
        want[0] == "tensor")


@pytest.mark.parametrize("qc,match", [
    (hf_fp8(activation_scheme="static", weight_block_size=[128, 128]), "'static'.*block"),
    (hf_fp8(activation_scheme="per_token"), "activation_scheme='per_token'.*dynamic, static"),
])
def test_hf_fp8_unsupported_activation_scheme(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_quant_config(qc)


def test_describe_names_input_quant():
    assert "per 1x64 group" in parse_quant_config(
        hf_fp8(weight_block_size=[128, 64])).describe()
    assert "per token" in parse_quant_config(hf_fp8()).describe()
    assert "static per tensor" in parse_quant_config(hf_fp8(activation_scheme="static")).describe()
    assert "inputs" not in parse_quant_config(ct("tensor")).describe()


@pytest.mark.parametrize("kw,match", [
    (dict(input_quant="channel"), r"input_quant='channel'.*\['token', 'group', 'tensor'\]"),
    (dict(input_quant="group"), "input_group=0.*positive"),
    (dict(input_quant="group", input_group=-128), "input_group=-128"),
    (dict(input_quant="token", input_group=128), "input_group=128.*'token'"),
    (dict(input_group=64), "input_group=64.*None"),
])
def test_input_quant_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig("fp8-tensor", "fp8", **kw)
    with pytest.raises(ValueError, match=match):
        Fp8MoEMethod("tensor", **kw)


def test_input_quant_only_for_fp8_schemes():
    with pytest.raises(ValueError, match="input_quant='token'.*'w4a16-gptq'.*fp8"):
        QuantConfig("w4a16-gptq", "gptq", input_quant="token")
    assert INPUT_QUANTS == ("token", "group", "tensor")


def test_fp8_method_without_quant_config():
    m = Fp8MoEMethod("block", (128, 128), input_quant="group", input_group=128)
    assert (m.input_quant, m.input_group, m.strategy) == ("group", 128, "block")
    m = Fp8MoEMethod("channel")
    assert (m.input_quant, m.input_group) == (None, 0)
    assert not {c.suffix: c.required for c in m.checkpoint_tensors}["input_scale"]


@pytest.mark.parametrize("preset,want", [
    ("FP8_DYNAMIC", ("fp8-channel", "token", 0)),
    ("FP8", ("fp8-tensor", "tensor", 0)),
    ("FP8_BLOCK", ("fp8-block", "group", 128)),
])
def test_compressed_tensors_library_presets(tmp_path, preset, want):
    """quantization_config as the library itself writes it into config.json."""
    pytest.importorskip("compressed_tensors", minversion="0.20")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])})
    ModelCompressor(quantization_config=cfg).update_config(str(tmp_path))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    parsed = parse_quant_config(qc)
    assert (parsed.scheme, parsed.input_quant, parsed.input_group) == want
    m = get_moe_quant_method(parsed, LAYER)
    assert (m.input_quant, m.input_group) == want[1:]
