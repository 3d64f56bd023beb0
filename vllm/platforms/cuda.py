"""The CUDA platform (NVIDIA GPUs). Compiled ops of our own (``csrc/`` -> ``vllm._C``) only where a
CUDA build made them: today the expert cache's gather copy. Triton kernels
(``vllm/kernels/triton``): the expert cache's residency step, its gather copy where there is no
``vllm._C`` (``expert_copy_kernel``), RMSNorm, the gated activations and rotary
(``elementwise_ops``). Every other op runs its torch implementation. Backends, in auto order:
MoE ``triton``, ``grouped_mm`` (torch._grouped_mm, SM 9.0+), ``torch``; attention
``triton_paged``, ``torch_sdpa``."""
from __future__ import annotations

import contextlib
import functools
import logging
import platform as _py_platform
from typing import Callable

import torch

from vllm.kernels.cuda import ops as cuda_ops
from vllm.logger import init_logger, log_once
from vllm.platforms.interface import DeviceCapability, ElementwiseOps, Platform

logger = init_logger(__name__)

PINNED_ROUNDING_MSG = (
    "Expert cache: vllm._C's exact-size pinned allocator is unavailable ({reason}), so the "
    "host expert store is pinned with torch's allocator, which rounds each tensor up to a power "
    "of two of bytes (up to 2x the locked host memory); a CUDA build with it (docs/build.md) "
    "allocates exact sizes.")
"""Formatted with ``reason``: ``ops.empty_pinned_missing_reason()`` (VLLM_CUDA_OPS=0, no or a
broken vllm._C, or a build older than the allocator)."""


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


@functools.cache
def _triton_expert_gather() -> Callable[..., None] | None:
    """The Triton expert gather, or None (with one warning naming the package) where triton is
    not installed: the cache then copies misses with torch ops, one host sync per wave (and its
    layers are refused by CUDA graphs)."""
    try:
        from vllm.kernels.triton.expert_gather import expert_gather
    except ImportError as e:
        logger.warning("expert cache: the sync-free miss copy needs a CUDA build (vllm._C) or "
                       "the 'triton' package (%s); copying with torch ops. Install it with pip "
                       "install triton", e)
        return None
    return expert_gather


@functools.cache
def _triton_expert_gather_many() -> Callable[..., None] | None:
    """The Triton twin of ``expert_gather_many``, or None where triton is not installed (the
    one-tensor path above then says why)."""
    try:
        from vllm.kernels.triton.expert_gather_many import expert_gather_many
    except ImportError:
        return None
    return expert_gather_many


@functools.cache
def _triton_elementwise_ops() -> ElementwiseOps | None:
    """The Triton RMSNorm / gated activations / rotary, or None (with one warning naming the
    package) where triton is not installed: the layers then run their torch ops."""
    try:
        import vllm.kernels.triton.elementwise as ew
        from vllm.kernels.triton.router import topk_softmax
    except ImportError as e:
        logger.warning("the fused RMSNorm, activation, rotary and routing kernels need the "
                       "'triton' package (%s); using torch ops. Install it with pip install "
                       "triton", e)
        return None
    return ElementwiseOps(ew.DTYPES, ew.rms_norm, ew.silu_and_mul, ew.gelu_and_mul,
                          ew.rotary_embedding, topk_softmax, ew.add_rms_norm,
                          ew.qk_norm_rotary)


