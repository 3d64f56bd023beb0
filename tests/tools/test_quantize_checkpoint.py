"""tools/quantize_checkpoint.py: output layout and configs as the public tools write them."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.quantize_checkpoint import main as quantize_main
from vllm.config.quantization import quant_config_from_model_dir
from tiny_models import build_tiny_model

SUFFIXES = {"fp8-tensor": {"weight", "weight_scale"}, "fp8-channel": {"weight", "weight_scale"},
            "fp8-block": {"weight", "weight_scale_inv"},
            "w4a16-gptq": {"qweight", "qzeros", "scales", "g_idx"},
            "nvfp4": {"weight", "weight_scale", "weight_scale_2"}}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    build_tiny_model("Qwen3MoeForCausalLM", path, moe_intermediate_size=32)
    return path


@pytest.mark.parametrize("scheme", list(SUFFIXES))
def test_layout_configs_and_copies(src, tmp_path, scheme):
    out = tmp_path / "q"
    summary = quantize_main(["--model", str(src), "--out", str(out), "--scheme", scheme])
    before = load_file(os.path.join(src, "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
    experts = [k for k in before if ".experts." in k]
    assert summary["expert_projections_quantized"] == len(experts) == 2 * 6 * 3
    for k in experts:
        module = k[:-len(".weight")]
        assert {n[len(module) + 1:] for n in after if n.startswith(module + ".")} == SUFFIXES[scheme]
    dense = {k: v for k, v in before.items() if ".experts." not in k}
    assert all(torch.equal(after[k], v) for k, v in dense.items())          # copied unchanged
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    ignore = qc.get("ignore") or qc.get("modules_to_not_convert") or qc.get("exclude_modules")
    assert "lm_head" in ignore and "model.layers.0.mlp.gate" in ignore
    assert "model.layers.1.self_attn.o_proj" in ignore
    assert not any(".experts." in m for m in ignore)
    assert {k for k in cfg if k != "quantization_config"} == set(
        json.loads((src / "config.json").read_text()))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    parsed = quant_config_from_model_dir(str(out))
    assert parsed.scheme == scheme
    if scheme == "nvfp4":
        hq = json.loads((out / "hf_quant_config.json").read_text())
        assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
    if scheme == "fp8-block":
        assert qc["weight_block_size"] == [128, 128] and qc["quant_method"] == "fp8"
    if scheme.startswith("fp8-") and scheme != "fp8-block":
        w = qc["config_groups"]["group_0"]["weights"]
        assert (qc["quant_method"], w["type"], w["num_bits"], w["strategy"]) == (
            "compressed-tensors", "float", 8, scheme[4:])


def test_gptq_options_written(src, tmp_path):
    out = tmp_path / "g"
    quantize_main(["--model", str(src), "--out", str(out), "--scheme", "w4a16-gptq",
                   "--group-size", "32", "--asym", "--desc-act"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 32, False, True)
    t = load_file(os.path.join(out, "model.safetensors"))
    g = t["model.layers.0.mlp.experts.0.gate_proj.g_idx"]
    assert g.dtype == torch.int32 and g.shape == (48,) and not torch.equal(
        g, torch.arange(48, dtype=torch.int32) // 32)


def test_fused_expert_input_gives_same_output(src, tmp_path):
    """transformers >= 5 in-memory layout (experts.gate_up_proj [E, 2N, H], experts.down_proj
    [E, H, N]) quantizes to the same per-expert tensors as the per-expert layout."""
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in os.listdir(src):
        if f != "model.safetensors":
            (fused_dir / f).write_bytes((src / f).read_bytes())
    t = load_file(os.path.join(src, "model.safetensors"))
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts"
        t[f"{p}.gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"),
                                                         t.pop(f"{p}.{e}.up_proj.weight")])
                                              for e in range(6)])
        t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(6)])
    save_file(t, os.path.join(fused_dir, "model.safetensors"))
    a, b = tmp_path / "a", tmp_path / "b"
    quantize_main(["--model", str(src), "--out", str(a), "--scheme", "nvfp4"])
    quantize_main(["--model", str(fused_dir), "--out", str(b), "--scheme", "nvfp4"])
    ta, tb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k].view(torch.uint8) if ta[k].element_size() == 1 else ta[k],
                           tb[k].view(torch.uint8) if tb[k].element_size() == 1 else tb[k])
               for k in ta)


def test_refuses_quantized_input(src, tmp_path):
    out = tmp_path / "q"
    quantize_main(["--model", str(src), "--out", str(out), "--scheme", "fp8-tensor"])
    with pytest.raises(SystemExit):
        quantize_main(["--model", str(out), "--out", str(tmp_path / "qq"), "--scheme", "nvfp4"])
