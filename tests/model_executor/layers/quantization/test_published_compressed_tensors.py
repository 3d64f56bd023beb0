"""compressed-tensors checkpoints written by the library itself (its QuantizationConfig presets,
``apply_quantization_config``, ``calculate_qparams`` / ``generate_gparam`` and
``ModelCompressor``; min-max observation here, as llm-compressor's weight observer does), for a
tiny random Qwen3-MoE's experts: FP8 tensor / channel / block, W4A16 pack-quantized (group
sizes 16 and 32, symmetric and asymmetric, channel) and NVFP4 pack-quantized. Each loads
through our loader and matches a dequantize-then-matmul reference written here from the format
(and checked against the library's own decompressor), and gives the same greedy tokens with
the expert cache as without."""
from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

ct = pytest.importorskip("compressed_tensors", minversion="0.20")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationConfig,  # noqa: E402
                                             apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

from vllm.model_executor.model_loader import get_model  # noqa: E402
from model_executor.layers.quantization.published_ckpt import (  # noqa: E402
    IGNORE, TINY, assert_cache_equals_no_cache, assert_model_matches_reference, save_quantized,
    split_experts)
from model_executor.tiny_checkpoints import make_vllm_config  # noqa: E402

# case -> (library preset, overrides of its weight args)
CASES = {
    "fp8-tensor": ("FP8", {}),
    "fp8-channel": ("FP8_DYNAMIC", {}),
    "fp8-block16x32": ("FP8_BLOCK", {"block_structure": [16, 32]}),
    "w4a16-g32-sym": ("W4A16", {"group_size": 32}),
    "w4a16-g16-asym": ("W4A16_ASYM", {"group_size": 16}),
    "w4a16-channel-asym": ("W4A16_ASYM", {"strategy": "channel", "group_size": None}),
    "nvfp4": ("NVFP4A16", {}),
}


def _observe(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min / max of a [out, in] weight over each scale's elements (a min-max observer)."""
    s = args.strategy
    if s == "tensor":
        return w.amin(), w.amax()
    if s == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if s in ("group", "tensor_group"):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    bo, bi = args.block_structure
    pad = nn.functional.pad(w, (0, -w.shape[1] % bi, 0, -w.shape[0] % bo))
    b = pad.unflatten(0, (-1, bo)).unflatten(2, (-1, bi))
    return b.amin((1, 3)), b.amax((1, 3))


@torch.no_grad()
def _calibrate(m: nn.Linear) -> None:
    args = m.quantization_scheme.weights
    w = m.weight.float()
    lo, hi = _observe(w, args)
    gs = None
    if args.strategy == "tensor_group":                 # NVFP4: one global scale per tensor
        gs = generate_gparam(w.amin(), w.amax())
        m.weight_global_scale.data.copy_(gs)
    scale, zp = calculate_qparams(lo, hi, args, global_scale=gs)
    m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
    if hasattr(m, "weight_zero_point"):
        m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))


def _linear_tree(experts: dict[str, torch.Tensor]) -> nn.Module:
    """An nn.Module whose Linear submodules carry the checkpoint's expert module names."""
    root = nn.Module()
    for name, w in experts.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data.copy_(w)
        parent.add_module(leaf, lin)
    return root


def write_with_library(src: str, out: str, preset: str, overrides: dict) -> tuple[str, dict]:
    """Quantize ``src``'s experts with compressed-tensors; -> (path, {module: scheme})."""
    experts, rest = split_experts(src)
    tree = _linear_tree(experts)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=overrides)
    scheme.weights = type(scheme.weights).model_validate(scheme.weights.model_dump())
    apply_quantization_config(tree, QuantizationConfig(config_groups={"group_0": scheme}),
                              show_progress=False)
    for m in tree.modules():
        if hasattr(m, "quantization_scheme"):
            _calibrate(m)
    schemes = {n: copy.deepcopy(m.quantization_scheme) for n, m in tree.named_modules()
               if hasattr(m, "quantization_scheme")}
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.quantization_config.ignore = IGNORE
    compressor.compress_model(tree)
    save_quantized(src, out, {**rest, **tree.state_dict()}, None)
    compressor.update_config(out)                  # the library writes quantization_config
    return out, schemes


