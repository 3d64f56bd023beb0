"""Platforms: the one place that probes the machine (see ``interface.py``).

``platform_for(device)`` gives the platform of a device (one instance per device type);
``current_platform`` is the platform "auto" resolves to on this machine (CUDA when a GPU is
visible, else CPU), chosen once on first use.
"""
from __future__ import annotations

import torch

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import (DeviceCapability, ElementwiseOps, Platform,
                                      UnspecifiedPlatform)

_PLATFORMS: dict[str, Platform] = {"cpu": CpuPlatform(), "cuda": CudaPlatform()}
DEVICE_TYPES = tuple(_PLATFORMS)
"""The device types the engine runs on."""


def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` ("cpu", "cuda", "cuda:1", a torch.device). Other torch device
    types get an ``UnspecifiedPlatform`` (only ``resolve_device`` refuses them)."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    platform = _PLATFORMS.get(kind)
    if platform is None:
        platform = _PLATFORMS[kind] = UnspecifiedPlatform(kind)
    return platform


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when a GPU is visible, else "cpu"; others are checked to exist."""
    if device == "auto":
        return "cuda" if _PLATFORMS["cuda"].is_available() else "cpu"
    if not isinstance(device, str) or device.split(":")[0] not in DEVICE_TYPES:
        raise ValueError(f"device={device!r} is invalid: must be 'auto' or one of "
                         f"{list(DEVICE_TYPES)}")
    if not platform_for(device).is_available():
        raise ValueError(f"device={device!r}: {device.split(':')[0]} is not available on this "
                         "machine")
    return device


def native_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an op on ``device`` in ``dtype`` runs the platform's compiled kernel rather than
    its torch implementation. Never while torch.compile traces: a kernel called through ctypes
    cannot be traced, so compiled graphs hold the torch ops."""
    return (not torch.compiler.is_compiling()
            and platform_for(device).has_native_kernels(dtype))


def elementwise_ops(dtype: torch.dtype, device: torch.device) -> ElementwiseOps | None:
    """The platform's fused kernels for ``dtype`` tensors on ``device`` (RMSNorm, gated
    activations, rotary, softmax routing), or None: the op then asks ``native_kernels``. Never
    while torch.compile traces (compiled graphs hold the torch ops)."""
    if torch.compiler.is_compiling():
        return None
    ops = platform_for(device).elementwise_ops()
    return ops if ops is not None and dtype in ops.dtypes else None


def __getattr__(name: str):
    if name == "current_platform":
        return platform_for(resolve_device("auto"))
    raise AttributeError(f"module 'vllm.platforms' has no attribute {name!r}")


__all__ = ["DeviceCapability", "ElementwiseOps", "Platform", "platform_for", "resolve_device",
           "native_kernels", "elementwise_ops", "current_platform", "DEVICE_TYPES"]
