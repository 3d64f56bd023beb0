"""FP8 checkpoints that quantize every linear, as published FP8 releases do (Qwen3's and
DeepSeek-V3's FP8 checkpoints: attention projections too, block scales; compressed-tensors FP8:
per-channel scales), for a tiny random Qwen3-MoE: the experts load through the FP8 scheme and
the dense FP8 linears are dequantized at load (``fp8_dense.dense_fp8_weights``, in every
model's loader). Written by transformers' own ``Fp8Quantize`` and by compressed-tensors itself;
the reference is transformers run on a float32 copy whose weights the test dequantizes from
the writer's codes and scales."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.model_loader import get_model
from model_executor.layers.quantization.published_ckpt import TINY
from model_executor.tiny_checkpoints import PagedDriver, hf_logits, make_vllm_config

QUANTIZED = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
             "_proj.weight")
"""Every ``*_proj`` linear: attention and experts (the router ``mlp.gate``, embeddings and
lm_head stay in the model dtype, as in the published checkpoints)."""


def _save(path: str, tensors: dict, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def write_hf_fp8_block(src: str, out: str, ref: str) -> None:
    """transformers' ``Fp8Quantize`` (16 x 32 blocks) on every ``*_proj`` weight -> ``out``;
    the same weights dequantized here (code * scale_inv of its block) -> ``ref``."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    cfg = transformers.FineGrainedFP8Config(weight_block_size=(16, 32),
                                            modules_to_not_convert=["lm_head"])
    op = Fp8Quantize(SimpleNamespace(quantization_config=cfg))
    config = json.load(open(os.path.join(src, "config.json")))
    q, r = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if not name.endswith(QUANTIZED):
            q[name] = r[name] = t
            continue
        ck = op._quantize_one(name, t.float())
        codes, inv = ck[name], ck[name + "_scale_inv"].float()
        assert codes.dtype == torch.float8_e4m3fn
        q.update(ck)
        full = inv.repeat_interleave(16, 0)[:t.shape[0]].repeat_interleave(32, 1)[:, :t.shape[1]]
        r[name] = codes.float() * full
    qc = {k: (v.value if hasattr(v, "value") else v) for k, v in cfg.to_dict().items()}
    _save(out, q, {**config, "quantization_config": qc})
    _save(ref, r, {**config, "torch_dtype": "float32"})


def write_ct_fp8_channel(src: str, out: str, ref: str) -> None:
    """compressed-tensors' FP8_DYNAMIC (per-channel weights) on every ``*_proj`` weight,
    through the library's ``apply_quantization_config`` and ``ModelCompressor``."""
    pytest.importorskip("compressed_tensors", minversion="0.20")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from model_executor.layers.quantization.test_published_compressed_tensors import (
        _calibrate, _linear_tree)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    linears = {n[:-len(".weight")]: t for n, t in tensors.items() if n.endswith(QUANTIZED)}
    tree = _linear_tree(linears)
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    apply_quantization_config(tree, QuantizationConfig(config_groups={"group_0": scheme}),
                              show_progress=False)
    for m in tree.modules():
        if hasattr(m, "quantization_scheme"):
            _calibrate(m)
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.quantization_config.ignore = ["lm_head", "re:.*mlp\\.gate$"]
    compressor.compress_model(tree)
    state = tree.state_dict()
    rest = {n: t for n, t in tensors.items() if not n.endswith(QUANTIZED)}
    config = json.load(open(os.path.join(src, "config.json")))
    _save(out, {**rest, **state}, config)
    compressor.update_config(out)
    deq = {f"{m}.weight": state[f"{m}.weight"].float() * state[f"{m}.weight_scale"].float()
           for m in linears}                                  # [out, in] * [out, 1]
    _save(ref, {**rest, **deq}, {**config, "torch_dtype": "float32"})


@pytest.mark.parametrize("writer", [write_hf_fp8_block, write_ct_fp8_channel],
                         ids=["hf-fp8-block", "ct-fp8-channel"])
def test_every_linear_fp8_matches_transformers(tiny_model_factory, tmp_path, writer):
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    writer(src, str(tmp_path / "fp8"), str(tmp_path / "ref"))
    names = load_file(str(tmp_path / "fp8" / "model.safetensors")).keys()
    assert any(n.endswith("self_attn.q_proj.weight_scale" + ("_inv" if "hf" in writer.__name__
                                                            else "")) for n in names)
    model = get_model(make_vllm_config(tmp_path / "fp8"))
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(isinstance(m.quant_method, Fp8MoEMethod) for m in moe)
    dense = {n: p for n, p in model.named_parameters() if "self_attn" in n}
    assert dense and all(p.dtype == torch.float32 for p in dense.values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ref"), dtype=torch.float32, attn_implementation="eager").eval()
    drv = PagedDriver(model)
    g = torch.Generator().manual_seed(3)
    for i in range(3):
        prompt = torch.randint(3, 200, (int(5 + 4 * i),), generator=g).tolist()
        got = drv.step([(str(i), prompt)])[str(i)]
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)
