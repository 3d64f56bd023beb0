"""RMSNorm with Hugging Face semantics: normalise in float32, cast back, then scale.

One kernel call where the platform has one: the fused ops of ``elementwise_ops`` (CUDA: Triton,
``vllm/kernels/triton/elementwise.py``), else the C kernel (CPU, f32/bf16:
``vllm/kernels/cpu/layernorm.c``); ``forward_torch`` is the torch version (elsewhere, and the
kernels' reference). With a residual, the add and the norm are one launch on CUDA (Triton's
``add_rms_norm``), an add then the norm elsewhere (CPU graphs record the add as a C node)."""
from __future__ import annotations

import torch
from torch import nn

from vllm.kernels.cpu.ops import rms_norm
from vllm.platforms import elementwise_ops, native_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., hidden_size] -> same shape and dtype. With ``residual`` (x's shape and dtype):
        (norm(s), s), s = x + residual rounded to the dtype: bitwise the add then the norm, in
        one launch where the platform fuses them (``add_rms_norm``): a pre-norm block's residual
        add folded into the next norm."""
        if residual is not None:
            if x.dtype == self.weight.dtype == residual.dtype:
                fused = elementwise_ops(x.dtype, x.device)
                if fused is not None and fused.add_rms_norm is not None:
                    return fused.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
            s = x + residual
            return self.forward(s), s
        if x.dtype == self.weight.dtype:
            fused = elementwise_ops(x.dtype, x.device)
            if fused is not None:
                return fused.rms_norm(x, self.weight, self.variance_epsilon)
            if native_kernels(x.dtype, x.device):
                return rms_norm(x, self.weight, self.variance_epsilon)
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        # HF casts the normalised value back before the (model-dtype) weight multiply.
        return self.weight * xf.to(dtype)
