"""Checkpoint ``quantization_config`` -> ``QuantConfig`` (configuration data only: the quant
method of each layer is chosen above this, in ``model_executor/layers/quantization``).

Understood (expert weights only; everything else in the model stays unquantized):
  * compressed-tensors (llm-compressor): one config group of 8-bit float weights, strategy
    "tensor", "channel" or "block" -> schemes fp8-tensor / fp8-channel / fp8-block, with the
    group's ``input_activations`` -> ``input_quant`` (below); INT4
    "pack-quantized" W4A16 (group / channel) -> w4a16-gptq; "nvfp4-pack-quantized" -> nvfp4
    (the last two are converted to those schemes' layouts at load time:
    model_executor/layers/quantization/compressed_tensors.py);
  * quant_method "fp8" (Hugging Face / DeepSeek): weight_block_size [bo, bi] -> fp8-block with
    ``weight_scale_inv``; without a block size -> fp8-tensor with ``weight_scale``;
    ``activation_scheme`` (default "dynamic") -> ``input_quant`` (below);
  * quant_method "gptq": bits 4, group_size, sym, desc_act, checkpoint_format gptq|gptq_v2;
  * ModelOpt NVFP4: quant_method "modelopt" with quant_algo "NVFP4" (in config.json), or
    ``hf_quant_config.json`` with {"quantization": {"quant_algo": "NVFP4", ...}};
  * quant_method "mxfp4" (OpenAI GPT-OSS): e2m1 blocks of 32 with e8m0 scales.
Modules listed as not converted (``ignore``, ``modules_to_not_convert``, ``exclude_modules``,
GPTQModel ``dynamic`` "-:" rules) keep unquantized experts if they name an expert layer.

FP8 activations (``QuantConfig.input_quant``; None = weight-only, activations in the model
dtype), as the checkpoint declares them:
  * compressed-tensors ``input_activations`` (8-bit float only): dynamic "token" -> "token";
    dynamic "tensor" -> "token" too: a per-token scale is finer than one scale for the whole
    batch and, unlike it, does not depend on which other rows (e.g. CUDA-graph padding rows)
    share the batch; dynamic "group" -> "group" (``input_group`` = its group_size); static
    "tensor" -> "tensor" (the checkpoint's ``input_scale``). Other strategies, static
    non-tensor, ``dynamic: "local"`` and asymmetric activations are refused.
  * HF "fp8" ``activation_scheme``: "dynamic" -> "group" of 1 x bi with weight_block_size
    [bo, bi] (DeepSeek-V3), else "token"; "static" -> "tensor" (refused with a block size).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from typing import Any

SCHEMES = ("fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq", "nvfp4", "mxfp4")
INPUT_QUANTS = ("token", "group", "tensor")
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
    input_quant: str | None = None
    """fp8 activations: None (weight-only), "token" / "group" (dynamic fp8 scale per token row /
    per token and ``input_group`` columns) or "tensor" (static: the checkpoint's input_scale)."""
    input_group: int = 0
    """input_quant "group": consecutive input columns per activation scale (else 0)."""

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {self.scheme!r} is invalid: must be one of "
                             f"{list(SCHEMES)}")
        check_input_quant(self.input_quant, self.input_group)
        if self.input_quant is not None and not self.scheme.startswith("fp8"):
            raise ValueError(f"input_quant={self.input_quant!r} is invalid for scheme "
                             f"{self.scheme!r}: quantized activations are supported only for "
                             "the fp8 schemes")

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
        inputs = {"token": " inputs=fp8 per token",
                  "group": f" inputs=fp8 per 1x{self.input_group} group",
                  "tensor": " inputs=fp8 static per tensor"}.get(self.input_quant or "", "")
        return f"{self.scheme} ({self.quant_method}){extra}{inputs}, experts only"


def check_input_quant(input_quant: str | None, input_group: int) -> None:
    """ValueError unless (input_quant, input_group) is a valid pair (see QuantConfig)."""
    if input_quant is not None and input_quant not in INPUT_QUANTS:
        raise ValueError(f"input_quant={input_quant!r} is invalid: must be None or one of "
                         f"{list(INPUT_QUANTS)}")
    positive = (isinstance(input_group, int) and not isinstance(input_group, bool)
                and input_group > 0)
    if input_quant == "group" and not positive:
        raise ValueError(f"input_group={input_group!r} is invalid for input_quant 'group': must "
                         "be a positive int")
    if input_quant != "group" and input_group != 0:
        raise ValueError(f"input_group={input_group!r} is invalid for input_quant="
                         f"{input_quant!r}: must be 0 (a group size only with 'group')")


def _fail(what: str, allowed: str) -> ValueError:
    return ValueError(f"quantization_config: {what}; supported: {allowed}")


def _ct_input_quant(acts: dict | None) -> tuple[str | None, int]:
    """compressed-tensors ``input_activations`` of fp8 weights -> (input_quant, input_group)."""
    if not acts:
        return None, 0
    allowed = ("8-bit float activations, dynamic per token / tensor / group or static per "
               "tensor, or none")
    if (acts.get("type"), acts.get("num_bits")) != ("float", 8):
        raise _fail(f"input_activations type={acts.get('type')!r} "
                    f"num_bits={acts.get('num_bits')!r}", allowed)
    if acts.get("symmetric", True) is not True:
        raise _fail("asymmetric input_activations (symmetric=false)", allowed)
    strategy, dynamic = acts.get("strategy"), acts.get("dynamic", False)
    if dynamic is True:
        if strategy in ("token", "tensor"):
            return "token", 0           # per token even for "tensor": see the module docstring
        if strategy == "group":
            gs = acts.get("group_size")
            if isinstance(gs, bool) or not isinstance(gs, int) or gs <= 0:
                raise _fail(f"dynamic group input_activations with group_size={gs!r}",
                            "a positive int group_size")
            return "group", int(gs)
        raise _fail(f"dynamic input_activations strategy={strategy!r}", allowed)
    if dynamic is False:
        if strategy == "tensor":
            return "tensor", 0
        raise _fail(f"static input_activations strategy={strategy!r}", allowed)
    raise _fail(f"input_activations dynamic={dynamic!r}", allowed)


def _hf_fp8_input_quant(qc: dict, block) -> tuple[str | None, int]:
    """HF/DeepSeek ``activation_scheme`` -> (input_quant, input_group)."""
    scheme = qc.get("activation_scheme")
    scheme = "dynamic" if scheme is None else scheme       # transformers' default
    if scheme == "dynamic":
        return ("group", int(block[1])) if block else ("token", 0)
    if scheme == "static":
        if block:
            raise _fail(f"activation_scheme 'static' with weight_block_size={list(block)}",
                        "static activations with per-tensor weights only")
        return "tensor", 0
    raise _fail(f"activation_scheme={scheme!r}", "dynamic, static")


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
        input_quant, input_group = _ct_input_quant(groups[0].get("input_activations"))
        # compressed-tensors names a block scale weight_scale (HF/DeepSeek: weight_scale_inv).
        return QuantConfig(f"fp8-{strategy}", "compressed-tensors", ignore, block,
                           scale_name="weight_scale", input_quant=input_quant,
                           input_group=input_group)
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
        input_quant, input_group = _hf_fp8_input_quant(qc, block)
        return QuantConfig(scheme, "fp8", ignore, tuple(block) if block else None,
                           input_quant=input_quant, input_group=input_group)
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
