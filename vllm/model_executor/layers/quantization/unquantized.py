"""Unquantized experts: w13 [E, 2N, K] and w2 [E, K, N] in the model dtype, as loaded; a backend
with a ``pack`` step (the CPU kernel) repacks each expert after loading."""
from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe.backend import ExpertBackend, select_expert_backend
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref
from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase, MoEShape


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def __init__(self, activation: str = "silu"):
        self.activation = activation
        self.backend = ExpertBackend("torch", expert_pairs_ref)
        """Chosen in ``create_weights`` by ``select_expert_backend``."""

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def create_weights(self, layer: nn.Module, shape: MoEShape, device: torch.device) -> None:
        E, K, N = shape.num_experts, shape.hidden_size, shape.intermediate_size
        w13 = nn.Parameter(torch.empty(E, 2 * N, K, dtype=shape.params_dtype, device=device),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(E, K, N, dtype=shape.params_dtype, device=device),
                          requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        self.backend = select_expert_backend(K, N, shape.params_dtype)

    def expert_tensor_names(self) -> tuple[str, ...]:
        return ("w13_weight", "w2_weight")

    def process_expert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.backend.pack is None:
            return tensors
        return {name: self.backend.pack(t) for name, t in tensors.items()}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.backend.pack is None:
            return  # weights stay as loaded: no per-expert copies
        for name in self.expert_tensor_names():
            # The stacked [E, ...] weights pack in one go: the layout is per expert.
            packed = self.backend.pack(getattr(layer, name).data)
            setattr(layer, name, nn.Parameter(packed, requires_grad=False))

    def apply_pairs(self, layer, x, topk_weights, topk_ids, out) -> None:
        self.backend.pairs(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, out,
                           self.activation)
