"""Unquantized experts: w13 [E, 2N, K] and w2 [E, K, N] in the model dtype, as loaded (a backend
with its own layout, the CPU kernel, repacks them through ``MoEExperts.pack``), plus the biases
w13_bias [E, 2N] and w2_bias [E, K] when the layer has them. Non-gated experts
(``MoEShape.gated`` False) have N rows instead of 2N: w13 [E, N, K], w13_bias [E, N]."""
from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase, MoEShape


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    scheme = "unquantized"
    _biases: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module, shape: MoEShape, device: torch.device | None) -> None:
        E, K, N = shape.num_experts, shape.hidden_size, shape.intermediate_size
        w13 = nn.Parameter(torch.empty(E, shape.w13_rows, K, dtype=shape.params_dtype,
                                       device=device),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(E, K, N, dtype=shape.params_dtype, device=device),
                          requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        self._biases = self.create_biases(layer, shape, device)

    def expert_tensor_names(self) -> tuple[str, ...]:
        return ("w13_weight", "w2_weight", *self._biases)
