"""Checkpoint name -> parameter mapping shared by the decoder model files.

Plain tensors load by exact name. Expert tensors come in two layouts:
per expert (``...experts.{e}.gate_proj|up_proj|down_proj.weight``, Mixtral ``w1|w3|w2``) as
written by ``save_pretrained``, or fused (``...experts.gate_up_proj`` [E, 2N, H] and
``...experts.down_proj`` [E, H, N]) as held in memory by transformers >= 5.
Quantized experts (per expert only) carry more tensors per projection
(``...experts.{e}.gate_proj.weight_scale``, ``.qweight``, ``.g_idx`` ...): the layer's quant
method declares them (``checkpoint_tensors``) and maps each to its layout (``load_transform``),
under the layer name the declaration gives (``CheckpointTensor.name``: compressed-tensors'
``weight_packed`` loads into ``w13_qweight``), or only checks it (``check_tensor``).
Layers with expert biases (``FusedMoE(bias=True)``) also take ``...experts.{e}.<proj>.bias``
per projection, in any scheme, as loaded. Model files whose checkpoints store experts another
way translate them into these names first (GPT-OSS: ``gpt_oss.per_expert_tensors``).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.fp8_dense import dense_fp8_weights
from vllm.model_executor.layers.quantization.moe_ref import CheckpointTensor

# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq",
                     "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_PER_EXPERT = re.compile(
    r"^(?P<mod>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<suffix>\w+)$")
_FUSED = re.compile(r"^(?P<mod>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# checkpoint projection -> (FusedMoE parameter, shard); w1 = gate, w3 = up, w2 = down.
_PROJ = {"gate_proj": ("w13_weight", "w1"), "w1": ("w13_weight", "w1"),
         "up_proj": ("w13_weight", "w3"), "w3": ("w13_weight", "w3"),
         "down_proj": ("w2_weight", "w2"), "w2": ("w2_weight", "w2")}
_ROLE = {"w1": "gate", "w3": "up", "w2": "down"}


# What the checkpoint holds per expert projection when the method declares nothing.
_UNQUANTIZED = (CheckpointTensor("weight"),)
# Expert biases (``...experts.{e}.gate_proj.bias``), whatever the scheme: model dtype, loaded as
# they are (no ``load_transform``).
_BIAS = CheckpointTensor("bias")


def _specs(layer: FusedMoE) -> tuple:
    specs = getattr(layer.quant_method, "checkpoint_tensors", None) or _UNQUANTIZED
    return (*specs, _BIAS) if layer.has_bias else specs


def _shards(layer: FusedMoE) -> tuple[str, ...]:
    """The projections a layer's experts load: gate, up, down; up and down when not gated
    (Nemotron-H: ``experts.{e}.up_proj`` is the whole w13)."""
    return ("w1", "w3", "w2") if layer.activation.gated else ("w3", "w2")


def _expert_params(name: str, layer: FusedMoE) -> set[str]:
    qm = layer.quant_method
    shared = getattr(qm, "shared_param_names", lambda: ())()
    return {f"{name}.{p}" for p in (*qm.expert_tensor_names(), *shared)}


def _quant_config():
    """The checkpoint's QuantConfig (None: unquantized, or no current config)."""
    vllm_config = get_current_vllm_config()
    return getattr(vllm_config, "quant_config", None) if vllm_config is not None else None


def load_decoder_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy every checkpoint tensor into ``model``; return the loaded parameter names. In an
    FP8 checkpoint the non-expert FP8 linears load dequantized (``fp8_dense``).

    Raises ValueError naming the tensor for: an unknown tensor, a wrong shape, and (after the
    last tensor) every parameter or expert shard the checkpoint did not provide.
    """
    weights = dense_fp8_weights(weights, _quant_config())
    params = dict(model.named_parameters())
    moe = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
    expert_params = set().union(*(_expert_params(n, m) for n, m in moe.items()))
    pending = {n for n in params if n not in expert_params}
    # (layer, expert, shard, suffix) still to load.
    pending_experts = {(n, e, s, c.suffix) for n, m in moe.items() for e in range(m.num_experts)
                       for s in _shards(m) for c in _specs(m) if c.required}
    tied = bool(getattr(model, "tie_word_embeddings", False))
    rename = getattr(model, "rename_checkpoint_tensor", lambda n: n)
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
            continue
        name = rename(ckpt_name)
        try:
            if _load_expert(name, tensor, moe, pending_experts):
                continue
        except ValueError as err:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: {err}") from None
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} does not match any parameter of "
                             f"{type(model).__name__} (is the checkpoint for another architecture?)")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                             f"model expects {tuple(param.shape)}")
        param.data.copy_(tensor)
        pending.discard(name)
        loaded.add(name)
    _raise_if_missing(pending, pending_experts)
    return loaded | expert_params


def _load_expert(name: str, tensor: torch.Tensor, moe: dict[str, FusedMoE],
                 pending: set[tuple[str, int, str, str]]) -> bool:
    """Route an expert tensor into its FusedMoE; False if ``name`` is not an expert tensor."""
    m = _PER_EXPERT.match(name)
    if m and m["mod"] in moe:
        layer, proj, e, suffix = moe[m["mod"]], m["proj"], int(m["expert"]), m["suffix"]
        if proj not in _PROJ:
            raise ValueError(f"unknown expert projection {proj!r}: must be one of {sorted(_PROJ)}")
        if e >= layer.num_experts:
            raise ValueError(f"expert id {e} is out of range: the layer has {layer.num_experts} "
                             "experts")
        spec = {c.suffix: c for c in _specs(layer)}.get(suffix)
        if spec is None:
            raise ValueError(f"unexpected expert tensor {suffix!r} for "
                             f"{type(layer.quant_method).__name__}: expected one of "
                             f"{[c.suffix for c in _specs(layer)]} (is the checkpoint quantized "
                             "differently than its quantization_config says?)")
        param, shard = _PROJ[proj]
        qm, kind = layer.quant_method, param.split("_")[0]           # "w13" | "w2"
        if spec.check_only:
            qm.check_tensor(suffix, kind, tensor)
        elif spec.shared:
            qm.load_shared(layer, f"{kind}_{spec.name}", tensor)
        else:
            if spec is not _BIAS and hasattr(qm, "load_transform"):
                tensor = qm.load_transform(suffix, kind, tensor)
            layer.load_expert_weight(f"{kind}_{spec.name}", tensor, e, shard)
        pending.discard((m["mod"], e, shard, suffix))
        return True
    m = _FUSED.match(name)
    if m and m["mod"] in moe:
        layer = moe[m["mod"]]
        if _specs(layer) is not _UNQUANTIZED:
            raise ValueError("fused expert tensors (gate_up_proj/down_proj) are only supported "
                             "for unquantized experts without biases; quantized checkpoints "
                             "store experts one by one")
        fused = m["proj"] == "gate_up_proj"
        if fused and not layer.activation.gated:
            raise ValueError("a fused gate_up_proj tensor for non-gated experts: expected "
                             "per-expert up_proj tensors")
        layer.load_expert_weight("w13_weight" if fused else "w2_weight", tensor, None, None)
        for e in range(layer.num_experts):
            for shard in (("w1", "w3") if fused else ("w2",)):
                pending.discard((m["mod"], e, shard, "weight"))
        return True
    return False


def _raise_if_missing(pending: set[str], pending_experts: set[tuple[str, int, str, str]]) -> None:
    missing = sorted(pending) + [f"{n}.{e}.{s}.{c} ({_ROLE[s]} projection of expert {e})"
                                 for n, e, s, c in sorted(pending_experts)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model expects: "
                         f"{shown}{more}")
