"""Graph breaks: work that a captured decode step runs eagerly between graph pieces.

A layer whose step must read the device on the host (``moe_expert_cpu_compute`` chooses on the
host which experts the CPU computes) cannot be inside a CUDA graph. Rather than refusing the
whole step's graph, it calls ``break_graph(fn, out_like)`` while a decode graph is being
captured: the capture ends before it and a new piece starts after it, and each replay runs
piece, ``fn()``, piece, ... in that order (vLLM's piecewise CUDA graphs, cut at these layers
instead of at attention). Outside a capture in pieces ``break_graph`` is just ``fn()``.

The contract of ``fn``: it reads only tensors that stay at fixed addresses across replays (the
static inputs, the forward context's metadata, the previous piece's outputs) and returns a
tensor shaped and typed like ``out_like``; it runs under the forward context current where it
was recorded. Its result is copied into the tensor that the work after the break reads (the
capturer allocates it, outside any pool the pieces reuse). With ``out_like`` None, ``fn``
writes in place into such tensors and returns nothing to hand on."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from vllm.model_executor.forward_context import get_attn_metadata, set_forward_context

BreakHandler = Callable[[Callable[[], torch.Tensor | None], torch.Tensor | None],
                        torch.Tensor | None]
"""(fn, out_like) -> the tensor the work after the break reads (None with out_like None); set by
a capturer."""

_handler: BreakHandler | None = None


@contextlib.contextmanager
def graph_breaks(handler: BreakHandler):
    """While a capturer records a decode step in pieces: ``break_graph`` calls ``handler``."""
    global _handler
    prev, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = prev


def capturing_in_pieces() -> bool:
    """Whether a capture that takes graph breaks is recording now."""
    return _handler is not None


def break_graph(fn: Callable[[], torch.Tensor | None],
                out_like: torch.Tensor | None) -> torch.Tensor | None:
    """``fn()`` now, or, while a capture in pieces records, at this point of every replay."""
    if _handler is None:
        return fn()
    md = get_attn_metadata()

    def eager() -> torch.Tensor | None:
        with set_forward_context(md):
            return fn()
    return _handler(eager, out_like)
