"""The CUDA platform (NVIDIA GPUs). Compiled ops of our own (``csrc/`` -> ``vllm._C``) only where a
CUDA build made them: today the expert cache's gather copy; the expert cache's residency step is
a Triton kernel (``vllm/kernels/triton``). Every other op runs its torch implementation, and
``grouped_mm`` (torch._grouped_mm, SM 9.0+) is the fast MoE backend."""
from __future__ import annotations

import functools
import platform as _py_platform
from typing import Callable

import torch

from vllm.kernels.cuda import ops as cuda_ops
from vllm.logger import init_logger
from vllm.platforms.interface import DeviceCapability, Platform

logger = init_logger(__name__)


@functools.cache
def _triton_residency_step() -> Callable[..., None] | None:
    """The Triton residency step, or None (with one warning naming the package) where triton is
    not installed: the cache then runs the tensor-op reference step, exact but ~40 launches per
    wave."""
    try:
        from vllm.kernels.triton.residency_step import residency_step
    except ImportError as e:
        logger.warning("expert cache: the fused residency step needs the 'triton' package (%s); "
                       "using the tensor-op step. Install it with pip install triton", e)
        return None
    return residency_step


@functools.lru_cache(maxsize=None)
def _in_wsl() -> bool:
    # WSL cannot back non-blocking copies with pinned memory reliably (our users' crash report).
    return "microsoft" in _py_platform.uname().release.lower()


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    moe_backends = ("grouped_mm", "torch")
    attention_backends = ("torch_sdpa",)
    mamba_backends = ("mamba_ssm", "torch")
    gdn_backends = ("fla", "torch")

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_name(self, device: torch.device | None = None) -> str:
        return torch.cuda.get_device_name(device) if self.is_available() else "no CUDA device"

    def get_device_capability(self, device: torch.device | None = None
                              ) -> DeviceCapability | None:
        if not self.is_available():
            return None
        return DeviceCapability(*torch.cuda.get_device_capability(device))

    def is_pin_memory_available(self) -> bool:
        return not _in_wsl()

    def expert_copy_kernel(self) -> Callable[..., None] | None:
        return cuda_ops.expert_gather if cuda_ops.load_cuda_ops() else None

    def residency_step_kernel(self) -> Callable[..., None] | None:
        return _triton_residency_step()

    def memory_info(self, device: torch.device) -> tuple[int, int] | None:
        return torch.cuda.mem_get_info(device)
