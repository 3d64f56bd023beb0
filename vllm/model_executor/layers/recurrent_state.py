"""Per-request recurrent state: the layers that keep it and how a step's layout reaches them.

A ``RecurrentStateLayer`` (Gated DeltaNet, Mamba-2) carries state from one step to the next:
a conv window and an SSM / delta-rule state per request. The model runner allocates, for each
such layer, ``state[name] = zeros([num_slots, *shape], dtype)`` per entry of
``state_shapes()``; the scheduler gives each running request one slot (``core/state_slots.py``)
and the runner passes the step's ``AttentionMetadata.state_slots`` ([B] int64, sequence i's
slot) and ``has_initial_state`` (sequence i continues from its stored state: start_pos > 0).

Contract for a layer's forward (``step_layout`` reads it):
- no metadata (a plain forward): the whole input is ONE sequence from zero state; nothing is
  stored;
- metadata but no bound state (a dummy/profiling run): each sequence starts from zero state
  and nothing is stored;
- otherwise sequence i reads slot ``state_slots[i]`` when ``has_initial_state[i]`` (else
  zeros) and writes its final state back to that slot; rows of other slots are untouched.
A slot's contents are stale garbage while free: a sequence with start_pos 0 never reads them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from vllm.model_executor.forward_context import get_attn_metadata


@dataclass
class StateStep:
    """One forward's sequences as a recurrent layer sees them."""
    starts: list[int]
    """[B + 1] token offsets: sequence i is tokens starts[i]:starts[i+1] (contiguous)."""
    slots: torch.Tensor | None
    """[B] int64 slots to read/write, or None when nothing is stored (no metadata / no state)."""
    has_initial_state: list[bool]
    """[B]: sequence i starts from its slot's state (False: from zeros)."""

    @property
    def num_seqs(self) -> int:
        return len(self.starts) - 1


class RecurrentStateLayer(nn.Module):
    """A layer that keeps per-request state between steps (conv window, SSM / delta-rule state).

    Subclasses implement ``state_shapes``; the runner binds ``state`` (name -> [num_slots,
    *shape] zeros) with ``bind_state``. ``state`` stays None in a plain or profiling forward.
    """

    state: dict[str, torch.Tensor] | None = None

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per slot: name -> (shape, dtype), e.g. {"conv": ((C, K-1), f32), "ssm": ((H, Dk, Dv),
        f32)}."""
        raise NotImplementedError

    def state_bytes_per_slot(self) -> int:
        return sum(math.prod(shape) * (torch.finfo(dt).bits // 8 if dt.is_floating_point
                                       else torch.iinfo(dt).bits // 8)
                   for shape, dt in self.state_shapes().values())

    def bind_state(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        """Allocate zeroed state for ``num_slots`` slots (0: unbind)."""
        if num_slots <= 0:
            self.state = None
            return
        self.state = {name: torch.zeros((num_slots, *shape), dtype=dt, device=device)
                      for name, (shape, dt) in self.state_shapes().items()}

    def step_layout(self, num_tokens: int) -> StateStep:
        """The current forward's sequences (see the module docstring for the three cases)."""
        md = get_attn_metadata()
        if md is None:
            return StateStep([0, num_tokens], None, [False])
        starts = md.query_start_loc_cpu
        if starts[-1] != num_tokens:
            raise ValueError(f"metadata covers {starts[-1]} tokens, input has {num_tokens}")
        if self.state is None or md.state_slots is None:
            return StateStep(list(starts), None, [False] * md.num_seqs)
        has_init = md.has_initial_state
        if has_init is None:
            # A caller that gave slots but no flags: a sequence continues iff it has context.
            has_init = [c > q for c, q in zip(md.seq_lens_cpu, md.query_lens_cpu)]
        return StateStep(list(starts), md.state_slots, list(has_init))

    def read_state(self, name: str, step: StateStep) -> torch.Tensor | None:
        """[B, *shape] initial state of each sequence (zeros where it starts fresh), or None
        when nothing is stored (the caller starts every sequence from zeros)."""
        if step.slots is None:
            return None
        init = self.state[name].index_select(0, step.slots)
        fresh = [i for i, h in enumerate(step.has_initial_state) if not h]
        if fresh:
            init[fresh] = 0
        return init

    def write_state(self, name: str, step: StateStep, values: torch.Tensor) -> None:
        """Store each sequence's final state [B, *shape] at its slot (no-op when not storing)."""
        if step.slots is None:
            return
        self.state[name].index_copy_(0, step.slots, values.to(self.state[name].dtype))


def recurrent_layers(model: nn.Module) -> list[RecurrentStateLayer]:
    return [m for m in model.modules() if isinstance(m, RecurrentStateLayer)]


def state_bytes_per_slot(layers: list[RecurrentStateLayer]) -> int:
    """Bytes one request's state takes over ``layers`` (every entry of ``state_shapes``)."""
    return sum(layer.state_bytes_per_slot() for layer in layers)
