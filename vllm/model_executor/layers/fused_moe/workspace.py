"""Scratch memory of a kernel family that takes its workspace from the caller (the CUTLASS W4A16
grouped GEMM, FlashInfer's CUTLASS MoE): one uint8 buffer per device, shared by every layer,
since their calls run one after another on one stream.

A buffer grows only outside a CUDA-graph capture (an allocation inside one would be the graph's
own, and the seed crash of FlashInfer's MoE came from exactly that); the eager warm-up before a
capture sizes it. A replaced buffer stays referenced for the process's life: a graph captured
earlier holds its address.
"""
from __future__ import annotations

import torch

from vllm.platforms import platform_for


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph."""
    return device.type == "cuda" and platform_for(device).is_capturing()


class SharedWorkspace:
    """The per-device buffers of one kernel family (``owner`` names it in errors)."""

    def __init__(self, owner: str):
        self.owner = owner
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []
        """Buffers replaced by larger ones, kept alive for the graphs that captured them."""

    def current(self, device: torch.device) -> torch.Tensor | None:
        """``device``'s buffer as it is (None before the first ``get``)."""
        return self.buffers.get(device)

    def get(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """``device``'s buffer, grown to ``nbytes`` first where smaller; RuntimeError where that
        would happen inside a capture."""
        cur = self.buffers.get(device)
        if cur is not None and cur.numel() >= nbytes:
            return cur
        if capturing(device):
            have = 0 if cur is None else cur.numel()
            raise RuntimeError(f"{self.owner}: a CUDA-graph capture needs a {nbytes}-byte "
                               f"workspace on {device}, but {have} bytes were allocated: run "
                               "the layer eagerly once before capturing (the capture warm-up)")
        if cur is not None:
            self.retired.append(cur)
        self.buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.buffers[device]
