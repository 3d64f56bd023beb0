"""Activation functions by Hugging Face ``hidden_act`` name."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTS:
        raise ValueError(f"hidden_act={name!r} is not supported: must be one of {sorted(_ACTS)}")
    return _ACTS[name]
