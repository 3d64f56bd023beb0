"""The CUDA platform (NVIDIA GPUs). Compiled ops of our own (``csrc/`` -> ``vllm._C``) only where a
CUDA build made them: today the expert cache's gather copy. Every other op runs its torch
implementation, and ``grouped_mm`` (torch._grouped_mm, SM 9.0+) is the fast MoE backend."""
from __future__ import annotations

import functools
import platform as _py_platform
from typing import Callable

import torch

from vllm.kernels.cuda import ops as cuda_ops
from vllm.platforms.interface import DeviceCapability, Platform


@functools.lru_cache(maxsize=None)
def _in_wsl() -> bool:
    # WSL cannot back non-blocking copies with pinned memory reliably (our users' crash report).
    return "microsoft" in _py_platform.uname().release.lower()


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    moe_backends = ("grouped_mm", "torch")
    attention_backends = ("torch_sdpa",)

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

    def memory_info(self, device: torch.device) -> tuple[int, int] | None:
        return torch.cuda.mem_get_info(device)
