"""Checkpoint name -> parameter mapping shared by the decoder model files.

Plain tensors load by exact name. Expert tensors come in two layouts:
per expert (``...experts.{e}.gate_proj|up_proj|down_proj.weight``, Mixtral ``w1|w3|w2``) as
written by ``save_pretrained``, or fused (``...experts.gate_up_proj`` [E, 2N, H] and
``...experts.down_proj`` [E, H, N]) as held in memory by transformers >= 5.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe.layer import FusedMoE

# Buffers some checkpoints carry that are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq",
                     "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_PER_EXPERT = re.compile(r"^(?P<mod>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<mod>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# checkpoint projection -> (FusedMoE parameter, shard); w1 = gate, w3 = up, w2 = down.
_PROJ = {"gate_proj": ("w13_weight", "w1"), "w1": ("w13_weight", "w1"),
         "up_proj": ("w13_weight", "w3"), "w3": ("w13_weight", "w3"),
         "down_proj": ("w2_weight", "w2"), "w2": ("w2_weight", "w2")}
_ROLE = {"w1": "gate", "w3": "up", "w2": "down"}


def load_decoder_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy every checkpoint tensor into ``model``; return the loaded parameter names.

    Raises ValueError naming the tensor for: an unknown tensor, a wrong shape, and (after the
    last tensor) every parameter or expert shard the checkpoint did not provide.
    """
    params = dict(model.named_parameters())
    moe = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
    expert_params = {f"{n}.{p}" for n in moe for p in ("w13_weight", "w2_weight")}
    pending = {n for n in params if n not in expert_params}
    # (layer, expert, shard) still to load.
    pending_experts = {(n, e, s) for n, m in moe.items() for e in range(m.num_experts)
                       for s in ("w1", "w3", "w2")}
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
                 pending: set[tuple[str, int, str]]) -> bool:
    """Route an expert tensor into its FusedMoE; False if ``name`` is not an expert tensor."""
    m = _PER_EXPERT.match(name)
    if m and m["mod"] in moe:
        layer, proj, e = moe[m["mod"]], m["proj"], int(m["expert"])
        if proj not in _PROJ:
            raise ValueError(f"unknown expert projection {proj!r}: must be one of {sorted(_PROJ)}")
        if e >= layer.num_experts:
            raise ValueError(f"expert id {e} is out of range: the layer has {layer.num_experts} "
                             "experts")
        param, shard = _PROJ[proj]
        layer.load_expert_weight(param, tensor, e, shard)
        pending.discard((m["mod"], e, shard))
        return True
    m = _FUSED.match(name)
    if m and m["mod"] in moe:
        layer = moe[m["mod"]]
        fused = m["proj"] == "gate_up_proj"
        layer.load_expert_weight("w13_weight" if fused else "w2_weight", tensor, None, None)
        for e in range(layer.num_experts):
            for shard in (("w1", "w3") if fused else ("w2",)):
                pending.discard((m["mod"], e, shard))
        return True
    return False


def _raise_if_missing(pending: set[str], pending_experts: set[tuple[str, int, str]]) -> None:
    missing = sorted(pending) + [f"{n}.{e}.{s}.weight ({_ROLE[s]} projection of expert {e})"
                                 for n, e, s in sorted(pending_experts)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model expects: "
                         f"{shown}{more}")
