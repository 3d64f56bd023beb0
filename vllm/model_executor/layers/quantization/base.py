"""The quant-method contract for MoE experts.

A method owns its *scheme*: the layout of a layer's expert tensors, which of them are
expert-indexed (leading dimension E) and their post-load processing. The expert cache builds its
host store and device slots from that declaration alone, so every scale, zero point and g_idx
moves with its expert. The method does not compute: its ``kernel``, the expert backend that
``fused_moe/registry.py`` chooses for the scheme, dtype and platform, runs on whatever tensors
it is handed (the experts, or the cache's slots with slot ids).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from vllm.kernels.cpu.qgemv import QuantRows
from vllm.model_executor.layers.fused_moe.modular_kernel import (BIAS_NAMES, MoEActivation,
                                                                 MoEExperts, MoEKernelQuery,
                                                                 WaveIds, combine_pairs)
from vllm.model_executor.layers.fused_moe.registry import Dequantize, select_moe_backend
from vllm.model_executor.layers.scratch import scratch
from vllm.platforms import Platform


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    params_dtype: torch.dtype
    has_bias: bool = False
    """Experts carry biases: w13_bias [E, 2N] ([gate; up], added after the first projection)
    and w2_bias [E, K] (after the second), in ``params_dtype`` whatever the scheme."""
    gated: bool = True
    """w13 is [gate; up] (2N rows); False: the up projection alone (N rows; Nemotron-H's
    relu2_no_mul), and so is w13_bias."""

    @property
    def w13_rows(self) -> int:
        return self.intermediate_size * (2 if self.gated else 1)



class FusedMoEMethodBase:
    scheme: str = ""
    """The scheme's name as backends declare it ("unquantized", "fp8-block", ...)."""

    def __init__(self, activation: "str | MoEActivation" = "silu"):
        self.activation = MoEActivation.of(activation)
        self.kernel: MoEExperts | None = None
        """Set by ``select_kernel``."""

    @property
    def backend_name(self) -> str:
        return self.kernel.name if self.kernel is not None else ""

    def create_weights(self, layer: nn.Module, shape: MoEShape,
                       device: torch.device | None) -> None:
        """Register the layer's expert parameters (on ``device``) as loading targets."""
        raise NotImplementedError

    @staticmethod
    def create_biases(layer: nn.Module, shape: MoEShape,
                      device: torch.device | None) -> tuple[str, ...]:
        """Register the expert biases when ``shape.has_bias`` (expert-indexed like the weights,
        so they move with their expert); returns their names."""
        if not shape.has_bias:
            return ()
        E, K = shape.num_experts, shape.hidden_size
        for name, size in zip(BIAS_NAMES, (shape.w13_rows, K)):
            layer.register_parameter(name, nn.Parameter(
                torch.zeros(E, size, dtype=shape.params_dtype, device=device),
                requires_grad=False))
        return BIAS_NAMES

    def expert_tensor_names(self) -> tuple[str, ...]:
        """Names of the layer's tensors with a leading expert dimension. Each moves with its expert."""
        raise NotImplementedError

    def dequantizer(self) -> Dequantize | None:
        """How a reference backend turns one expert's tensors into (w13, w2); None: unquantized."""
        return None

    def host_rows(self, tensors: dict[str, torch.Tensor]) -> tuple[QuantRows, QuantRows] | None:
        """One expert's tensors (rows of the host store) -> its (w13, w2) as the CPU's quantized
        matrix product reads them (``kernels/cpu/qgemv.py``: views, nothing copied), for
        experts computed on the host (``moe_expert_cpu_compute``); None where the scheme has no
        such view (unquantized experts are read as they are; other layouts are dequantized)."""
        return None

    def select_kernel(self, shape: MoEShape, platform: Platform, requested: str = "auto") -> None:
        """Choose the expert backend for this layer through the registry (once, at build)."""
        query = MoEKernelQuery(self.scheme, self.activation.name, shape.params_dtype,
                               shape.hidden_size, shape.intermediate_size, platform,
                               shape.has_bias)
        self.kernel = select_moe_backend(query, requested).make(self.activation,
                                                                self.dequantizer())
        # A backend that runs quantized schemes itself (cpu_kernel) asks the method for its
        # layout (``cpu_kernel_layout``) before packing.
        bind = getattr(self.kernel, "bind_scheme", None)
        if bind is not None:
            bind(self)

    # ---- post-load processing ------------------------------------------------------------------
    def process_expert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The scheme's post-load processing (repacking, checks) of one expert's tensors, each
        without the leading expert dim. Must return the same names; shapes may change (but
        identically for every expert)."""
        return tensors

    def prepare_expert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert as the kernel reads it: the scheme's processing, then the backend's layout.
        The expert cache runs this per expert into its host store."""
        return self.kernel.pack(self.process_expert(tensors))

    def process_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Uncached layers: ``prepare_expert`` over the stacked [E, ...] tensors."""
        if type(self).process_expert is not FusedMoEMethodBase.process_expert:
            num_experts = next(iter(weights.values())).shape[0]
            per_expert = [self.process_expert({n: t[e] for n, t in weights.items()})
                          for e in range(num_experts)]
            weights = {n: torch.stack([p[n] for p in per_expert]) for n in weights}
        # The backend's layout is per expert, so it applies to the stack in one go.
        return self.kernel.pack(weights)

    # ---- compute ---------------------------------------------------------------------------------
    def apply_pairs(self, weights: dict[str, torch.Tensor], x: torch.Tensor,
                    topk_weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                    max_ids: int | None = None) -> None:
        """out[t, k] = w[t, k] * expert(x[t]) for pairs with ids >= 0 (ids index ``weights``,
        which hold experts or cache slots). Other pairs are untouched. ``max_ids``: at most
        that many distinct ids (``WaveIds``)."""
        self.kernel.apply_pairs(weights, x, topk_weights, ids, out, max_ids=max_ids)

    def apply(self, weights: dict[str, torch.Tensor], x: torch.Tensor,
              topk_weights: torch.Tensor, waves: Iterable[WaveIds],
              host_pairs: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. ``waves``: the ids [T, top_k] of each wave (one wave of expert ids
        without a cache) with their bounds (``WaveIds``); every pair is computed in exactly one
        wave, then all are reduced over top_k in k order, the same reduction however the step
        was split. ``host_pairs``: called
        after the waves are enqueued (so the CPU works while the device does) with the
        [T, top_k, H] pairs, it writes the pairs computed elsewhere, which the waves skip (ids
        -1) and so left 0."""
        # [T, top_k, H] pairs, skipped ones 0; dead after the combine, so a reused buffer.
        out = scratch("moe.pairs", (*topk_weights.shape, x.shape[-1]), x.dtype, x.device).zero_()
        waves = iter(waves)
        try:
            for wave in waves:
                self.apply_pairs(weights, x, topk_weights, wave.ids, out, max_ids=wave.max_ids)
        finally:
            # A wave that raised closes the plan now, not when it is collected: an overlapped
            # wave joins its side stream on close (before a graph capture's capture_end runs).
            getattr(waves, "close", lambda: None)()
        if host_pairs is not None:
            host_pairs(out)
        return combine_pairs(out)
