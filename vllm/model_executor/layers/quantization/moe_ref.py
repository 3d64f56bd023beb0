"""Shared base of the quantized MoE methods: parameter creation from a per-expert layout, checkpoint
tensor declarations, and the dequantization the reference backend computes with.

Layer layout: every expert-indexed tensor is ``w13_<name>`` ([E, ...], gate rows then up rows
along dim 0 of one expert's tensor, so ``FusedMoE.load_expert_weight`` fuses shards as halves of
dim 0) or ``w2_<name>``. Checkpoint tensors are per expert and per projection
(``...experts.{e}.gate_proj.<suffix>``); ``load_transform`` turns one into the layer's layout.

Compute: the ``torch`` backend (``fused_moe/registry.py``) dequantizes, for each expert row
present in the ids, that row of every expert tensor (slot rows when cached) with ``dequantize``
and runs the plain expert MLP; the same row bits give the same result with or without the
cache. A quantized kernel registers as another backend for the scheme and receives the same
tensors (weights and every scale, zero point and g_idx), indexed by the same slot ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase, MoEShape


@dataclass(frozen=True)
class CheckpointTensor:
    suffix: str
    """Name after the projection module in the checkpoint, e.g. "weight_scale"."""
    required: bool = True
    """Loading fails, naming the tensor, when a required one is absent."""
    shared: bool = False
    """One value for all experts (input scales): kept as the max over experts and shards in a
    0-d ``w13_<suffix>`` / ``w2_<suffix>`` param on the compute device; never expert-indexed."""
    param: str | None = None
    """The layer's name for it (``w13_<param>``) when it differs from the checkpoint's: a
    format mapped onto another scheme's layout (compressed-tensors ``weight_packed`` ->
    ``qweight``)."""
    check_only: bool = False
    """Validated by ``check_tensor`` and dropped (compressed-tensors ``weight_shape``)."""

    @property
    def name(self) -> str:
        """Suffix of the layer parameter it loads into."""
        return self.param or self.suffix


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    """Per-expert shape in the layer's layout (without the leading E)."""
    dtype: torch.dtype
    fill: int | float = 0


