"""Unquantized experts: w13 [E, 2N, K] and w2 [E, K, N] in the model dtype."""
from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe.backend import select_expert_backend
from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase, MoEShape


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def __init__(self, activation: str = "silu"):
        self.activation = activation
        self.backend_name, self._expert_pairs = "torch", None

    def create_weights(self, layer: nn.Module, shape: MoEShape, device: torch.device) -> None:
        E, K, N = shape.num_experts, shape.hidden_size, shape.intermediate_size
        w13 = nn.Parameter(torch.empty(E, 2 * N, K, dtype=shape.params_dtype, device=device),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(E, K, N, dtype=shape.params_dtype, device=device),
                          requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        self.backend_name, self._expert_pairs = select_expert_backend(K, N, shape.params_dtype)

    def expert_tensor_names(self) -> tuple[str, ...]:
        return ("w13_weight", "w2_weight")

    def apply_pairs(self, layer, x, topk_weights, topk_ids, out) -> None:
        self._expert_pairs(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, out,
                           self.activation)
