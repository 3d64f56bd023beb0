"""Checkpoint ``quantization_config`` -> ``QuantConfig`` (configuration data only: the quant
method of each layer is chosen above this, in ``model_executor/layers/quantization``).

Understood (expert weights only; everything else in the model stays unquantized):
  * compressed-tensors (llm-compressor): one config group of 8-bit float weights, strategy
    "tensor", "channel" or "block" -> schemes fp8-tensor / fp8-channel / fp8-block; INT4
    "pack-quantized" W4A16 (group / channel) -> w4a16-gptq; "nvfp4-pack-quantized" -> nvfp4
    (the last two are converted to those schemes' layouts at load time:
    model_executor/layers/quantization/compressed_tensors.py);
  * quant_method "fp8" (Hugging Face / DeepSeek): weight_block_size [bo, bi] -> fp8-block with
    ``weight_scale_inv``; without a block size -> fp8-tensor with ``weight_scale``;
  * quant_method "gptq": bits 4, group_size, sym, desc_act, checkpoint_format gptq|gptq_v2;
  * ModelOpt NVFP4: quant_method "modelopt" with quant_algo "NVFP4" (in config.json), or
    ``hf_quant_config.json`` with {"quantization": {"quant_algo": "NVFP4", ...}};
  * quant_method "mxfp4" (OpenAI GPT-OSS): e2m1 blocks of 32 with e8m0 scales.
Modules listed as not converted (``ignore``, ``modules_to_not_convert``, ``exclude_modules``,
GPTQModel ``dynamic`` "-:" rules) keep unquantized experts if they name an expert layer.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from typing import Any

SCHEMES = ("fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq", "nvfp4", "mxfp4")
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class QuantConfig:
    scheme: str
    """One of SCHEMES."""
    quant_method: str
    """As the checkpoint names it: compressed-tensors, fp8, gptq, modelopt, mxfp4."""
    ignore: tuple[str, ...] = ()
    """Module names / "re:" regexes / shell wildcards left unquantized."""
    block: tuple[int, int] | None = None
    """fp8-block: (rows, cols) of one scale block."""
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    scale_name: str | None = None
    """fp8: checkpoint name of the weight scale (None: the scheme's usual one)."""

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {self.scheme!r} is invalid: must be one of "
                             f"{list(SCHEMES)}")

    def is_ignored(self, module: str) -> bool:
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], module) or re.match(pat[3:], module):
                    return True
            elif module == pat or fnmatch.fnmatchcase(module, pat):
                return True
        return False

    def ignores_layer(self, prefix: str) -> bool:
        """Whether the FusedMoE named ``prefix`` keeps unquantized experts."""
        names = [prefix] + [f"{prefix}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj",
                                                         "w1", "w3", "w2")]
        return any(self.is_ignored(n) for n in names)

    def describe(self) -> str:
        extra = {"fp8-block": f" block={self.block}",
                 "w4a16-gptq": f" group_size={self.group_size} sym={self.sym} "
                               f"desc_act={self.desc_act}"}.get(self.scheme, "")
        return f"{self.scheme} ({self.quant_method}){extra}, experts only"


def _fail(what: str, allowed: str) -> ValueError:
    return ValueError(f"quantization_config: {what}; supported: {allowed}")


