"""The CPU platform: the C kernels of ``vllm/kernels/cpu`` where they are built."""
from __future__ import annotations

import platform as _py_platform
from typing import Callable

import torch

from vllm.kernels.cpu import moe_cache
from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.kernels.cpu.graph import capturing
from vllm.kernels.cpu.ops import KERNEL_DTYPES
from vllm.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    moe_backends = ("cpu_kernel", "grouped_mm", "torch")
    attention_backends = ("cpu_paged", "torch_sdpa")

    def is_available(self) -> bool:
        return True

    def device_name(self, device: torch.device | None = None) -> str:
        return _py_platform.processor() or _py_platform.machine() or "cpu"

    def has_native_kernels(self, dtype: torch.dtype) -> bool:
        if dtype not in KERNEL_DTYPES:
            return False
        # Built (or loaded from its cache) on first use; None without a C compiler or with
        # VLLM_CPU_KERNELS=0. The loader caches its answer, so this is a cheap call per op.
        return load_cpu_kernels() is not None

    def expert_copy_kernel(self) -> Callable[..., None] | None:
        # Host store and slots share the RAM: a memcpy per miss, recorded by CPU graphs.
        return moe_cache.expert_copy if load_cpu_kernels() is not None else None

    def is_capturing(self) -> bool:
        return capturing()

    def residency_step_kernel(self) -> Callable[..., None] | None:
        return moe_cache.residency_step if load_cpu_kernels() is not None else None
