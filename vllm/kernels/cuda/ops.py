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
import os

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)


@functools.lru_cache(maxsize=None)
def load_cuda_ops() -> bool:
    """Whether ``vllm._C`` is built and loaded (its import registers the ops)."""
    if os.environ.get("VLLM_CUDA_OPS", "1") == "0":
        return False
    try:
        import vllm._C  # noqa: F401
    except ImportError as e:
        logger.debug("vllm._C is not available (%s): CUDA ops run their torch paths", e)
        return False
    return True


def expert_gather(src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor,
                  slots: torch.Tensor, valid: torch.Tensor) -> None:
    """For each i with valid[i]: dst[slots[i]] = src[experts[i]], in one launch on the current
    stream, reading a pinned host ``src`` in place (csrc/moe/expert_gather.cu).

    src [E, ...] contiguous, pinned host or on dst's device; dst [N, ...] contiguous CUDA, same
    dtype and row shape; experts, slots int64 [n] and valid bool [n] on dst's device. Invalid
    entries are skipped unread; no host sync (capturable in a CUDA graph)."""
    torch.ops._C.expert_gather(src, dst, experts, slots, valid)