def test_pack_quantized_int4_bit_layout_is_ours():
    """The library's packer puts element 8i + k at bits [4k, 4k + 4) of word i, value q + 8."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 1)            # [2, 16]
    words = pack_to_int32(q, 4)
    for k in range(16):
        assert (int(words[0, k // 8]) >> (4 * (k % 8))) & 15 == int(q[0, k]) + 8


def _deq_int4(ck: dict, scheme) -> torch.Tensor:
    """pack-quantized -> [out, in] float32, bit by bit from the format."""
    out, inp = (int(v) for v in ck["weight_shape"])
    words, s = ck["weight_packed"].long() & 0xFFFFFFFF, ck["weight_scale"].float()
    cols = torch.arange(inp)
    u = (words[:, cols // 8] >> (4 * (cols % 8))) & 15                  # [out, in] in [0, 15]
    gs = inp if scheme.weights.strategy == "channel" else scheme.weights.group_size
    if "weight_zero_point" in ck:
        rows = torch.arange(out)
        zw = ck["weight_zero_point"].long() & 0xFFFFFFFF                # [out/8, G]
        zu = (zw[rows // 8] >> (4 * (rows % 8)).unsqueeze(1)) & 15      # [out, G]
    else:
        zu = torch.full_like(s, 8, dtype=torch.long)
    return ((u - 8) - (zu[:, cols // gs] - 8)).float() * s[:, cols // gs]


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _deq_nvfp4(ck: dict) -> torch.Tensor:
    b = ck["weight_packed"]
    codes = torch.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1).long()   # low nibble first
    val = torch.tensor(E2M1)[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    # compressed-tensors' global scale divides: weight = fp4 * scale / global_scale.
    return val * ck["weight_scale"].float().repeat_interleave(16, 1) / ck["weight_global_scale"]


def _deq_fp8(ck: dict, scheme) -> torch.Tensor:
    w, s = ck["weight"].float(), ck["weight_scale"].float()
    if scheme.weights.strategy == "block":
        bo, bi = scheme.weights.block_structure
        s = s.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)[:, :w.shape[1]]
    return w * s.reshape(s.shape[0] if s.dim() == 2 else 1, -1)


def reference(path: str, schemes: dict):
    tensors = load_file(os.path.join(path, "model.safetensors"))
    fmt = json.load(open(os.path.join(path, "config.json")))["quantization_config"]["format"]

    def dequant(module: str) -> torch.Tensor:
        ck = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
        scheme = schemes[module]
        mine = (_deq_fp8(ck, scheme) if fmt == "float-quantized" else
                _deq_int4(ck, scheme) if fmt == "pack-quantized" else _deq_nvfp4(ck))
        # The library's own reader agrees with ours (its dequantize rounds to the scale dtype).
        lib = BaseCompressor.get_value_from_registry(fmt).decompress(dict(ck), scheme)["weight"]
        torch.testing.assert_close(lib.float(), mine.to(lib.dtype).float(), rtol=0, atol=0)
        return mine
    return dequant


@pytest.fixture(scope="module")
def ct_checkpoints(tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    root = tmp_path_factory.mktemp("ct")
    return {case: write_with_library(src, str(root / case), *CASES[case]) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_library_checkpoint_matches_reference(ct_checkpoints, case):
    path, schemes = ct_checkpoints[case]
    qc = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == IGNORE
    assert_model_matches_reference(path, reference(path, schemes))


@pytest.mark.parametrize("case", list(CASES))
def test_library_checkpoint_cache_equals_no_cache(ct_checkpoints, case):
    assert_cache_equals_no_cache(ct_checkpoints[case][0])


def test_weight_shape_checked(ct_checkpoints, tmp_path):
    path = str(tmp_path / "bad")
    shutil.copytree(ct_checkpoints["w4a16-g32-sym"][0], path)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    name = "model.layers.1.mlp.experts.2.down_proj.weight_shape"
    t[name] = torch.tensor([32, 64])
    save_file(t, f)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r".*\(out, in\) = \(64, 32\)"):
        get_model(make_vllm_config(path))


def test_actorder_group_g_idx(ct_checkpoints, tmp_path):
    """compressed-tensors < 0.12 wrote actorder "group" checkpoints with ``weight_g_idx``: the
    library's own packer re-packs each weight with its input columns permuted, and g_idx
    follows the permutation; the layer must compute with the permuted weight."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32
    base, schemes = ct_checkpoints["w4a16-g16-asym"]
    path = str(tmp_path / "actorder")
    shutil.copytree(base, path)
    f = os.path.join(path, "model.safetensors")
    tensors, perms = load_file(f), {}
    g = torch.Generator().manual_seed(5)
    for name in [k for k in tensors if k.endswith(".weight_packed")]:
        mod = name[:-len(".weight_packed")]
        out, inp = (int(v) for v in tensors[f"{mod}.weight_shape"])
        perms[mod] = perm = torch.randperm(inp, generator=g)
        q = unpack_from_int32(tensors[name], 4, torch.Size([out, inp]))       # int8 [out, in]
        tensors[name] = pack_to_int32(q[:, perm].contiguous(), 4)
        tensors[f"{mod}.weight_g_idx"] = (torch.arange(inp) // 16)[perm].to(torch.int32)
    save_file(tensors, f)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    json.dump(cfg, open(cfg_path, "w"))
    ref = reference(base, schemes)
    assert_model_matches_reference(path, lambda m: ref(m)[:, perms[m]])
