"""Published layouts written without tools/quantize_checkpoint.py, for a tiny random Qwen3-MoE:
GPTQ v1 (qweight / qzeros / scales / g_idx, zero stored minus one) by an independent packer
here; Hugging Face fp8 block (weight_scale_inv, float32 and ue8m0 scales) by transformers' own
``Fp8Quantize``; ModelOpt NVFP4 (weight / weight_scale / weight_scale_2 / input_scale,
hf_quant_config.json or config.json) by a packer here and by ModelOpt's ``NVFP4QTensor`` when it
is installed. Each loads through our loader and matches a dequantize-then-matmul reference
computed from the writer's integer codes and scales (never by unpacking the checkpoint with our
helpers), and gives the same greedy tokens with the expert cache as without."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import transformers

from model_executor.layers.quantization.published_ckpt import (
    TINY, assert_cache_equals_no_cache, assert_model_matches_reference, save_quantized,
    split_experts)

NOT_CONVERTED = ["lm_head", "model.layers.0.self_attn.q_proj"]   # only names; never experts


def write(src: str, out: str, quantize: Callable, qc: dict | None, extra=None):
    """quantize(w [out, in] float32) -> ({suffix: tensor}, dequantized [out, in] float32).
    -> (path, {module: dequantized weight})."""
    experts, rest = split_experts(src)
    tensors, deq = dict(rest), {}
    for mod, w in experts.items():
        ck, deq[mod] = quantize(w.float())
        tensors.update({f"{mod}.{k}": v for k, v in ck.items()})
    return save_quantized(src, out, tensors, qc, extra), deq


# ---- GPTQ v1, packed here from the format's definition -------------------------------------
def _words(vals: torch.Tensor) -> torch.Tensor:
    """[..., 8n] ints in [0, 15] -> [..., n] int32: value 8j + k at bits [4k, 4k + 4) of word j."""
    acc = torch.zeros(*vals.shape[:-1], vals.shape[-1] // 8, dtype=torch.int64)
    for k in range(8):
        acc |= vals[..., k::8].long() << (4 * k)
    return ((acc + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)     # uint32 bits as int32


def gptq_v1(group_size: int, sym: bool, desc_act: bool):
    def quantize(w):
        out, inp = w.shape
        gs = inp if group_size == -1 else group_size
        groups = -(-inp // gs)
        order = (torch.randperm(inp, generator=torch.Generator().manual_seed(out * inp))
                 if desc_act else torch.arange(inp))
        g_idx = torch.empty(inp, dtype=torch.int32)
        g_idx[order] = (torch.arange(inp) // gs).to(torch.int32)
        scale, zero = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.long)
        for g in range(groups):
            blk = w[:, g_idx == g]
            lo, hi = blk.amin(1).clamp(max=0), blk.amax(1).clamp(min=0)
            if sym:
                scale[g], zero[g] = torch.maximum(-lo, hi) * 2 / 15, 8
            else:
                scale[g] = (hi - lo) / 15
                # v1 stores zero - 1 in four bits, so a zero of 0 cannot be stored.
                zero[g] = (-lo / scale[g].clamp(min=1e-8)).round().clamp(1, 15).long()
        scale = scale.clamp(min=1e-6).half()
        s_col, z_col = scale.float()[g_idx.long()].t(), zero[g_idx.long()].t()   # [out, in]
        q = (w / s_col).round().long().add(z_col).clamp(0, 15)                    # [out, in]
        ck = {"qweight": _words(q).t().contiguous(),          # [in/8, out], packed along in
              "qzeros": _words(zero - 1),                      # [G, out/8], stored zero - 1
              "scales": scale, "g_idx": g_idx}
        return ck, (q - z_col).float() * s_col
    return quantize


GPTQ_CASES = {"g32-sym": (32, True, False), "g16-asym-descact": (16, False, True),
              "perchannel-asym": (-1, False, False), "g64-sym-descact": (64, True, True)}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_v1_matches_reference(tiny_model_factory, tmp_path, case):
    gs, sym, desc_act = GPTQ_CASES[case]
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": gs, "sym": sym, "desc_act": desc_act,
          "checkpoint_format": "gptq", "modules_to_not_convert": NOT_CONVERTED}
    path, deq = write(src, str(tmp_path / case), gptq_v1(gs, sym, desc_act), qc)
    assert_model_matches_reference(path, deq.__getitem__)
    assert_cache_equals_no_cache(path)


# ---- Hugging Face fp8 block, written by transformers' own quantizer --------------------------
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_hf_fp8_block_matches_reference(tiny_model_factory, tmp_path, scale_fmt):
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    cfg = transformers.FineGrainedFP8Config(weight_block_size=(16, 32), scale_fmt=scale_fmt,
                                            modules_to_not_convert=NOT_CONVERTED)
    op = Fp8Quantize(SimpleNamespace(quantization_config=cfg))

    def quantize(w):
        ck = {k.split(".", 1)[1]: v for k, v in op._quantize_one("m.weight", w).items()}
        assert ck["weight"].dtype == torch.float8_e4m3fn        # really quantized, not passed
        inv = ck["weight_scale_inv"].float()                    # [out/16, in/32]
        full = inv.repeat_interleave(16, 0).repeat_interleave(32, 1)
        return ck, ck["weight"].float() * full
    qc = {k: (v.value if hasattr(v, "value") else v) for k, v in cfg.to_dict().items()}
    path, deq = write(src, str(tmp_path / scale_fmt), quantize, qc)
    assert_model_matches_reference(path, deq.__getitem__)
    assert_cache_equals_no_cache(path)


# ---- ModelOpt NVFP4 ---------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nvfp4_here(w):
    """ModelOpt's recipe written from its definition: weight_scale_2 = amax / (6 * 448), block
    scales e4m3(block amax / 6 / weight_scale_2), codes the nearest e2m1 (sign bit 3), two per
    byte with the even element in the low nibble."""
    out, inp = w.shape
    ws2 = w.abs().amax() / (6 * 448)
    blocks = w.reshape(out, inp // 16, 16)
    s = (blocks.abs().amax(-1) / 6 / ws2).clamp(2 ** -9, 448).to(torch.float8_e4m3fn)
    x = (blocks / (s.float() * ws2).unsqueeze(-1)).reshape(out, inp)
    mag = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)                # [out, in] in [0, 7]
    codes = mag + 8 * ((x < 0) & (mag > 0)).long()
    deq = E2M1[mag] * torch.where(codes >= 8, -1.0, 1.0)
    deq = deq * s.float().repeat_interleave(16, 1) * ws2
    ck = {"weight": (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8),
          "weight_scale": s, "weight_scale_2": ws2.reshape(()),
          "input_scale": torch.rand(()) + 0.5}       # activation scale: kept, unused (W4A16)
    return ck, deq


def nvfp4_modelopt(w):
    qt_mod = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    qt, s, ws2 = qt_mod.NVFP4QTensor.quantize(w, 16)
    packed = qt._quantized_data
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(w.shape).long()
    val = E2M1[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    return ({"weight": packed, "weight_scale": s, "weight_scale_2": ws2},
            val * s.float().repeat_interleave(16, 1) * ws2)


@pytest.mark.parametrize("writer", ["here", "modelopt"])
@pytest.mark.parametrize("where", ["hf_quant_config", "config_json"])
def test_modelopt_nvfp4_matches_reference(tiny_model_factory, tmp_path, writer, where):
    quantize = {"here": nvfp4_here, "modelopt": nvfp4_modelopt}[writer]
    if writer == "modelopt":
        pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    quant = {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
             "exclude_modules": NOT_CONVERTED}
    if where == "hf_quant_config":
        qc, extra = None, {"hf_quant_config.json": {"producer": {"name": "modelopt"},
                                                    "quantization": quant}}
    else:
        qc, extra = {"quant_method": "modelopt", **quant}, None
    path, deq = write(src, str(tmp_path / f"{writer}-{where}"), quantize, qc, extra)
    assert_model_matches_reference(path, deq.__getitem__)
    assert_cache_equals_no_cache(path)
