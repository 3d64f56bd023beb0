"""Reused transient buffers for the CPU forward pass.

On CPU a fresh multi-MB tensor costs more in page faults than the work done in it (measured:
``new_zeros`` of a 4 MB MoE pair buffer 1.2-1.7 ms, ``zero_`` of the same buffer once mapped
0.1-0.3 ms), and glibc returns such blocks to the OS when they are freed. Layers run one at a
time, so one buffer per purpose serves every layer. On other devices the caching allocator
already makes transient buffers cheap, and ``scratch`` is ``torch.empty`` (as it is under
torch.compile).

Invariants: a scratch buffer is dead once the call that took it returns (nothing returned to the
caller may alias it), and one forward pass runs at a time in the process (each engine steps in
one thread; two engines stepping concurrently in one process would share these buffers).
"""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def scratch(purpose: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape``, the same memory on every call with the
    same ``purpose``, dtype and device (CPU; it grows, never shrinks)."""
    numel = 1
    for n in shape:
        numel *= n
    if device.type != "cpu" or torch.compiler.is_compiling():   # compiled graphs plan memory
        return torch.empty(shape, dtype=dtype, device=device)
    key = (purpose, dtype, device)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        # A normal (non-inference) tensor: writable both inside and outside inference_mode.
        with torch.inference_mode(False):
            buf = _BUFFERS[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)
