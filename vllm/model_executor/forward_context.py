"""Per-step attention metadata, made visible to attention layers for one forward pass.

Model files stay plain (``forward(positions, hidden_states)``); the runner wraps each
forward in ``set_forward_context`` and attention layers read the metadata from here.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from functools import cached_property

import torch


PAD_SLOT_ID = -1
"""Slot of a padding row (a decode graph replayed for more rows than the step has): its keys and
values are not written. Only backends that decode graphs run see it: the C kernels
(``worker/cpu_graphs.py``) and the ``cuda_graph_safe`` ones (``worker/cuda_graphs.py``)."""


@dataclass
class AttentionMetadata:
    """Layout of one flattened batch. Tokens of a sequence are contiguous, decodes first.

    Invariants: ``query_start_loc[-1] == T``; for each sequence i,
    ``seq_lens[i] >= query_lens[i]`` and its new tokens are the last ``query_lens[i]``
    of its ``seq_lens[i]`` context tokens.
    """

    slot_mapping: torch.Tensor     # [T] int64, flat KV slot (block_id * block_size + offset),
                                   # or PAD_SLOT_ID for a padding row (decode graphs only)
    block_tables: torch.Tensor     # [B, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor         # [B] int64, context length incl. this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int64, prefix sums of query lengths
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    num_decodes: int
    """Sequences 0..num_decodes-1 have exactly one query token (batched together)."""
    block_size: int
    state_slots: torch.Tensor | None = None
    """[B] int64: sequence i's recurrent-state slot (``layers/recurrent_state.py``), in the
    metadata's sequence order; None when the model keeps no per-request state."""
    has_initial_state: list[bool] | None = None
    """[B]: sequence i continues from its stored state (start_pos > 0); False for a sequence
    starting at position 0 (a new or recomputed request: its slot's contents are stale)."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def token_rows_and_lens(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Per query token: its sequence (row of ``block_tables``) and how many context tokens
        it attends (its position + 1), as int64 [T] tensors built once per step (every layer
        reads them). When every sequence is one decode, rows are None (row = token) and the
        lengths are ``seq_lens`` itself."""
        if self.num_decodes == self.num_seqs:
            return None, self.seq_lens
        rows: list[int] = []
        lens: list[int] = []
        for i, (n, ctx) in enumerate(zip(self.query_lens_cpu, self.seq_lens_cpu)):
            rows += [i] * n
            lens += range(ctx - n + 1, ctx + 1)
        return torch.tensor(rows), torch.tensor(lens)

    @cached_property
    def _step_cache(self) -> dict:
        return {}

    def per_step(self, key, make):
        """``make()``, computed once per step (this metadata) and ``key``: what a backend derives
        from the step's host lists for every layer (e.g. the Triton prefill kernel's work list)."""
        if key not in self._step_cache:
            self._step_cache[key] = make()
        return self._step_cache[key]

    @cached_property
    def query_start_loc_cpu(self) -> list[int]:
        """Host copy of ``query_start_loc``, computed once per step (every layer reads it)."""
        return [0, *itertools.accumulate(self.query_lens_cpu)]


_context: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None):
    global _context
    prev, _context = _context, attn_metadata
    try:
        yield
    finally:
        _context = prev


def get_attn_metadata() -> AttentionMetadata | None:
    return _context
