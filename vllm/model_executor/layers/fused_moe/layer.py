"""FusedMoE: router -> (expert cache) -> quant_method.apply.

The seam between routing and ``apply`` is where the expert cache plugs in: without a cache
``apply`` receives the layer's expert tensors [E, ...] and global ``topk_ids``; with one, the
layer's expert tensors *are* the device slots [N, ...] and ``apply`` receives slot ids.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.router import RouterConfig, select_experts
from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase, MoEShape
from vllm.model_executor.layers.quantization.unquantized import UnquantizedFusedMoEMethod

logger = init_logger(__name__)

# Checkpoint shard -> (which fused tensor, which half of dim 0 of one expert's tensor).
# w1 = gate, w3 = up (fused as [gate; up] rows of w13), w2 = down.
_SHARDS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, scoring_func: str = "softmax",
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0, use_correction_bias: bool = False,
                 activation: str = "silu", params_dtype: torch.dtype | None = None,
                 quant_method: FusedMoEMethodBase | None = None, prefix: str = ""):
        super().__init__()
        cfg = get_current_vllm_config()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.prefix = prefix
        self.activation = activation
        """Expert activation; quant methods read it in get_moe_method."""
        m = re.search(r"layers\.(\d+)\.", prefix + ".")
        self.layer_index = int(m.group(1)) if m else 0
        if activation not in ("silu", "gelu"):
            raise ValueError(f"{prefix}: activation={activation!r} is invalid: must be 'silu' or "
                             "'gelu'")
        self.router_config = RouterConfig(top_k, renormalize, scoring_func, num_expert_group,
                                          topk_group, routed_scaling_factor, num_experts)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts), requires_grad=False)
                                        if use_correction_bias else None)
        if quant_method is None and cfg is not None and getattr(cfg, "quant_config", None):
            quant_method = cfg.quant_config.get_moe_method(self)
        self.quant_method = quant_method or UnquantizedFusedMoEMethod(activation)
        params_dtype = params_dtype or torch.get_default_dtype()
        moe_cfg = cfg.moe_cache_config if cfg is not None else None
        self.cache_size = (moe_cfg.cache_size if moe_cfg is not None and
                           0 < moe_cfg.cache_size < num_experts else 0)
        # Cached experts are created in host memory: they become the store, never touching the device.
        device = torch.device("cpu") if self.cache_size else None
        self.quant_method.create_weights(
            self, MoEShape(num_experts, hidden_size, intermediate_size, params_dtype), device)
        self.expert_cache = None
        """Set by ``finish_loading`` when ``cache_size > 0`` (an ``ExpertCache``)."""
        self.routing_observer: Callable[[int, torch.Tensor], None] | None = None
        """Called with (layer_index, topk_ids [T, top_k]) every forward (routing-trace recorder)."""

    # ---- loading -------------------------------------------------------------------------
    def load_expert_weight(self, name: str, loaded: torch.Tensor, expert_id: int | None,
                           shard: str | None) -> None:
        """Copy one checkpoint tensor into the expert parameter ``name``.

        name: a parameter of this layer with a leading expert dim (e.g. "w13_weight").
        expert_id None: ``loaded`` holds all experts (fused checkpoints); else one expert.
        shard "w1"/"w3": the gate/up half of dim 0 of one expert's w13 tensor; None: the whole.
        """
        param = getattr(self, name, None)
        if param is None:
            raise KeyError(f"{self.prefix}: no expert parameter {name!r}")
        if shard is not None and shard not in _SHARDS:
            raise ValueError(f"{self.prefix}.{name}: shard={shard!r} is invalid: must be one of "
                             f"{sorted(_SHARDS)} or None")
        dst = param.data if expert_id is None else param.data[expert_id]
        if shard is not None and _SHARDS[shard][1] is not None:
            half = dst.shape[0] // 2
            dst = dst[:half] if _SHARDS[shard][1] == 0 else dst[half:]
        if tuple(dst.shape) != tuple(loaded.shape):
            where = f"expert {expert_id} " if expert_id is not None else ""
            raise ValueError(f"{self.prefix}.{name}: {where}shape mismatch: checkpoint has "
                             f"{tuple(loaded.shape)}, model expects {tuple(dst.shape)}")
        dst.copy_(loaded)

    def finish_loading(self, device: torch.device) -> None:
        """Run post-load processing; with a cache, build store (host) and slots (``device``)."""
        if self.cache_size:
            from vllm.model_executor.layers.fused_moe.expert_cache.cache import ExpertCache
            cfg = get_current_vllm_config()
            self.expert_cache = ExpertCache.from_layer(self, cfg.moe_cache_config, device)
        else:
            self.quant_method.process_weights_after_loading(self)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, E] -> [T, H]."""
        topk_weights, topk_ids = select_experts(router_logits, self.router_config,
                                                self.e_score_correction_bias)
        topk_weights = topk_weights.to(hidden_states.dtype)
        if self.routing_observer is not None:
            self.routing_observer(self.layer_index, topk_ids)
        if self.expert_cache is None:
            return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        return self.expert_cache.forward(self, hidden_states, topk_weights, topk_ids)
