"""A step's sequences flattened into the model's inputs: token ids, positions and the attention
metadata, as int64 tensors on the host, then on the runner's device.

Every int64 field is a view of ONE host tensor, built from an ``array.array`` of the ints (a
``torch.tensor`` call costs about 4 us whatever its length, plus 80 ns per int; a decode step
had seven), and moves to the device as one copy (``to_device``) whose views are split the same
way; one pass over the sequences builds the lists. On the 2-core development machine that took
the step's inputs from 38 to 18-21 us at batch 1 and from 122-126 to 65-72 us at batch 32
(``benchmark_host_step.py``'s ``inputs_ms``, against the code before: docs/benchmarks.md).
"""
from __future__ import annotations

import array
import itertools
from dataclasses import dataclass

import torch

from vllm.core.sched_output import ScheduledSequence
from vllm.model_executor.forward_context import AttentionMetadata
from vllm.platforms import platform_for


@dataclass
class StepInputs:
    input_ids: torch.Tensor         # [T] int64
    positions: torch.Tensor         # [T] int64
    metadata: AttentionMetadata     # slot_mapping [T], block_tables [S, M], seq_lens [S],
    #                                 query_start_loc [S + 1], state_slots [S] or None
    logits_indices: torch.Tensor    # [n_sample] int64: the last token of each sampling sequence
    flat: torch.Tensor              # every int64 field above, end to end (their storage)
    sizes: tuple[int, ...]          # the fields' lengths in ``flat``, in ``_views``' order
    host: tuple                     # the metadata's host fields (``_views``)

    def __iter__(self):
        """(input_ids, positions, metadata, logits_indices), as the runner unpacks them."""
        return iter((self.input_ids, self.positions, self.metadata, self.logits_indices))


def prepare_inputs(seqs: list[ScheduledSequence], block_size: int,
                   has_state: bool = False) -> StepInputs:
    """Flatten the step's sequences (host tensors). ``has_state``: the model has recurrent-state
    layers, so each sequence's state slot and whether it starts from it go along."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for s in seqs:            # one pass, a decode's single token without a range (hot path)
        toks, start, blocks = s.token_ids, s.start_pos, s.block_ids
        n = len(toks)
        input_ids += toks
        if n == 1:
            positions.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            pos = range(start, start + n)
            positions += pos
            slots += [blocks[p // bs] * bs + p % bs for p in pos]
        query_lens.append(n)
        seq_lens.append(start + n)
        if s.do_sample:
            logits_indices.append(len(input_ids) - 1)
    max_blocks = max(len(s.block_ids) for s in seqs)
    tables: list[int] = []
    for s in seqs:
        tables += s.block_ids
        if len(s.block_ids) < max_blocks:
            tables += [0] * (max_blocks - len(s.block_ids))
    num_decodes = 0
    while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
        num_decodes += 1
    state_slots: list[int] = []
    has_init = None
    if has_state:
        # Every running request holds a slot (core/state_slots.py); a chunk at position 0
        # (new, or recomputed after preemption) starts from zeros, not the slot's contents.
        if any(s.state_slot is None for s in seqs):
            raise RuntimeError("a scheduled sequence has no recurrent-state slot")
        state_slots = [s.state_slot for s in seqs]
        has_init = [s.start_pos > 0 for s in seqs]
    fields = (input_ids, positions, slots, seq_lens, [0, *itertools.accumulate(query_lens)],
              logits_indices, tables, state_slots)
    # array -> frombuffer: a C loop over the ints, 4x faster than torch.tensor's per-element
    # conversion (43 us for a batch-32 step's 513 ints here); the tensor keeps the array alive.
    flat = torch.frombuffer(array.array("q", itertools.chain.from_iterable(fields)),
                            dtype=torch.long)
    host = (seq_lens, query_lens, num_decodes, bs, has_init)
    return _views(flat, tuple(map(len, fields)), host)


def _views(flat: torch.Tensor, sizes: tuple[int, ...], host: tuple) -> StepInputs:
    """StepInputs whose tensors are views of ``flat`` (host or device) by ``sizes``; ``host``:
    the metadata's host fields (seq_lens_cpu, query_lens_cpu, num_decodes, block_size,
    has_initial_state)."""
    ids, pos, slots, seq_lens, qsl, logits_indices, tables, state = \
        flat.split_with_sizes(sizes)
    seq_lens_cpu, query_lens_cpu, num_decodes, block_size, has_init = host
    md = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(len(seq_lens_cpu), -1),
                           seq_lens=seq_lens, query_start_loc=qsl, seq_lens_cpu=seq_lens_cpu,
                           query_lens_cpu=query_lens_cpu, num_decodes=num_decodes,
                           block_size=block_size,
                           state_slots=state if has_init is not None else None,
                           has_initial_state=has_init)
    return StepInputs(ids, pos, md, logits_indices, flat, sizes, host)


def to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """The same inputs on ``device``: one copy of ``flat`` (the host's, as is, on CPU), through
    page-locked memory where there is some, so the host does not wait for the step in flight
    (async scheduling)."""
    if device.type == "cpu":
        return inputs
    return _views(platform_for(device).upload(inputs.flat, device), inputs.sizes, inputs.host)
