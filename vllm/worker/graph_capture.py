"""How a decode step is captured and replayed (the seam ``CudaDecodeGraphs`` captures through):
``CudaGraphCapturer`` (``torch.cuda.CUDAGraph``, in pieces around graph breaks) and
``EagerCapturer``, the CPU tests' stand-in. ``tests/graph_recorder.py`` adds a CPU capturer that
keeps a graph's semantics."""
from __future__ import annotations

import contextlib
import gc
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

from vllm.model_executor.graph_break import graph_breaks

Replay = Callable[[], torch.Tensor]
"""Recomputes a captured function from its static buffers' current values; returns its output."""


class GraphCapturer:
    def warm_up(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` eagerly where its capture will run (the step before each capture)."""
        return fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        """Capture ``fn`` (which reads only static buffers) without executing it; the returned
        replay recomputes it from the buffers' current values and returns its output tensor."""
        raise NotImplementedError

    def after_failure(self) -> None:
        """Called once when ``capture`` raised, before the engine goes on eagerly."""


class CudaGraphCapturer(GraphCapturer):
    """``torch.cuda.CUDAGraph`` captures on one side stream of ``device``, in one memory pool
    shared by every graph it makes. Not ``torch.cuda.graph``: its exit restores the caller's
    stream only when ``capture_end`` succeeds, and a failed capture must leave the engine running
    eagerly on its own stream (``CudaDecodeGraphs._warm_up_and_capture``); nor its
    ``empty_cache`` per capture, which would return the serving engine's cached blocks mid-run.
    Every call names ``device`` and runs under its guard: ``torch.cuda.Stream()``,
    ``current_stream()``, ``synchronize()`` and a capture's begin take the *current* device,
    which need not be the engine's ``cuda:N``. ``cuda``: the ``torch.cuda`` API (the CPU tests
    pass a recording fake). Run on an H100 (2026-11-26)."""

    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.device, self.cuda = torch.device(device), cuda
        self.pool = None
        self.stream = None

    def _stream(self):
        if self.stream is None:
            # The high-priority pool: the expert cache's side streams come from the default
            # one (``CudaPlatform.side_stream``), so the two never coincide. A graph replays at
            # the priority of the stream it is launched on, so this affects the warm-ups only.
            self.stream = self.cuda.Stream(self.device, priority=-1)
        return self.stream

    def warm_up(self, fn):
        """On the capture stream (as vLLM's ``graph_capture``): what is made per stream on
        first use (cuBLAS's workspace for its handle and this stream) is made here, not inside
        the capture."""
        cuda, dev = self.cuda, self.device
        with cuda.device(dev):
            stream, caller = self._stream(), cuda.current_stream(dev)
            stream.wait_stream(caller)
            with cuda.stream(stream):
                out = fn()
            caller.wait_stream(stream)
            out.record_stream(caller)          # sampled on the caller's stream
        return out

    def capture(self, fn):
        """A graph break (``graph_break``) ends the graph being captured and begins the next
        one in the same pool: a replay runs graph, eager function, graph, ... in capture order
        (graphs sharing a pool must replay in that order), all on the caller's stream."""
        cuda, dev = self.cuda, self.device
        pieces: list = []                      # CUDAGraph, or (eager fn, its output tensor)
        with cuda.device(dev):
            if self.pool is None:
                self.pool = cuda.graph_pool_handle()
            stream, caller = self._stream(), cuda.current_stream(dev)
            graph = cuda.CUDAGraph()

            def on_break(eager, out_like: torch.Tensor | None) -> torch.Tensor | None:
                nonlocal graph
                with warnings.catch_warnings():     # a piece may hold no kernel (a layer's
                    warnings.filterwarnings(        # break before any): not an error
                        "ignore", message="The CUDA Graph is empty")
                    graph.capture_end()
                pieces.append(graph)
                out = None
                if out_like is not None:
                    with torch.inference_mode(False):
                        out = torch.empty_like(out_like)   # outside the pool: never reused
                pieces.append((eager, out))
                graph = cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool)
                return out
            cuda.synchronize(dev)              # nothing in flight may join the capture
            with no_gc(), cuda.stream(stream), graph_breaks(on_break):
                graph.capture_begin(pool=self.pool)
                try:
                    out = fn()
                finally:
                    graph.capture_end()
            pieces.append(graph)
            caller.wait_stream(stream)

        def replay() -> torch.Tensor:
            with cuda.device(dev):
                for piece in pieces:
                    if not isinstance(piece, tuple):
                        piece.replay()
                    elif piece[1] is None:         # the break wrote in place
                        piece[0]()
                    else:
                        piece[1].copy_(piece[0]())
            return out
        return replay

    def after_failure(self) -> None:
        """A capture raised: let the aborted capture's work drain before eager steps go on, and
        never capture into its pool again: ``capture_end`` can raise before it stops routing
        the capture's allocations to the pool, which leaves that pool unusable (its memory is
        lost; no private torch API is called to reclaim it)."""
        with self.cuda.device(self.device):
            self.cuda.synchronize(self.device)
        self.pool = None


@contextlib.contextmanager
def no_gc():
    """Python's cyclic garbage collector off for the block (as it was before, after it). A
    collection can start at any allocation, on any thread, and run finalizers there: freeing
    a page-locked block of cyclic garbage (``ops.empty_pinned``'s deleter calls
    ``cudaFreeHost``, which synchronizes the device) inside a capture invalidates it, and the
    deleter cannot raise, so the error surfaces at the capture's next launch. Seen on an H100
    (2026-11-27): a test's earlier run left its pinned store in a reference cycle and the next
    run's capture failed in a Triton launch. Garbage made meanwhile waits for the next
    collection, outside the capture."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class EagerCapturer(GraphCapturer):
    """Re-runs the function at each replay: the CPU tests' stand-in for a CUDA graph (as a
    capture, it executes nothing at capture time)."""

    def capture(self, fn):
        return fn


def default_capturer(device: torch.device) -> GraphCapturer:
    return CudaGraphCapturer(device) if device.type == "cuda" else EagerCapturer()


def capture_error(err: BaseException) -> str:
    """A failed capture's error and the errors it masks: ``capture_end`` raising in the
    capturer's ``finally`` (e.g. the capture invalidated) hides the forward's own error, the
    root cause, in ``__context__`` (each further cause in the chain is added, with where the
    innermost one was raised). An invalidated capture's error names only the first call to
    notice: a note says what may have invalidated it. The engine's decode graphs and the
    offload benchmark's report it."""
    chain, e = [err], err
    while len(chain) < 8:
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if e is None or any(e is c for c in chain):
            break
        chain.append(e)
    text = f"{type(err).__name__}: {err}"
    for cause in chain[1:]:
        text += f" (root cause: {type(cause).__name__}: {cause})"
    where = _raised_at(chain[-1])
    if where:
        text += f" [raised at {where}]"
    if any(_INVALIDATED in str(x) for x in chain):
        text += _INVALIDATED_NOTE
    return text


_INVALIDATED = "operation failed due to a previous error during capture"
"""cudaErrorStreamCaptureInvalidated's text: an earlier call invalidated the capture."""
_INVALIDATED_NOTE = (
    " [the capture was invalidated before the call that raised, by one whose own error was "
    "dropped or raised on another thread: a host sync (.item(), .cpu(), nonzero, "
    "torch.cuda.synchronize), a legacy-stream call, or a page-locked block freed (cudaFreeHost: "
    "a pinned tensor's last reference dropped, e.g. by the garbage collector); "
    "torch.cuda.set_sync_debug_mode('warn') during the capture names torch's own syncs]")


_ROOT = Path(__file__).resolve().parents[2]
"""The checkout (vllm/, benchmarks/, tests/): frames there say which of our calls raised."""


def _raised_at(err: BaseException) -> str:
    """file:line in function of the innermost frame of ``err``'s traceback in this checkout
    (e.g. the call that launched the failing Triton kernel), else the innermost; or ""."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(_ROOT)
            and "site-packages" not in f.filename]
    if not frames:
        return ""
    f = (ours or frames)[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"
