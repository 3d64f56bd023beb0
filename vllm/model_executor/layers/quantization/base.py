"""The quant-method contract for MoE experts.

A method owns the layout of a layer's expert tensors. It *declares* which of them are
expert-indexed (leading dimension E): the expert cache builds its host store and device
slots from that declaration alone, so every scale, zero point and g_idx moves with its expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe.backend import combine_pairs
from vllm.model_executor.layers.scratch import scratch


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    params_dtype: torch.dtype


class FusedMoEMethodBase:
    def create_weights(self, layer: nn.Module, shape: MoEShape, device: torch.device) -> None:
        """Register the layer's expert parameters (on ``device``) with a ``weight_loader`` each."""
        raise NotImplementedError

    def expert_tensor_names(self) -> tuple[str, ...]:
        """Names of the layer's tensors with a leading expert dimension. Each moves with its expert."""
        raise NotImplementedError

    def process_expert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Post-load processing (repacking, scale reshaping) of one expert's tensors, each without the
        leading expert dim. Runs per expert, so the cache can run it into its host store.
        Must return the same names; shapes may change (but identically for every expert)."""
        return tensors

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Uncached layers: apply ``process_expert`` to every expert in place."""
        if type(self).process_expert is FusedMoEMethodBase.process_expert:
            return  # identity: no per-expert copies, no transient [E, ...] tensors
        names = self.expert_tensor_names()
        num_experts = getattr(layer, names[0]).shape[0]
        per_expert = [self.process_expert({n: getattr(layer, n)[e] for n in names})
                      for e in range(num_experts)]
        for n in names:
            new = torch.stack([p[n] for p in per_expert])
            old = getattr(layer, n)
            if new.shape != old.shape or new.dtype != old.dtype:
                setattr(layer, n, nn.Parameter(new, requires_grad=False))
            elif new.data_ptr() != old.data_ptr():
                old.data.copy_(new)

    def apply_pairs(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, out: torch.Tensor) -> None:
        """out[t, k] = w[t, k] * expert(x[t]) for pairs with topk_ids >= 0 (ids index the layer's
        expert tensors, which hold experts or cache slots). Other pairs are untouched."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, K]: every pair computed, then reduced over top_k in k order."""
        # [T, top_k, K] pairs, skipped ones 0; dead after the combine, so a reused buffer.
        out = scratch("moe.pairs", (*topk_ids.shape, x.shape[-1]), x.dtype, x.device).zero_()
        self.apply_pairs(layer, x, topk_weights, topk_ids, out)
        return combine_pairs(out)