class QuantizedFusedMoEMethod(FusedMoEMethodBase):
    """Subclasses define ``checkpoint_tensors``, ``layout``, ``load_transform`` and ``dequantize``."""

    checkpoint_tensors: tuple[CheckpointTensor, ...] = ()

    def __init__(self, activation: str = "silu"):
        super().__init__(activation)
        self._names: tuple[str, ...] = ()

    # ---- layout ------------------------------------------------------------------------------
    def layout(self, shape: MoEShape) -> dict[str, TensorSpec]:
        """Expert-indexed param name -> per-expert spec. Validates the shape for the format."""
        raise NotImplementedError

    def create_weights(self, layer: nn.Module, shape: MoEShape, device: torch.device | None) -> None:
        specs = self.layout(shape)
        for name, spec in specs.items():
            t = torch.full((shape.num_experts, *spec.shape), spec.fill, dtype=spec.dtype,
                           device=device)
            layer.register_parameter(name, nn.Parameter(t, requires_grad=False))
        # Biases stay in the model dtype: only the weights are quantized.
        self._names = (*specs, *self.create_biases(layer, shape, device))
        for ct in self.checkpoint_tensors:
            if ct.shared:
                for proj in ("w13", "w2"):
                    # device=None: the ambient (compute) device, even when experts are born on the
                    # host for the cache; shared tensors never go through the store.
                    layer.register_parameter(f"{proj}_{ct.name}", nn.Parameter(
                        torch.zeros((), dtype=torch.float32), requires_grad=False))

    def expert_tensor_names(self) -> tuple[str, ...]:
        if not self._names:
            raise RuntimeError(f"{type(self).__name__}: expert_tensor_names() before create_weights")
        return self._names

    def shared_param_names(self) -> tuple[str, ...]:
        return tuple(f"{p}_{ct.name}" for ct in self.checkpoint_tensors if ct.shared
                     for p in ("w13", "w2"))

    # ---- loading -----------------------------------------------------------------------------
    def load_transform(self, suffix: str, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        """One checkpoint tensor (one expert, one projection) -> the layer layout of that shard.
        proj: "w13" (gate or up) or "w2". Raise ValueError on a wrong dtype."""
        return tensor

    def expert_from_checkpoint(self, gate: dict[str, torch.Tensor], up: dict[str, torch.Tensor],
                               down: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One gated expert's tensors in the layer layout, as the loader builds them, then
        ``process_expert``. gate, up [N, H] and down [H, N]: checkpoint suffix -> tensor as a
        checkpoint stores it. Each goes through ``load_transform`` (loaded under
        ``CheckpointTensor.name``); gate and up fill the halves of dim 0 of ``w13_<name>``
        (``FusedMoE.load_expert_weight``), down is ``w2_<name>``. Shared and ``check_only``
        tensors are not expert tensors: refused."""
        specs = {ct.suffix: ct for ct in self.checkpoint_tensors}
        t = {}
        for suffix in gate:
            ct = specs.get(suffix)
            if ct is None or ct.shared or ct.check_only:
                raise ValueError(f"{type(self).__name__}: {suffix!r} is not one of its expert "
                                 "tensors")
            g, u, d = (self.load_transform(suffix, p, ck[suffix])
                       for p, ck in zip(("w13", "w13", "w2"), (gate, up, down)))
            t[f"w13_{ct.name}"], t[f"w2_{ct.name}"] = torch.cat([g, u]), d
        return self.process_expert(t)

    def check_tensor(self, suffix: str, proj: str, tensor: torch.Tensor) -> None:
        """Validate a ``check_only`` checkpoint tensor (one expert, one projection)."""
        raise NotImplementedError(f"{type(self).__name__} declares no check_only tensor")

    def load_shared(self, layer: nn.Module, param: str, tensor: torch.Tensor) -> None:
        """Fold one expert's shared scale into the layer's (max over experts and shards)."""
        if tensor.numel() != 1:
            raise ValueError(f"{param}: expected one value per expert, got shape "
                             f"{tuple(tensor.shape)}")
        p = getattr(layer, param)
        p.data.copy_(torch.maximum(p.data, tensor.reshape(()).to(p.device, torch.float32)))

    # ---- compute -----------------------------------------------------------------------------
    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's tensors (row e of every expert tensor) -> (w13 [2N, K], w2 [K, N])."""
        raise NotImplementedError

    def dequantizer(self):
        # Late-bound: the backend calls whatever ``dequantize`` the method has at call time.
        return lambda tensors, dtype: self.dequantize(tensors, dtype)

    def expert_row(self, weights: dict[str, torch.Tensor], e: int) -> dict[str, torch.Tensor]:
        """Row ``e`` of every expert tensor in ``weights`` (experts, or slots when cached):
        views, no copy."""
        return {n: weights[n][e] for n in self._names}


def stack_experts(per_expert: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Experts' tensors (one dict each, the same names) -> name -> [E, ...]."""
    return {n: torch.stack([t[n] for t in per_expert]) for n in per_expert[0]}


def require_multiple(what: str, value: int, of: int, fmt: str) -> None:
    if value % of:
        raise ValueError(f"{fmt}: {what}={value} is not a multiple of {of}, which the format "
                         "requires")


def check_dtype(name: str, tensor: torch.Tensor, *allowed: torch.dtype) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{name} has dtype {tensor.dtype}; the format stores it as "
                         f"{' or '.join(str(a) for a in allowed)}")


def scalar_to(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A one-value scale ([] or [1]) as ``shape``; other shapes are left for the shape check."""
    return tensor.reshape(shape) if tensor.numel() == 1 else tensor
