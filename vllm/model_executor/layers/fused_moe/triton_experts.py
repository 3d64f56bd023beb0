"""The "triton" MoE expert backend: the Triton fused-MoE kernels (``vllm/kernels/triton/
fused_moe.py``) behind the ``MoEExperts`` pair contract, unquantized experts only.

It reads the loaded layout as is (w13 [G, 2N, H] or [G, N, H] non-gated, w2 [G, H, N], the
optional biases) and writes the pairs of each wave straight into the layer's ``out``
[T, K, H]; the ids are expert ids, or the expert cache's slot ids (the kernels never know which).
Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it).
NOT YET RUN ON A GPU: interpreted and compiled (SM90/SM120) only; block sizes untuned.
"""
from __future__ import annotations

import torch

from vllm.kernels.triton import triton_refusal
from vllm.model_executor.layers.fused_moe.modular_kernel import (MoEActivation, MoEExperts,
                                                                 MoEKernelQuery)
from vllm.platforms import platform_for

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_moe_refusal(q: MoEKernelQuery) -> str | None:
    """The registry's extra check: a Triton kernel must be able to run on the platform's
    tensors (CUDA, or CPU under the interpreter), and bf16 products need SM 8.0."""
    reason = triton_refusal(q.platform.device_type)
    if reason is not None:
        return reason
    cap = q.platform.get_device_capability()
    if cap is not None and q.dtype == torch.bfloat16 and cap.to_int() < 80:
        return f"bfloat16 tl.dot needs SM >= 80, the device is SM {cap.to_int()}"
    return None


class TritonExperts(MoEExperts):
    """``fused_moe_pairs`` over the layer's tensors (no repacking)."""
    name = "triton"
    cuda_graph_safe = True    # grids and block sizes fixed by [T, top_k] and G; no host read

    def __init__(self, activation: MoEActivation):
        self.activation = activation
        self._device_names: dict[torch.device, str] = {}

    def _device_name(self, device: torch.device) -> str:
        """The name the block-size tables are keyed by (asked of the platform once)."""
        if device not in self._device_names:
            self._device_names[device] = platform_for(device).device_name(device)
        return self._device_names[device]

    def apply_pairs(self, weights, x, topk_weights, ids, out):
        # Imported here: triton is optional, and the registry module imports this one.
        from vllm.kernels.triton.fused_moe import fused_moe_pairs
        act = self.activation
        fused_moe_pairs(x, weights["w13_weight"], weights["w2_weight"], topk_weights, ids, out,
                        act.name, act.alpha, act.limit, weights.get("w13_bias"),
                        weights.get("w2_bias"), device_name=self._device_name(x.device))
