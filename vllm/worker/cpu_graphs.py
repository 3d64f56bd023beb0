"""Decode steps replayed from CPU graphs (``vllm/kernels/cpu/graph.py``), one graph per padded
batch size, captured the first time a decode-only step of that size runs (``CAPTURE_AFTER``).

As vLLM pads a decode batch to its next CUDA-graph size, a step of B sequences replays the
graph of ``padded_size(B)`` rows (1, 2, 4, then multiples of 8), so a batch that shrinks as
requests finish keeps replaying the same few graphs. A padding row decodes whatever token and
position its row last held (0 at capture) against a one-token context, writes no KV (its slot is ``PAD_SLOT_ID``) and its logits are
dropped; every op of the forward works row by row, so padding does not change the real rows.

A padded size has a graph of the forward and, where it can be captured, one of
``compute_logits`` (every sequence of a decode step samples, so the logits rows are the
tokens; a model whose logits use a torch op without a node, e.g. tied embeddings through
``F.linear``, computes them eagerly from the forward graph's output). The graphs read their
inputs from static buffers (token ids, positions, KV slots, block tables, context lengths);
each replay copies the step's values into them, runs the recorded kernels and returns a view
of the graph's own logits tensor (overwritten by the next replay of that size, so callers use
it before the next step). Prefill and mixed steps run eagerly.

Used on CPU with the C kernels, unless ``enforce_eager``; with an expert cache only where its
residency step and copies are C kernels, and not with a routing trace, whose per-step
bookkeeping is Python a replay would skip (``eligible``). When a capture is refused (a torch op
without a graph node; every supported architecture's decode forward has none,
tests/worker/test_cpu_graphs.py), every decode step of the model runs eagerly from then on (the
forward's ops do not depend on the batch size), logged once, and the expert caches forget their
slots (the refused forward may have planned waves it never copied).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from vllm.config.graph_sizes import ladder_size
from vllm.kernels.cpu.graph import CpuGraph, GraphCaptureError, capture
from vllm.logger import init_logger
from vllm.model_executor.forward_context import (PAD_SLOT_ID, AttentionMetadata,
                                                 set_forward_context)
from vllm.platforms import native_kernels

logger = init_logger(__name__)


def padded_size(batch: int) -> int:
    """The graph a decode step of ``batch`` sequences replays: 1, 2, 4, then multiples of 8
    (vLLM's CUDA-graph sizes, ``config/graph_sizes.py``), so at most 7 padding rows."""
    return ladder_size(batch)


@dataclass
class _Entry:
    """The graphs of one padded size P and their static inputs (rows past the step's B
    sequences are padding)."""
    graph: CpuGraph               # the forward
    logits_graph: CpuGraph | None # compute_logits, None when it runs eagerly
    input_ids: torch.Tensor       # [P] int64
    positions: torch.Tensor       # [P] int64
    slot_mapping: torch.Tensor    # [P] int64, PAD_SLOT_ID on padding rows
    block_tables: torch.Tensor    # [P, max_blocks_per_seq] int64 (a step fills a prefix)
    seq_lens: torch.Tensor        # [P] int64, 1 on padding rows
    hidden: torch.Tensor          # [P, H]: the forward's output, rewritten by each replay
    logits: torch.Tensor | None   # [P, V] f32: the logits graph's output, likewise


def _nbytes(e: _Entry) -> int:
    return e.graph.nbytes + (e.logits_graph.nbytes if e.logits_graph is not None else 0)


def eligible(moe_layers: list, dtype: torch.dtype, device: torch.device,
             enforce_eager: bool, state_layers: list = ()) -> bool:
    """Whether decode steps may replay graphs: CPU kernels on, no per-step Python state (an
    expert cache takes part when its residency step and copies are C kernels), no recurrent
    state (``state_layers``)."""
    if enforce_eager or not native_kernels(dtype, device):
        return False
    if state_layers:
        # Their conv / SSM updates are torch ops without graph nodes; a refused capture stops
        # the forward part-way after some layers already advanced their state, and the eager
        # rerun would advance it twice. So they never capture (padding rows would also need a
        # state slot of their own).
        logger.info("decode steps run eagerly (no CPU graphs): the model has %d recurrent-state "
                    "layers", len(state_layers))
        return False
    return all((m.expert_cache is None or m.expert_cache.cpu_graph_safe)
               and m.routing_observer is None for m in moe_layers)


class DecodeGraphs:
    MAX_BYTES = 256 << 20
    """Memory the kept graphs may hold (their intermediate tensors, mostly the [B, vocab] f32
    logits: one graph per batch size up to max_num_seqs could hold gigabytes for a large
    vocabulary); the least recently used graph is dropped first, and captured again when its
    padded size comes back (a capture costs about 1.2 eager forwards)."""

    CAPTURE_AFTER = 1
    """A padded size is captured on its CAPTURE_AFTER-th decode step in a row. A capture costs
    about 1.2 eager forwards and there are few padded sizes, so capturing at once pays back
    within a few steps (fresh-run timings in docs/benchmarks.md). A size whose graph was
    dropped for the memory budget is captured again when it comes back."""

    def __init__(self, model: nn.Module, max_blocks_per_seq: int, expert_caches: list = ()):
        # A TorchDispatchMode imports torch._dynamo (about 2 s) on first use: pay it at engine
        # start, not in the first decode step.
        import torch._dynamo  # noqa: F401
        self.model = model
        self.max_blocks = max_blocks_per_seq
        self.expert_caches = list(expert_caches)
        """The cached MoE layers' providers: a refused capture makes them forget their slots."""
        self._graphs: OrderedDict[int, _Entry] = OrderedDict()
        self.refused: str | None = None
        """Why the model's decode steps run eagerly (a refused capture), or None."""
        self.logits_refused: str | None = None
        """Why the logits run eagerly after the forward graph (refused once for the model, as
        the forward's refusal is, so later batch sizes do not try again), or None."""
        self._last_size, self._streak = 0, 0

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               md: AttentionMetadata, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, V] f32 of a decode-only step of B sequences from the graph of
        ``padded_size(B)`` (captured now if due), or None when this step must run eagerly.
        ``ids``: token ids [n <= B] for the first n rows, written over ``input_ids``' (a step
        scheduled ahead takes them from the step in flight)."""
        if ids is not None:
            input_ids[:ids.shape[0]].copy_(ids)
        B = input_ids.shape[0]
        if md.num_decodes != md.num_seqs or B != md.num_seqs or self.refused is not None \
                or md.block_tables.shape[1] > self.max_blocks:
            return None
        P = padded_size(B)
        self._streak = self._streak + 1 if P == self._last_size else 1
        self._last_size = P
        entry = self._graphs.get(P)
        if entry is None:
            if self._streak < self.CAPTURE_AFTER:
                return None
            return self._capture(P, input_ids, positions, md)
        self._graphs.move_to_end(P)
        self._load(entry, input_ids, positions, md)
        entry.graph.replay()
        if entry.logits_graph is None:
            return self.model.compute_logits(entry.hidden[:B])
        entry.logits_graph.replay()
        return entry.logits[:B]

    @staticmethod
    def _load(e: _Entry, input_ids, positions, md: AttentionMetadata) -> None:
        """The step's B sequences into rows [:B]; rows [B:] become padding (their token,
        position and block table rows keep earlier values, all valid)."""
        B = input_ids.shape[0]
        e.input_ids[:B].copy_(input_ids)
        e.positions[:B].copy_(positions)
        e.slot_mapping[:B].copy_(md.slot_mapping)
        e.slot_mapping[B:].fill_(PAD_SLOT_ID)
        e.block_tables[:B, :md.block_tables.shape[1]].copy_(md.block_tables)
        e.seq_lens[:B].copy_(md.seq_lens)
        e.seq_lens[B:].fill_(1)

    def _capture(self, P: int, input_ids, positions, md: AttentionMetadata) -> torch.Tensor | None:
        B = input_ids.shape[0]
        i64 = dict(dtype=torch.int64, device=input_ids.device)
        with torch.inference_mode(False):   # buffers written both inside and outside it
            e = _Entry(CpuGraph(), CpuGraph(), torch.zeros(P, **i64), torch.zeros(P, **i64),
                       torch.zeros(P, **i64), torch.zeros(P, self.max_blocks, **i64),
                       torch.ones(P, **i64), hidden=None, logits=None)
        self._load(e, input_ids, positions, md)
        static_md = AttentionMetadata(
            slot_mapping=e.slot_mapping, block_tables=e.block_tables, seq_lens=e.seq_lens,
            query_start_loc=torch.arange(P + 1, **i64),
            seq_lens_cpu=list(md.seq_lens_cpu) + [1] * (P - B), query_lens_cpu=[1] * P,
            num_decodes=P, block_size=md.block_size)
        try:
            with set_forward_context(static_md), capture(e.graph):
                e.hidden = self.model(e.input_ids, e.positions)
        except GraphCaptureError as err:
            # The forward stopped part-way; the caller reruns it eagerly (its KV writes put
            # the same values in the same slots again). A cached layer's residency step has
            # then planned all of the step's waves but only some were copied: forget the
            # slots, so the rerun copies what it needs.
            for cache in self.expert_caches:
                cache.invalidate()
            self.refused = str(err)
            logger.info("decode steps run eagerly (no CPU graphs): %s", err)
            return None
        e.graph.finish()
        if self.logits_refused is None:
            try:
                with capture(e.logits_graph):
                    e.logits = self.model.compute_logits(e.hidden)
                e.logits_graph.finish()
            except GraphCaptureError as err:
                self.logits_refused = str(err)
                logger.info("logits are computed eagerly: %s", err)
        if self.logits_refused is not None:
            e.logits_graph, e.logits = None, self.model.compute_logits(e.hidden)
        self._graphs[P] = e
        while len(self._graphs) > 1 and sum(map(_nbytes, self._graphs.values())) > self.MAX_BYTES:
            self._graphs.popitem(last=False)
        logger.debug("captured a CPU graph for decode batch size %d (%d nodes)", P,
                     e.graph.num_nodes)
        return e.logits[:B]
