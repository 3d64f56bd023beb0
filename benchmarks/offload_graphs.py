"""benchmark_expert_offload.py's ``--graphs``: each design's steps (all the trace's layers for
one step of forced routing) replayed from CUDA graphs, as the engine replays a decode step
(``vllm/worker/cuda_graphs.py``). Eager, a batch-1 step of a layer launches about twenty
kernels from Python, which on a GPU takes longer than a small batch's expert GEMMs: the eager
figures charge every design that launch time, the graphs charge none.

The same lifecycle as the engine's graphs: static inputs (the step's routing ids [B, L, K], the
prefetch predictions, the layer-0 input [B, H]; B = the largest batch) are written each step;
the first step of each active batch size b runs eagerly (the warm-up: its real work, so the
cache's state and counters are the eager run's), then its graph is captured, which records
without executing; later steps of size b replay it. The captures happen inside the timed cold
run, as the engine's do (``capture_seconds`` in the row says how long they took on the host).
A capture goes through the engine's capturers (``graph_capture.py``), so a layer with
``moe_expert_cpu_compute`` (``ours+cpu``) is captured in pieces around its host reads, with
Python's garbage collector off (``no_gc``: a collection inside a capture that frees pinned
memory invalidates it).

Refused, with the reason in the row (the design then runs eagerly): sync-lfru (its bookkeeping
reads each step's routing on the host and copies each miss synchronously: the upstream design
cannot be captured); a provider or MoE backend that a decode graph refuses; a device with no
capturer (``capturer_for``: CUDA only; the tests substitute a CPU one); and a capture that
raises (every later step of that run is eager).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.modular_kernel import capture_warm_up
from vllm.worker.graph_capture import CudaGraphCapturer, GraphCapturer, capture_error

logger = init_logger(__name__)

Forward = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]
"""(ids [b, L, K], predictions [b, L, K] or None, layer-0 input [b, H]) -> last layer's h."""


def capturer_for(device: torch.device) -> GraphCapturer | None:
    """The capturer for ``device``'s graphs, or None where there are none (tests patch it)."""
    return CudaGraphCapturer(device) if device.type == "cuda" else None


def graph_refusal(design: str, providers: list, kernel, device: torch.device) -> str | None:
    """Why ``design``'s steps cannot be replayed from graphs on ``device``, or None."""
    if design == "sync-lfru":
        return ("sync-lfru reads each step's routing on the host and copies each miss "
                "synchronously (the upstream design): it runs eagerly")
    if capturer_for(device) is None:
        return f"no graphs on {device.type} (CUDA graphs need a CUDA device)"
    for p in providers:
        why = getattr(p, "cuda_graph_refusal", lambda: None)()
        if why is not None:
            return f"expert cache: {why}"
        if not getattr(p, "reads_on_host", False) and \
                not getattr(kernel, "cuda_graph_safe", False):
            return f"MoE backend {getattr(kernel, 'name', kernel)!r} is not cuda_graph_safe"
    return None


class StepGraphs:
    """One captured step per active batch size; ``step`` has ``forward``'s signature."""

    def __init__(self, forward: Forward, capturer: GraphCapturer, providers: list,
                 ids_shape: tuple[int, int, int], hidden: int, dtype: torch.dtype,
                 device: torch.device, predicted: bool, design: str = ""):
        self.forward, self.capturer, self.providers = forward, capturer, providers
        self.design = design
        B = ids_shape[0]
        with torch.inference_mode(False):       # written inside and outside inference mode
            self.ids = torch.zeros(ids_shape, dtype=torch.int64, device=device)
            self.pred = torch.full(ids_shape, -1, dtype=torch.int64, device=device) \
                if predicted else None
            self.h = torch.zeros(B, hidden, dtype=dtype, device=device)
            self.out = torch.empty_like(self.h)   # every graph's output rows, outside the pool
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.refusal: str | None = None
        """Why the run went on eagerly (a capture raised), or None."""
        self.capture_seconds = 0.0

    def step(self, ids: torch.Tensor, pred: torch.Tensor | None, h: torch.Tensor
             ) -> torch.Tensor:
        if self.refusal is not None:
            return self.forward(ids, pred, h)
        b = ids.shape[0]
        self.ids[:b].copy_(ids)
        self.h[:b].copy_(h)
        if self.pred is not None:
            self.pred[:b].copy_(pred)
        replay = self.replays.get(b)
        if replay is not None:
            return replay()
        args = (self.ids[:b], None if self.pred is None else self.pred[:b], self.h[:b])
        with capture_warm_up(self.ids.shape[0]):
            out = self.capturer.warm_up(lambda: self.forward(*args))
        start = time.perf_counter()
        try:
            self.replays[b] = self.capturer.capture(
                lambda: self.out[:b].copy_(self.forward(*args)))
        except Exception as err:                 # noqa: BLE001 - any failure: go on eagerly
            self.refusal = f"capturing batch {b} failed: {capture_error(err)}"
            logger.warning("%s: its steps run eagerly from now on (%s)", self.design or "?",
                           self.refusal)
            logger.debug("the failed capture's traceback", exc_info=err)
            self.capturer.after_failure()
            for p in self.providers:             # its recorded work never ran
                forget = getattr(p, "forget_capture", None)
                if forget is not None:
                    forget()
        self.capture_seconds += time.perf_counter() - start
        return out

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self.replays)


def make_step_graphs(design: str, providers: list, forward: Forward, kernel,
                     ids_shape: tuple[int, int, int], hidden: int, dtype: torch.dtype,
                     device: torch.device, predicted: bool, counted: bool = False
                     ) -> tuple[StepGraphs | None, str | None]:
    """(the design's step graphs, None), or (None, why it runs eagerly). ``counted``: the
    tests' byte counter (``count_copies``) wraps the copies with a host read."""
    why = "the bytes counter (count_copies) reads each load plan on the host" if counted \
        else graph_refusal(design, providers, kernel, device)
    if why is not None:
        return None, why
    return StepGraphs(forward, capturer_for(device), providers, ids_shape, hidden, dtype,
                      device, predicted, design), None


def graph_fields(graphs: StepGraphs | None, refusal: str | None) -> dict:
    """The row's graph fields: ``graphs`` (its steps replayed graphs: none refused or failed),
    ``graph_refusal``, ``graph_sizes`` (the batch sizes captured), ``capture_seconds``."""
    if graphs is None:
        return {"graphs": False, "graph_refusal": refusal, "graph_sizes": [],
                "capture_seconds": 0.0}
    return {"graphs": graphs.refusal is None and bool(graphs.replays),
            "graph_refusal": graphs.refusal, "graph_sizes": graphs.captured_sizes,
            "capture_seconds": graphs.capture_seconds}
