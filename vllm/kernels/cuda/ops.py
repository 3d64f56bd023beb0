"""Python face of the compiled CUDA ops (``csrc/``, registered as ``torch.ops._C.*``).

``vllm._C`` exists only in a CUDA build (``VLLM_TARGET_DEVICE=cuda pip install
--no-build-isolation -e .``, docs/build.md). ``load_cuda_ops()`` imports it once and says
whether the ops are there; the CUDA platform asks it and hands the ops to the layers that want
them, so nothing else imports ``vllm._C``. ``VLLM_CUDA_OPS=0`` turns them off (the torch paths
run instead; for ``expert_gather``, its Triton twin ``vllm/kernels/triton/expert_gather.py``), as
``VLLM_CPU_KERNELS=0`` does for the C kernels.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from vllm.kernels.gather_checks import check_many, check_plan, check_rows
from vllm.logger import init_logger

logger = init_logger(__name__)


_load_failure: list[str] = []
"""Why ``vllm._C`` did not load, once ``load_cuda_ops()`` found it missing (for warnings)."""


@functools.lru_cache(maxsize=None)
def load_cuda_ops() -> bool:
    """Whether ``vllm._C`` is built and loaded (its import registers the ops)."""
    if os.environ.get("VLLM_CUDA_OPS", "1") == "0":
        return False
    try:
        import vllm._C  # noqa: F401
    except ImportError as e:
        logger.debug("vllm._C is not available (%s): CUDA ops run their torch paths", e)
        _load_failure.append(f"vllm._C is not built (import failed: {e})")
        return False
    except Exception as e:                     # noqa: BLE001 - a broken build must not crash
        logger.warning("vllm._C failed to load (%s: %s): CUDA ops run their torch paths",
                       type(e).__name__, e)
        _load_failure.append(f"vllm._C failed to load ({type(e).__name__}: {e})")
        return False
    return True


def expert_gather(src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor,
                  slots: torch.Tensor, valid: torch.Tensor) -> None:
    """For each i with valid[i]: dst[slots[i]] = src[experts[i]], in one launch on the current
    stream, reading a pinned host ``src`` in place (csrc/moe/expert_gather.cu).

    src [E, ...] contiguous, pinned host or on dst's device; dst [N, ...] contiguous CUDA, same
    dtype and row shape; experts, slots int64 [n] and valid bool [n] on dst's device. Invalid
    entries are skipped unread; no host sync (capturable in a CUDA graph). Bad arguments raise
    ValueError (``gather_checks``) before the op is called."""
    check_rows("expert_gather", src, dst)
    check_plan("expert_gather", dst, experts, slots, valid)
    torch.ops._C.expert_gather(src, dst, experts, slots, valid)


def expert_gather_many(srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                       experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
    """``expert_gather`` for every (srcs[t], dsts[t]) of a layer in one launch (16 tensors per
    launch, at most): its weights, scales, zeros... Every src has the same experts, every dst
    the same slots on one device; otherwise the same contract."""
    check_many("expert_gather_many", srcs, dsts, experts, slots, valid)
    torch.ops._C.expert_gather_many(list(srcs), list(dsts), experts, slots, valid)


def has_expert_gather_many() -> bool:
    """Whether ``vllm._C`` has ``expert_gather_many`` (builds before it have only the
    one-tensor op)."""
    return load_cuda_ops() and hasattr(torch.ops._C, "expert_gather_many")


def has_empty_pinned() -> bool:
    """Whether ``vllm._C`` has the exact-size pinned allocator (``try_empty_pinned``)."""
    return load_cuda_ops() and hasattr(torch.ops._C, "try_empty_pinned")


def empty_pinned_missing_reason() -> str:
    """Why ``has_empty_pinned()`` is False, in words: each cause is fixed differently."""
    if os.environ.get("VLLM_CUDA_OPS", "1") == "0":
        return "VLLM_CUDA_OPS=0 turns vllm._C's ops off"
    if not load_cuda_ops():
        return _load_failure[-1] if _load_failure else "vllm._C is not built"
    return ("this vllm._C build predates the exact-size allocator (no _C::try_empty_pinned): "
            "rebuild it")


PINNED_OK, PINNED_OUT_OF_MEMORY = 0, 1
"""``try_empty_pinned``'s status values (csrc/memory/pinned_host.h's PinnedHostStatus; 2: any
other CUDA error)."""


def pinned_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of ``shape`` elements of ``dtype``; ValueError for a negative or non-integer
    size or more than 2^63 bytes."""
    bad = [d for d in shape if isinstance(d, bool) or not isinstance(d, int) or d < 0]
    if bad:
        raise ValueError(f"empty_pinned: sizes must be non-negative integers, got {list(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= 2 ** 63:
        raise ValueError(f"empty_pinned: {list(shape)} of {dtype} is {nbytes} bytes, more than "
                         f"2^63")
    return nbytes


def empty_pinned(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | None = None) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` in page-locked memory of exactly its bytes
    (``cudaHostAlloc``, csrc/memory/pinned_host.cu), mapped for the expert gather kernel and
    freed with its last reference (which must come after the copies that read it). torch's
    pinned allocator rounds each block up to a power of two (a 738 MB tensor locks 1 GiB); this
    one does not. ``device``: the GPU the memory feeds (default the current one), whose context
    makes the allocation, so no context is created on another GPU, and frees it under that
    GPU's context from any thread. Raises torch.OutOfMemoryError (naming the size) where no
    memory is left to lock, and a plain RuntimeError naming the CUDA error for any other
    failure (e.g. an earlier kernel's fault surfacing here), so a fault is never mistaken for a
    full machine. Failures come back as a status, not a C++ exception (csrc/torch_bindings.cpp
    says why)."""
    nbytes = pinned_bytes(shape, dtype)
    # torch reports a pointer as pinned (is_pinned, the pinned check of captured copies) only
    # once it has initialised CUDA itself; the allocation alone does not count.
    torch.cuda.init()
    with torch.cuda.device(device):
        t, status, error = torch.ops._C.try_empty_pinned(list(shape), dtype)
    if status == PINNED_OK:
        return t
    why = torch.ops._C.cuda_error_string(error)
    if status == PINNED_OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"empty_pinned: cannot page-lock {nbytes} bytes of host "
                                     f"memory: {why}")
    raise RuntimeError(f"empty_pinned: cudaHostAlloc of {nbytes} bytes failed with a CUDA "
                       f"error: {why}")


W4A16_TILE_K = 64
"""K per mainloop tile of the CUTLASS W4A16 grouped GEMM (128 bytes of bf16): a scale group
must be the whole K or a multiple of it (CUTLASS's ``chunk_size`` rule)."""


def has_w4a16_moe_mm() -> bool:
    """Whether ``vllm._C`` was built with the CUTLASS W4A16 grouped GEMM (it needs the CUTLASS
    headers at build time: ``pip install nvidia-cutlass``, docs/build.md)."""
    return load_cuda_ops() and hasattr(torch.ops._C, "w4a16_moe_mm")


def w4a16_moe_mm(a: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, d: torch.Tensor,
                 expert_offsets: torch.Tensor, group_size: int,
                 workspace: torch.Tensor) -> None:
    """CUTLASS's SM90 mixed-input grouped GEMM (csrc/moe/w4a16_moe_mm.cu), one launch plus a
    one-block setup kernel, no host sync (capturable). For each group g < G, rows
    r in [off[g], off[g + 1]) of ``a``:

        d[r, n] = sum_k a[r, k] * W_g[n, k],
        W_g[n, k] = q_g[n, k] * scales[g, k // group_size, n]

    q_g[n, k]: the signed int4 (two's complement, -8..7) in byte w[g, n, k // 2], k even in the
    low nibble. No zero points: CUTLASS 4.2's grouped collective does not set up the scale
    tensormap in its zero-point mode (csrc/moe/w4a16_moe_mm.cu), so symmetric GPTQ only (zero 8:
    q = u - 8). a bf16 [P, K]; w uint8 [G, N, K / 2]; scales bf16 [G, K / group_size, N];
    d bf16 [P, N]; expert_offsets int64 [G + 1], nondecreasing, off[G] <= P; all contiguous on
    one SM 9.0 device, 16-byte aligned. Rows outside [off[0], off[G]) of ``d`` are not written.
    ``group_size`` is K or a multiple of ``W4A16_TILE_K``; K a multiple of 64, N of 8.
    ``workspace``: uint8, at least ``w4a16_moe_mm_workspace_bytes(G, d.device)`` bytes on d's
    device."""
    torch.ops._C.w4a16_moe_mm(a, w, scales, d, expert_offsets, group_size, workspace)


def w4a16_moe_mm_workspace_bytes(num_groups: int, device: torch.device) -> int:
    """Bytes of the workspace ``w4a16_moe_mm`` needs for ``num_groups`` groups on ``device``
    (pointer and shape arrays, CUTLASS's per-SM tensormaps): fixed for a layer, so it is
    allocated once, outside any capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.ops._C.w4a16_moe_mm_workspace_size(num_groups, index))


@dataclass(frozen=True)
class W4A16MoEOps:
    """The W4A16 grouped GEMM and its workspace size (the two functions above), as the CUDA
    platform hands them to the ``cutlass_w4a16`` MoE backend; tests pass a torch stand-in with
    the same contract."""
    mm: Callable[..., None]
    workspace_bytes: Callable[[int, torch.device], int]


def w4a16_moe_ops() -> W4A16MoEOps | None:
    """The compiled ops, or None where ``vllm._C`` lacks them."""
    if not has_w4a16_moe_mm():
        return None
    return W4A16MoEOps(w4a16_moe_mm, w4a16_moe_mm_workspace_bytes)