def _parse_compressed_tensors(qc: dict) -> QuantConfig:
    groups = list((qc.get("config_groups") or {}).values())
    supported = ("8-bit float weights (fp8 tensor/channel/block), pack-quantized 4-bit int "
                 "weights (group/channel, W4A16), nvfp4-pack-quantized")
    if len(groups) != 1:
        raise _fail(f"{len(groups)} config_groups", f"exactly one group of {supported}")
    w = groups[0].get("weights") or {}
    fmt = groups[0].get("format") or qc.get("format")
    ignore = tuple(qc.get("ignore") or ())
    strategy = w.get("strategy")
    kind = (w.get("type"), w.get("num_bits"))
    if kind == ("float", 8):
        if strategy not in ("tensor", "channel", "block"):
            raise _fail(f"weights strategy={strategy!r}", "tensor, channel, block")
        block = tuple(w.get("block_structure") or (128, 128)) if strategy == "block" else None
        # compressed-tensors names a block scale weight_scale (HF/DeepSeek: weight_scale_inv).
        return QuantConfig(f"fp8-{strategy}", "compressed-tensors", ignore, block,
                           scale_name="weight_scale")
    if kind == ("int", 4) and fmt == "pack-quantized" and strategy in ("group", "channel"):
        if groups[0].get("input_activations"):
            raise _fail("int4 weights with quantized activations", "W4A16 (weight-only)")
        gs = int(w.get("group_size") or -1) if strategy == "group" else -1
        # actorder "group" / true (compressed-tensors < 0.12) stores weight_g_idx; "weight" not.
        return QuantConfig("w4a16-gptq", "compressed-tensors", ignore, group_size=gs,
                           sym=bool(w.get("symmetric", True)),
                           desc_act=w.get("actorder") in ("group", True))
    if kind == ("float", 4) and fmt == "nvfp4-pack-quantized" and w.get("group_size") == 16:
        return QuantConfig("nvfp4", "compressed-tensors", ignore)
    raise _fail(f"weights type={w.get('type')!r} num_bits={w.get('num_bits')!r} "
                f"strategy={strategy!r} format={fmt!r}", supported)


def _parse_gptq(qc: dict) -> QuantConfig:
    if qc.get("bits") != 4:
        raise _fail(f"gptq bits={qc.get('bits')!r}", "bits 4")
    ignore = list(qc.get("modules_to_not_convert") or ())
    ignore += ["re:" + k[2:] for k in (qc.get("dynamic") or {}) if k.startswith("-:")]
    return QuantConfig("w4a16-gptq", "gptq", tuple(ignore),
                       group_size=int(qc.get("group_size", 128)), sym=bool(qc.get("sym", True)),
                       desc_act=bool(qc.get("desc_act", False)),
                       checkpoint_format=qc.get("checkpoint_format") or "gptq")


def _parse_modelopt(qc: dict) -> QuantConfig:
    q = qc.get("quantization", qc)
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise _fail(f"modelopt quant_algo={algo!r}", "NVFP4")
    if int(q.get("group_size", 16)) != 16:
        raise _fail(f"modelopt group_size={q.get('group_size')!r}", "16")
    ignore = q.get("exclude_modules") or q.get("ignore") or ()
    return QuantConfig("nvfp4", "modelopt", tuple(ignore))


def parse_quant_config(qc: dict | None) -> QuantConfig | None:
    """A checkpoint's quantization dict -> QuantConfig; None for None/{}; ValueError otherwise."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method is None and "quantization" in qc:            # hf_quant_config.json
        method = "modelopt"
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "fp8":
        block = qc.get("weight_block_size")
        scheme = "fp8-block" if block else "fp8-tensor"
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        return QuantConfig(scheme, "fp8", ignore, tuple(block) if block else None)
    if method == "gptq":
        return _parse_gptq(qc)
    if method in ("modelopt", "modelopt_fp4"):
        return _parse_modelopt(qc)
    if method == "mxfp4":
        return QuantConfig("mxfp4", "mxfp4", tuple(qc.get("modules_to_not_convert") or ()))
    raise _fail(f"quant_method={method!r}",
                "compressed-tensors, fp8, gptq, modelopt (NVFP4), mxfp4")


def quant_config_from_model_dir(model_dir: str, hf_config: Any = None) -> QuantConfig | None:
    """config.json's quantization_config, else hf_quant_config.json, else None."""
    qc = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if qc is None:
        path = os.path.join(model_dir, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                qc = json.load(f).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    if not qc:
        path = os.path.join(model_dir, HF_QUANT_CONFIG)
        if os.path.isfile(path):
            with open(path) as f:
                qc = json.load(f)
    return parse_quant_config(qc)
