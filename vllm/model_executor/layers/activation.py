"""Activation functions by Hugging Face ``hidden_act`` name, and the gated products built on
them: the platform's fused kernels where it has them (CUDA: Triton, ``elementwise_ops``), the C
kernels on CPU (``vllm/kernels/cpu/activation.c``), torch elsewhere."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from vllm.kernels.cpu import ops
from vllm.platforms import elementwise_ops, native_kernels

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    # Nemotron-H's MLPs and experts (HF ReLUSquaredActivation): square(relu(x)).
    "relu2": lambda x: torch.square(F.relu(x)),
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTS:
        raise ValueError(f"hidden_act={name!r} is not supported: must be one of {sorted(_ACTS)}")
    return _ACTS[name]


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``, [..., N] each."""
    fused = elementwise_ops(gate.dtype, gate.device)
    if fused is not None:
        return fused.silu_and_mul(gate, up)
    if native_kernels(gate.dtype, gate.device):
        return ops.silu_and_mul(gate, up)
    return F.silu(gate) * up


def gelu_and_mul(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(gate, approximate=approximate) * up``, [..., N] each (no C kernel: torch on CPU)."""
    fused = elementwise_ops(gate.dtype, gate.device)
    if fused is not None:
        return fused.gelu_and_mul(gate, up, approximate)
    return F.gelu(gate, approximate=approximate) * up


_GELU_APPROXIMATE = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


def get_act_and_mul_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(gate, up) -> act(gate) * up`` for a ``hidden_act`` name (a gated MLP's middle)."""
    act = get_act_fn(name)
    if act is F.silu:
        return silu_and_mul
    if name in _GELU_APPROXIMATE:
        return functools.partial(gelu_and_mul, approximate=_GELU_APPROXIMATE[name])
    return lambda gate, up: act(gate) * up


def sigmoid_gated_add(x: torch.Tensor, gate_logits: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
    """``x + torch.sigmoid(gate_logits) * y``: x, y [T, H], gate_logits [T, 1] (Qwen2-MoE adds
    its shared expert y to the routed output x this way)."""
    if native_kernels(x.dtype, x.device):
        return ops.sigmoid_gate_add(x, gate_logits, y)
    return x + torch.sigmoid(gate_logits) * y
