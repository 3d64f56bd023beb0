"""Plain projection layers that skip random initialisation (weights always come from a checkpoint).

On the CPU with the C kernels available (f32/bf16), ``finish_loading`` swaps ``weight`` for its
packed layout (``vllm/kernels/cpu/ops.prepack``) and ``forward`` runs ``dense_linear``; elsewhere
the layer is ``nn.Linear``. One copy of the weight exists either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.kernels.cpu.ops import dense_linear, prepack
from vllm.platforms import native_kernels


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
