"""Plain projection layers that skip random initialisation (weights always come from a checkpoint).

On the CPU with the C kernels available (f32/bf16), ``finish_loading`` swaps ``weight`` for its
packed layout (``vllm/kernels/cpu/ops.prepack``) and ``forward`` runs ``dense_linear``; elsewhere
the layer is ``nn.Linear``. One copy of the weight exists either way.

``fuse_linears`` joins projections of one input (q/k/v, gate/up) into one weight where they run as
``nn.Linear`` (a GPU: one GEMM launch instead of three); the members keep their parameter names
as views of it. Where they are packed for the C kernel they stay apart (same bits as before).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vllm.kernels.cpu.ops import dense_linear, prepack
from vllm.platforms import native_kernels


QKV = ("q_proj", "k_proj", "v_proj")
"""An attention module's projections of one input (``fuse_projections``, ``project``)."""
GATE_UP = ("gate_proj", "up_proj")
"""A gated MLP's projections of one input."""


class Linear(nn.Linear):
    """``nn.Linear`` whose parameters are left uninitialised: building a large model stays cheap."""

    def reset_parameters(self) -> None:
        # Every weight is overwritten by the loader; a missing one is reported as an error there.
        pass

    def finish_loading(self, device: torch.device) -> None:
        """After the checkpoint is loaded: pack ``weight`` for the CPU kernel where it applies.
        The packed tensor replaces ``weight`` (no second copy), so ``weight`` is gone after."""
        if "packed_weight" in self._buffers or not native_kernels(self.weight.dtype, device):
            return
        packed = prepack(self.weight.data)
        del self.weight
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._buffers.get("packed_weight")
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return dense_linear(x, packed, self.out_features, self.bias)


def fuse_linears(linears: Sequence[Linear], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """After loading, before ``finish_loading``: the members' weights (and biases) concatenated
    along the output dim, [sum(out), in], each member's parameter re-pointed to its rows (views:
    one copy); or None, changing nothing, where the members will run the packed C kernel or do
    not share input size, dtype and bias presence. ``F.linear(x, w, b).split(outs, -1)`` is then
    the members' outputs (as column views of one [T, sum(out)] result)."""
    first = linears[0]
    if any("packed_weight" in m._buffers for m in linears) or native_kernels(first.weight.dtype,
                                                                             device):
        return None
    if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
           or (m.bias is None) != (first.bias is None) for m in linears):
        return None
    weight = torch.cat([m.weight.data for m in linears])
    bias = None if first.bias is None else torch.cat([m.bias.data for m in linears])
    row = 0
    for m in linears:
        rows = slice(row, row + m.out_features)
        m.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[rows], requires_grad=False)
        row += m.out_features
    return weight, bias


def fuse_projections(module: nn.Module, names: Sequence[str], device: torch.device) -> None:
    """``fuse_linears`` of ``module``'s Linears ``names`` (a module's ``finish_loading``: q/k/v
    of attention, gate/up of a gated MLP); where it applies, the joined weight and bias are
    ``module``'s ``fused_weight`` / ``fused_bias`` buffers, which ``project`` then uses."""
    fused = fuse_linears([getattr(module, n) for n in names], device)
    if fused is not None:
        module.register_buffer("fused_weight", fused[0], persistent=False)
        module.register_buffer("fused_bias", fused[1], persistent=False)


def project(module: nn.Module, names: Sequence[str], x: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
    """x [T, H] -> each Linear of ``names`` applied to x: column views [T, n] of one GEMM's
    output after ``fuse_projections``, else the Linears' own outputs."""
    linears = [getattr(module, n) for n in names]
    if "fused_weight" in module._buffers:
        sizes = [m.out_features for m in linears]
        return F.linear(x, module.fused_weight, module.fused_bias).split(sizes, -1)
    return tuple(m(x) for m in linears)