class CudaSideStream:
    """``SideStream`` on CUDA streams: fork = a role's stream waits for the current one, join =
    the current one waits for the event recorded at the end of this handle's last fork of that
    role (both events, so a graph capture records them). A handle per caller over one stream per
    (device, role) (``_device_side_stream``): a join waits for its own layer's copy, not for
    copies other layers forked after it, and a layer's miss copies ("misses") never queue behind
    the next layer's prefetch ("prefetch"), forked before them. "misses" ran on an H100
    (2026-11-26): the overlap gpu test passed; "prefetch" has not yet run on a GPU."""

    def __init__(self, device: torch.device):
        # The device and its streams are resolved at the first fork: a handle is made when a
        # layer is built (the residency step's account asks for one), also where torch has no
        # CUDA (the CPU tests of the CUDA platform's choices).
        self._device = torch.device(device)
        self._done: dict[str, torch.cuda.Event] = {}

    @property
    def device(self) -> torch.device:
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    @property
    def streams(self) -> dict[str, torch.cuda.Stream]:
        """The device's stream of each role (made at first use, shared by its handles)."""
        return {r: _device_side_stream(self.device.index, r) for r in SIDE_STREAM_ROLES}

    @contextlib.contextmanager
    def fork(self, role: str = "misses"):
        if role not in SIDE_STREAM_ROLES:
            raise ValueError(f"side stream role {role!r}: allowed {SIDE_STREAM_ROLES}")
        stream = _device_side_stream(self.device.index, role)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                yield
        finally:                               # even if the forked work raised: join waits for it
            self._done[role] = torch.cuda.Event()
            self._done[role].record(stream)

    def join(self, role: str = "misses") -> None:
        done = self._done.get(role)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)


SIDE_STREAM_ROLES = ("misses", "prefetch", "account")


@functools.cache
def _device_side_stream(index: int, role: str) -> torch.cuda.Stream:
    """The side stream of GPU ``index`` for ``role`` (``SIDE_STREAM_ROLES``). One per device and
    role, not one per layer: PyTorch hands out ``torch.cuda.Stream()``s round-robin from a pool
    of 32 per device and priority, so past 32 layers theirs would silently alias each other.
    Default priority: the decode-graph capture stream is drawn from the high-priority pool
    (``worker/graph_capture.py``), so they never coincide."""
    return torch.cuda.Stream(torch.device("cuda", index))


@functools.lru_cache(maxsize=None)
def _in_wsl() -> bool:
    # WSL cannot back non-blocking copies with pinned memory reliably (our users' crash report).
    return "microsoft" in _py_platform.uname().release.lower()


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    moe_backends = ("triton", "grouped_mm", "torch")
    attention_backends = ("triton_paged", "torch_sdpa")
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

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device | None = None) -> torch.Tensor:
        if cuda_ops.has_empty_pinned():
            return cuda_ops.empty_pinned(shape, dtype, device)
        log_once(logger, logging.WARNING, PINNED_ROUNDING_MSG.format(
            reason=cuda_ops.empty_pinned_missing_reason()))
        return super().empty_pinned(shape, dtype, device)

    def expert_copy_kernel(self) -> Callable[..., None] | None:
        return cuda_ops.expert_gather if cuda_ops.load_cuda_ops() else _triton_expert_gather()

    def expert_copy_many_kernel(self) -> Callable[..., None] | None:
        if cuda_ops.has_expert_gather_many():
            return cuda_ops.expert_gather_many
        # An older vllm._C without it keeps its one-tensor op (the gather it was tested with).
        return None if cuda_ops.load_cuda_ops() else _triton_expert_gather_many()

    def residency_step_kernel(self) -> Callable[..., None] | None:
        return _triton_residency_step()

    def residency_step_parts(self) -> bool:
        # The Triton step's route and account (kernels/triton/residency_step.py: PARTS).
        return _triton_residency_step() is not None

    def exp12_copy_kernel(self) -> Callable[..., None] | None:
        try:
            from vllm.kernels.triton.exp12_gather import exp12_gather
        except ImportError:               # no triton: the cache says so where it is asked for
            return None
        return exp12_gather

    def w4a16_moe_ops(self) -> cuda_ops.W4A16MoEOps | None:
        return cuda_ops.w4a16_moe_ops()

    def elementwise_ops(self) -> ElementwiseOps | None:
        return _triton_elementwise_ops()

    def side_stream(self, device: torch.device) -> CudaSideStream:
        return CudaSideStream(device)

    def is_capturing(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def memory_info(self, device: torch.device) -> tuple[int, int] | None:
        return torch.cuda.mem_get_info(device)

    def select_device(self, device: torch.device) -> None:
        # Triton launches, FlashInfer's plans and torch.cuda.Stream() without a device take the
        # current one: an engine on cuda:N must make N current. "cuda" alone keeps it.
        device = torch.device(device)
        if device.index is not None:
            torch.cuda.set_device(device)
