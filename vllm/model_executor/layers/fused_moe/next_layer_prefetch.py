"""Next-layer expert prefetch (``--moe-expert-prefetch next-layer``): wired onto a loaded model.

At MoE layer l, the residual stream h entering the layer's pre-MoE norm already says much about
layer l+1's routing (it changes little between layers), so layer l+1's own norm and router are
run on it and the predicted top-k go to layer l+1's ``CachedWeightProvider.prefetch``. The real
router of layer l+1 still decides, so outputs are bitwise unchanged; only hits and copies change.

Model files stay plain modules: after loading, ``wire_next_layer_prefetch`` finds, for every
FusedMoE in model order, its block's router (a child Linear named ``gate`` or ``router``) and
the norm that feeds the block (``post_attention_layernorm``, or ``norm`` for one-mixer blocks
such as Nemotron-H's), and registers a forward pre-hook on layer l's norm. The hook receives h
(or, where the block adds its residual inside the norm's call, the two terms of h, and adds them),
runs ``norm_{l+1}.forward(h)`` (``forward`` skips hooks, so layer l+1's own hook does not fire
on layer l's h), casts to the router's dtype (as the models do: DeepSeek's f32 gate takes
``x.float()``), takes the router logits and ``select_experts`` with layer l+1's routing
config. "Next" means the next MoE layer in model order (dense layers between are skipped).

The hook is Python around torch ops and runs every forward, so a model with prefetch wired runs
its decode steps eagerly (no CPU graphs: a replay would skip the hook).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.forward_context import get_attn_metadata
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.router import select_experts

logger = init_logger(__name__)

_ROUTER_NAMES = ("gate", "router")
_NORM_NAMES = ("post_attention_layernorm", "norm")


@dataclass
class MoESite:
    """Where one FusedMoE sits: its router (logits = router(norm(h))) and the pre-MoE norm."""
    moe: FusedMoE
    router: nn.Module
    norm: nn.Module


def find_moe_sites(model: nn.Module) -> list[MoESite] | str:
    """Every FusedMoE's site in model order, or the reason one has no recognisable router or
    norm (the model is then not supported by next-layer prefetch)."""
    modules = dict(model.named_modules())
    sites = []
    for name, m in modules.items():
        if not isinstance(m, FusedMoE):
            continue
        block_name = name.rpartition(".")[0]
        block = modules.get(block_name)
        layer = modules.get(block_name.rpartition(".")[0])
        router = next((getattr(block, n) for n in _ROUTER_NAMES
                       if isinstance(getattr(block, n, None), nn.Linear)
                       and getattr(block, n).out_features == m.num_experts), None)
        norm = next((getattr(layer, n) for n in _NORM_NAMES
                     if isinstance(getattr(layer, n, None), nn.Module)), None) \
            if layer is not None else None
        if router is None or norm is None:
            return (f"{name}: no router Linear ({' or '.join(_ROUTER_NAMES)}) beside it or no "
                    f"pre-MoE norm ({' or '.join(_NORM_NAMES)}) in its layer")
        sites.append(MoESite(m, router, norm))
    return sites


def _router_dtype(router: nn.Module) -> torch.dtype:
    """The dtype the router's kernel takes (its weight's, packed or not)."""
    w = router._buffers.get("packed_weight")
    return (w if w is not None else router.weight).dtype


class NextLayerPrefetch:
    """Forward pre-hook of layer l's pre-MoE norm: predicts layer l+1's experts and prefetches
    them into its cache."""

    def __init__(self, nxt: MoESite):
        self.next = nxt
        self.dtype = _router_dtype(nxt.router)

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] (the residual stream at layer l's pre-MoE norm) -> predicted ids [T, K]."""
        nxt = self.next
        logits = nxt.router.forward(nxt.norm.forward(h).to(self.dtype))       # [T, E]
        return select_experts(logits, nxt.moe.router_config,
                              nxt.moe.e_score_correction_bias)[1]

    def __call__(self, module: nn.Module, args: tuple) -> None:
        # A pre-norm block calls its norm as norm(x, residual) (the add fused into it): the
        # residual stream h is their sum, rounded as the norm rounds it.
        h = args[0] if len(args) < 2 or args[1] is None else args[0] + args[1]
        md = get_attn_metadata()
        row_slots = md.slot_mapping if md is not None and \
            md.slot_mapping.shape[0] == h.shape[0] else None
        self.next.moe.expert_cache.prefetch(self.predict(h), row_slots)


def wire_next_layer_prefetch(model: nn.Module) -> int:
    """Install the hooks (after loading); returns how many layer pairs prefetch. Layers without a
    cache are skipped; a model whose MoE blocks are not recognised raises ValueError."""
    sites = find_moe_sites(model)
    if isinstance(sites, str):
        raise ValueError(f"moe_expert_prefetch='next-layer' is not supported for this model: "
                         f"{sites}")
    pairs = [(cur, nxt) for cur, nxt in zip(sites, sites[1:]) if nxt.moe.expert_cache is not None]
    for site in sites if pairs else ():
        if site.moe.expert_cache is not None:
            site.moe.expert_cache.enable_prefetch()   # the first layer reports zeros too
    for cur, nxt in pairs:
        cur.norm.register_forward_pre_hook(NextLayerPrefetch(nxt))
    return len(pairs)
