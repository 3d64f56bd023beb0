"""The Platform contract: what the engine may ask about the device it runs on.

One instance per device type, made once (``vllm.platforms.platform_for``). Every question about
the machine (is CUDA there, which SM, can host memory be pinned, are the compiled kernels
built) is answered here and nowhere else; layers and selection functions ask the platform.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from vllm.kernels.cuda.ops import W4A16MoEOps


CUDA_ERROR_MEMORY_ALLOCATION = 2
"""cudaErrorMemoryAllocation (and ROCm's hipErrorOutOfMemory): the ``error_code`` of the
torch.AcceleratorError torch's pinned allocator raises when no memory is left to lock."""


def _has_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)          # torch >= 2.6
    return acc.is_available() if acc is not None else torch.cuda.is_available()


def _pin_failed_for_want_of_memory(e: RuntimeError) -> bool:
    """Whether torch's pinned allocation failed for want of lockable memory (the store may go
    pageable), not for a fault to report. torch raises no OutOfMemoryError of its own here: out
    of memory is an AcceleratorError carrying the CUDA code (a plain "CUDA error: out of memory"
    RuntimeError before torch 2.8), and a torch without an accelerator has no pinned allocator."""
    code = getattr(e, "error_code", None)
    if code is not None:
        return code == CUDA_ERROR_MEMORY_ALLOCATION
    return str(e).startswith("CUDA error: out of memory") or not _has_accelerator()


@dataclass(frozen=True)
class DeviceCapability:
    major: int
    minor: int

    def to_int(self) -> int:
        """SM number as vLLM spells it: 9.0 -> 90, 12.0 -> 120."""
        return self.major * 10 + self.minor

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


@dataclass(frozen=True)
class ElementwiseOps:
    """A platform's fused kernels for a layer's small ops, one launch each, with the semantics of
    the layers' torch paths (the CUDA platform's: ``vllm/kernels/triton/elementwise.py`` and
    ``router.py``, where each signature is documented)."""
    dtypes: tuple[torch.dtype, ...]
    """Dtypes every op takes."""
    rms_norm: Callable[..., torch.Tensor]
    """(x [..., H], weight [H] of x's dtype, eps) -> [..., H]."""
    silu_and_mul: Callable[..., torch.Tensor]
    """(gate, up) [..., N] -> silu(gate) * up."""
    gelu_and_mul: Callable[..., torch.Tensor]
    """(gate, up, approximate "none" | "tanh") -> gelu(gate) * up."""
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """(positions [T], q [T, Hq*D], k [T, Hkv*D], inv_freq [rd/2] f32, scaling, D, rd) -> (q, k)
    rotated, neox style."""
    topk_softmax: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """(logits [T, E], top_k, renormalize) -> (weights [T, k] f32, ids [T, k] int64): plain
    softmax routing, largest first, ties to the lower id (``fused_moe/router.py``)."""
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """(x, residual [..., H], weight [H], eps) -> (rms_norm(s), s), s = x + residual rounded to
    the dtype once: bitwise the add, then ``rms_norm`` (``RMSNorm.forward`` with a residual)."""
    qk_norm_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """(positions, q, k, q_weight [D], k_weight [D], eps, inv_freq, scaling, D, rd) -> (q, k):
    each head RMS-normalised (Qwen3's q_norm / k_norm), then rotated as ``rotary_embedding``;
    one launch for the three (``RotaryEmbedding.forward`` with norms)."""


class SideStream(Protocol):
    """A second queue of device work beside the current stream (CUDA graph capture included:
    the fork and the join are events, which a capture records)."""

    def fork(self, role: str = "misses") -> AbstractContextManager:
        """Within the block, work is enqueued on the side stream of ``role`` ("misses": a wave's
        miss copies; "prefetch": a prefetch's copies, which must not delay the misses;
        "account": a residency step's policy bookkeeping), after everything already enqueued
        on the current stream."""

    def join(self, role: str = "misses") -> None:
        """The current stream waits for everything enqueued in this handle's forks of ``role``
        so far (a device's handles may share streams: a join need not wait for other handles'
        work)."""


