"""vllm/worker/step_inputs.py: a step's sequences flattened, checked against values worked out
by hand (block size 4), every field a view of one int64 tensor, and the device copy's views
split the same way (a recording fake stands in for a device: ``to_device`` moves ``flat`` once)."""
from __future__ import annotations

import pytest
import torch

from vllm import SamplingParams
from vllm.core.sched_output import ScheduledSequence
from vllm.worker.step_inputs import prepare_inputs, to_device

SP = SamplingParams()


def seq(tokens, start, blocks, sample=True, state=None):
    return ScheduledSequence("r", tokens, start, blocks, sample, SP, [1], [], state_slot=state)


def step():
    # Two decodes (positions 5 and 0), then a prefill chunk of 3 at positions 2..4 that does
    # not sample (a chunk before the prompt's end).
    return [seq([11], 5, [7, 3]), seq([12], 0, [9]), seq([13, 14, 15], 2, [4, 6], sample=False)]


def test_fields_equal_the_hand_worked_values():
    x = prepare_inputs(step(), block_size=4)
    md = x.metadata
    assert x.input_ids.tolist() == [11, 12, 13, 14, 15]
    assert x.positions.tolist() == [5, 0, 2, 3, 4]
    # position p of a sequence -> block_ids[p // 4] * 4 + p % 4
    assert md.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4 + 0, 4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 0]
    assert md.block_tables.tolist() == [[7, 3], [9, 0], [4, 6]]
    assert md.seq_lens.tolist() == [6, 1, 5] and md.seq_lens_cpu == [6, 1, 5]
    assert md.query_start_loc.tolist() == [0, 1, 2, 5] and md.query_lens_cpu == [1, 1, 3]
    assert md.num_decodes == 2 and md.block_size == 4
    assert x.logits_indices.tolist() == [0, 1]
    assert md.state_slots is None and md.has_initial_state is None
    for t in (x.input_ids, x.positions, md.slot_mapping, md.block_tables, md.seq_lens,
              md.query_start_loc, x.logits_indices):
        assert t.dtype == torch.int64 and t.is_contiguous()
        assert t.untyped_storage().data_ptr() == x.flat.untyped_storage().data_ptr()


def test_recurrent_state_slots_go_along():
    seqs = [seq([1], 3, [0], state=5), seq([2, 3], 0, [1], state=2)]
    md = prepare_inputs(seqs, block_size=4, has_state=True).metadata
    assert md.state_slots.tolist() == [5, 2] and md.has_initial_state == [True, False]
    with pytest.raises(RuntimeError, match="no recurrent-state slot"):
        prepare_inputs([seq([1], 0, [0])], block_size=4, has_state=True)


def test_to_device_moves_flat_once_and_splits_it_the_same_way(monkeypatch):
    x = prepare_inputs(step(), block_size=4)
    assert to_device(x, torch.device("cpu")) is x
    moved = []
    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):          # "the device": a copy, recorded
        moved.append(self.numel())
        return real_to(self, "cpu").clone()
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    y = to_device(x, torch.device("meta"))
    assert moved == [x.flat.numel()]
    assert y.flat.data_ptr() != x.flat.data_ptr()
    assert y.input_ids.tolist() == x.input_ids.tolist()
    assert y.positions.tolist() == x.positions.tolist()
    assert y.metadata.block_tables.tolist() == x.metadata.block_tables.tolist()
    assert y.metadata.query_start_loc.tolist() == x.metadata.query_start_loc.tolist()
    assert y.logits_indices.tolist() == x.logits_indices.tolist()
    assert y.metadata.seq_lens_cpu == x.metadata.seq_lens_cpu
