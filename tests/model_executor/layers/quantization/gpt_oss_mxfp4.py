"""A tiny GPT-OSS with MXFP4 experts in the published layout, written here from the format (not
with the project's quantizer), for the tests that run it through the engine (the C kernel's,
tests/kernels/cpu/test_moe_quant_e2e.py; Triton's, tests/.../test_triton_backend_fp4.py)."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def mxfp4_round(w):
    """MXFP4 of weights [..., out, in] in GPT-OSS's published layout, written from the format:
    blocks uint8 [..., out, in/32, 16] (code 2j of a 32-input block in the low nibble of byte
    j), e8m0 scales [..., out, in/32] = 2^ceil(log2(amax / 6)) + 127, e2m1 by nearest
    magnitude (ties to the smaller)."""
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2.0 ** -60) / 6))
    v = blocks / 2.0 ** exp[..., None]
    idx = (v.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    codes = idx + 8 * ((v < 0) & (idx > 0))                          # [..., in/32, 32]
    return {"blocks": (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8),
            "scales": (exp + 127).to(torch.uint8)}


def gpt_oss_mxfp4(src, path):
    """The tiny GPT-OSS at ``src`` with its experts rounded by ``mxfp4_round`` (rows =
    outputs, gate/up interleaved as published) and random bf16 biases."""
    shutil.copytree(src, path)
    g = torch.Generator().manual_seed(0)
    state = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        q = mxfp4_round(state.pop(name).float().transpose(1, 2))      # HF: [E, in, out]
        state[name + "_blocks"], state[name + "_scales"] = q["blocks"], q["scales"]
        state[name + "_bias"] = (torch.randn(state[name + "_bias"].shape, generator=g)
                                 * 0.1).bfloat16()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = MXFP4_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