class Platform:
    name: str = ""
    """Platform name, as registries name the platforms a backend supports."""
    device_type: str = ""
    """torch device type of the platform's tensors."""
    moe_backends: tuple[str, ...] = ()
    """MoE expert backends in the order ``moe_backend="auto"`` tries them
    (``model_executor/layers/fused_moe/registry.py`` says what each supports)."""
    attention_backends: tuple[str, ...] = ()
    """Attention backends in the order ``attention_backend="auto"`` tries them."""
    mamba_backends: tuple[str, ...] = ("torch",)
    """Mamba-2 kernel backends in the order "auto" tries them
    (``model_executor/layers/mamba/registry.py``)."""
    gdn_backends: tuple[str, ...] = ("torch",)
    """Gated delta rule (Gated DeltaNet) backends in the order "auto" tries them
    (``model_executor/layers/gated_deltanet/registry.py``)."""

    def is_available(self) -> bool:
        raise NotImplementedError

    def device_name(self, device: torch.device | None = None) -> str:
        raise NotImplementedError

    def get_device_capability(self, device: torch.device | None = None
                              ) -> DeviceCapability | None:
        """Compute capability (CUDA SM); None where the notion does not apply."""
        return None

    def has_fp8_matmul(self, device: torch.device | None = None) -> bool:
        """Whether the matrix units multiply e4m3 operands (CUDA SM 8.9 and newer): MoE backends
        with a W8A8 kernel then quantize activations as an FP8 checkpoint declares; elsewhere
        FP8 experts run weight-only (W8A16)."""
        cap = self.get_device_capability(device)
        return cap is not None and cap.to_int() >= 89

    def is_pin_memory_available(self) -> bool:
        """Whether page-locked host memory can back asynchronous copies to this device."""
        return False

    def upload(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Host tensor ``t`` on ``device`` without stopping the host: through page-locked memory
        and a non-blocking copy where ``is_pin_memory_available``, else a plain copy. A pinned
        source dropped right after is safe: torch's caching host allocator records the copy's
        event and reuses the block only after it."""
        if self.is_pin_memory_available():
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    def download(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying device tensor ``t`` to the host; the returned call waits for the copy
        and returns the host tensor. The host goes on meanwhile where ``is_pin_memory_available``
        (a non-blocking copy into page-locked memory and an event); elsewhere the copy is made
        now (on CPU ``t`` is already on the host and is returned as is)."""
        if t.device.type == "cpu":
            return lambda: t
        if not self.is_pin_memory_available():
            host = t.cpu()
            return lambda: host
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.Event(t.device)
        done.record(torch.accelerator.current_stream(t.device))    # the copy's stream

        def wait() -> torch.Tensor:
            done.synchronize()
            return host
        return wait

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device | None = None) -> torch.Tensor:
        """An uninitialised page-locked host tensor for asynchronous copies to ``device`` (the
        expert cache's host store). Raises torch.OutOfMemoryError where no page-locked memory
        can be had (none left to lock, or none at all: a torch without an accelerator); any
        other error (a CUDA fault) propagates as raised. torch's pinned allocator here: it
        rounds each tensor up to a power of two of bytes."""
        try:
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            if not _pin_failed_for_want_of_memory(e):
                raise
            raise torch.OutOfMemoryError(
                f"cannot page-lock {tuple(shape)} of {dtype} with torch's pinned allocator: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e

    def has_native_kernels(self, dtype: torch.dtype) -> bool:
        """Whether this platform's compiled kernels (on CPU: ``vllm/kernels/cpu``) are loaded and
        take ``dtype``. Where they do not, each op runs its torch implementation."""
        return False

    def expert_copy_kernel(self) -> Callable[..., None] | None:
        """The compiled kernel that copies experts from the host store into device slots
        (``kernels/cuda/ops.expert_gather``'s contract), or None: the expert cache then copies
        with torch ops (``expert_cache/copy.py``)."""
        return None

    def expert_copy_many_kernel(self) -> Callable[..., None] | None:
        """``expert_copy_kernel`` for all of a layer's tensors in one launch
        (``kernels/cuda/ops.expert_gather_many``'s contract: lists of srcs and dsts), or None:
        the cache then calls ``expert_copy_kernel`` once per tensor."""
        return None

    def exp12_copy_kernel(self) -> Callable[..., None] | None:
        """The kernel that copies experts from an ``exp12`` host store, decoding them into bf16
        slots (``kernels/triton/exp12_gather.exp12_gather``'s contract), or None: this platform
        has no link compression (``expert_cache/link_codec.py``)."""
        return None

    def residency_step_kernel(self) -> Callable[..., None] | None:
        """The expert cache's fused residency step on this platform
        (``vllm.kernels.cpu.moe_cache.residency_step``'s contract), or None: the cache then runs
        the tensor-op reference (``expert_cache/residency_step.py``)."""
        return None

    def residency_step_parts(self) -> bool:
        """Whether ``residency_step_kernel()`` plans a wave in two launches as well
        (``part="route"``, then ``part="account"``: the policy's bookkeeping, which a side
        stream runs beside the wave's experts)."""
        return False

    def w4a16_moe_ops(self) -> W4A16MoEOps | None:
        """The compiled W4A16 grouped GEMM of the ``cutlass_w4a16`` MoE backend and its
        workspace size (``kernels/cuda/ops.W4A16MoEOps``), or None where it is not built."""
        return None

    def elementwise_ops(self) -> ElementwiseOps | None:
        """Fused kernels for RMSNorm, the gated activations, rotary embedding and softmax top-k
        routing, or None: the layers then run the C kernels (``has_native_kernels``) or torch."""
        return None

    def side_stream(self, device: torch.device) -> SideStream | None:
        """A side stream handle on ``device`` (the expert cache copies misses on one while the
        layer computes its hits), or None where work runs in issue order anyway (CPU). Each call
        may return a new handle; handles of one device may share one stream."""
        return None

    def is_capturing(self) -> bool:
        """Whether the current thread is capturing a graph on this platform (recorded work may
        not run now, and an op that is not recordable may fail the capture)."""
        return False

    def memory_info(self, device: torch.device) -> tuple[int, int] | None:
        """(free, total) bytes of device memory; None where the engine uses a fixed budget."""
        return None

    def select_device(self, device: torch.device) -> None:
        """Make ``device`` the process's current one, for work that takes the current device
        (kernel launches, library plans); nothing where there is no such notion (CPU)."""

    def describe(self, device: torch.device | None = None) -> str:
        cap = self.get_device_capability(device)
        sm = f", SM {cap}" if cap is not None else ""
        return f"{self.name} ({self.device_name(device)}{sm})"


class UnspecifiedPlatform(Platform):
    """A device type without a platform of its own (e.g. "meta" in tests): nothing compiled, no
    pinning, not a device the engine can be asked to run on; backends that run anywhere (the
    torch references) still work."""

    def __init__(self, device_type: str):
        self.name = self.device_type = device_type

    def is_available(self) -> bool:
        return False

    def device_name(self, device: torch.device | None = None) -> str:
        return self.device_type
