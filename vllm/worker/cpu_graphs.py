"""Decode steps replayed from CPU graphs (``vllm/kernels/cpu/graph.py``), one graph per batch
size, captured the first time a decode-only step of that size runs.

A batch size has a graph of the forward and, where it can be captured, one of
``compute_logits`` (every sequence of a decode step samples, so the logits rows are the
tokens; a model whose logits use a torch op without a node, e.g. tied embeddings through
``F.linear``, computes them eagerly from the forward graph's output). The graphs read its inputs from static buffers it owns (token ids,
positions, KV slots, block tables, context lengths); each replay copies the step's values into
them, runs the recorded kernels and returns the graph's own logits tensor (overwritten by the
next replay of that size, so callers use it before the next step). Prefill and mixed steps run
eagerly.

Used on CPU with the C kernels, unless ``enforce_eager``; not with the expert cache or a
routing trace, whose per-step bookkeeping is Python a replay would skip (``eligible``). When a
capture is refused (a torch op without a graph node, e.g. Qwen2-MoE's sigmoid-gated shared
expert), every decode step of the model runs eagerly from then on (the forward's ops do not
depend on the batch size), logged once.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from vllm.kernels.cpu.graph import CpuGraph, GraphCaptureError, capture
from vllm.kernels.cpu.ops import kernels_support
from vllm.logger import init_logger
from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context

logger = init_logger(__name__)


@dataclass
class _Entry:
    graph: CpuGraph               # the forward
    logits_graph: CpuGraph | None # compute_logits, None when it runs eagerly
    input_ids: torch.Tensor       # [B] int64
    positions: torch.Tensor       # [B] int64
    slot_mapping: torch.Tensor    # [B] int64
    block_tables: torch.Tensor    # [B, max_blocks_per_seq] int64 (a step fills a prefix)
    seq_lens: torch.Tensor        # [B] int64
    hidden: torch.Tensor          # [B, H]: the forward's output, rewritten by each replay
    logits: torch.Tensor | None   # [B, V] f32: the logits graph's output, likewise


def _nbytes(e: _Entry) -> int:
    return e.graph.nbytes + (e.logits_graph.nbytes if e.logits_graph is not None else 0)


def eligible(model: nn.Module, moe_layers: list, dtype: torch.dtype, device: torch.device,
             enforce_eager: bool) -> bool:
    """Whether decode steps may replay graphs: CPU kernels on, no per-step Python state."""
    if enforce_eager or not kernels_support(dtype, device):
        return False
    return all(m.expert_cache is None and m.routing_observer is None for m in moe_layers)


class DecodeGraphs:
    MAX_BYTES = 256 << 20
    """Memory the kept graphs may hold (their intermediate tensors, mostly the [B, vocab] f32
    logits: one graph per batch size up to max_num_seqs could hold gigabytes for a large
    vocabulary); the least recently used graph is dropped first, and captured again when its
    batch size comes back (a capture costs about three eager steps)."""

    CAPTURE_AFTER = 16
    """A batch size is captured on its CAPTURE_AFTER-th decode step in a row. A capture costs
    15-25 ms (an eager step plus the dispatch mode's per-op work) and a replay saves about 1 ms
    (the default model, one thread), so batch sizes that last only a few steps (batches
    shrinking as mixed-length requests finish) stay eager: capturing from the 4th step made a
    fresh mixed-length run slower than eager (21 captures, 0.48 s)."""

    def __init__(self, model: nn.Module, max_blocks_per_seq: int):
        # A TorchDispatchMode imports torch._dynamo (about 2 s) on first use: pay it at engine
        # start, not in the first decode step.
        import torch._dynamo  # noqa: F401
        self.model = model
        self.max_blocks = max_blocks_per_seq
        self._graphs: OrderedDict[int, _Entry] = OrderedDict()
        self.refused: str | None = None
        """Why the model's decode steps run eagerly (a refused capture), or None."""
        self.logits_refused: str | None = None
        """Why the logits run eagerly after the forward graph (refused once for the model, as
        the forward's refusal is, so later batch sizes do not try again), or None."""
        self._last_size, self._streak = 0, 0

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               md: AttentionMetadata) -> torch.Tensor | None:
        """Logits [B, V] f32 of a decode-only step from its graph (captured now if new), or
        None when this step must run eagerly."""
        B = input_ids.shape[0]
        if md.num_decodes != md.num_seqs or B != md.num_seqs or self.refused is not None \
                or md.block_tables.shape[1] > self.max_blocks:
            return None
        self._streak = self._streak + 1 if B == self._last_size else 1
        self._last_size = B
        entry = self._graphs.get(B)
        if entry is None:
            if self._streak < self.CAPTURE_AFTER:
                return None
            return self._capture(input_ids, positions, md)
        self._graphs.move_to_end(B)
        self._load(entry, input_ids, positions, md)
        entry.graph.replay()
        if entry.logits_graph is None:
            return self.model.compute_logits(entry.hidden)
        entry.logits_graph.replay()
        return entry.logits

    @staticmethod
    def _load(e: _Entry, input_ids, positions, md: AttentionMetadata) -> None:
        e.input_ids.copy_(input_ids)
        e.positions.copy_(positions)
        e.slot_mapping.copy_(md.slot_mapping)
        e.block_tables[:, :md.block_tables.shape[1]].copy_(md.block_tables)
        e.seq_lens.copy_(md.seq_lens)

    def _capture(self, input_ids, positions, md: AttentionMetadata) -> torch.Tensor | None:
        B = input_ids.shape[0]
        i64 = dict(dtype=torch.int64, device=input_ids.device)
        with torch.inference_mode(False):   # buffers written both inside and outside it
            e = _Entry(CpuGraph(), CpuGraph(), torch.zeros(B, **i64), torch.zeros(B, **i64),
                       torch.zeros(B, **i64), torch.zeros(B, self.max_blocks, **i64),
                       torch.ones(B, **i64), hidden=None, logits=None)
        self._load(e, input_ids, positions, md)
        static_md = AttentionMetadata(
            slot_mapping=e.slot_mapping, block_tables=e.block_tables, seq_lens=e.seq_lens,
            query_start_loc=torch.arange(B + 1, **i64), seq_lens_cpu=md.seq_lens_cpu,
            query_lens_cpu=[1] * B, num_decodes=B, block_size=md.block_size)
        try:
            with set_forward_context(static_md), capture(e.graph):
                e.hidden = self.model(e.input_ids, e.positions)
        except GraphCaptureError as err:
            # The forward stopped part-way; the caller reruns it eagerly (its KV writes put
            # the same values in the same slots again).
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
        self._graphs[B] = e
        while len(self._graphs) > 1 and sum(map(_nbytes, self._graphs.values())) > self.MAX_BYTES:
            self._graphs.popitem(last=False)
        logger.debug("captured a CPU graph for decode batch size %d (%d nodes)", B,
                     e.graph.num_nodes)
        return e.logits
