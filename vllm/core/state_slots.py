"""Per-request recurrent-state slots: which running request owns which row of the state pool.

A model with recurrent layers (Gated DeltaNet, Mamba) keeps a conv window and an SSM state per
request beside the paged KV cache (``model_executor/layers/recurrent_state.py``). The state is
fixed-size, so one slot per running request suffices: ``num_slots`` is ``max_num_seqs`` for
such a model and 0 otherwise (then every call is a no-op and requests never get a slot).

Lifecycle (driven by the scheduler): a request gets a slot when admitted (admission waits if
none is free), keeps it while running, and frees it on finish, abort and preemption. A
preempted request is recomputed from token 0, so its state restarts from zeros in whatever slot
it gets next (the runner passes has_initial_state = start_pos > 0, so a slot's stale contents
are never read).

Invariants (``check_invariants``): every slot in [0, num_slots) is free or owned by exactly one
request, never both, and a request owns at most one slot (``Request.state_slot``).
"""
from __future__ import annotations

from collections import deque

from vllm.core.request import Request


class StateSlotManager:
    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
            raise ValueError(f"num_state_slots={num_slots!r} is invalid: must be an int >= 0")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._owner: dict[int, str] = {}  # slot -> request id

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return len(self._owner)

    def can_allocate(self, request: Request) -> bool:
        """Whether ``request`` has or could get a slot now (always True when disabled)."""
        return not self.enabled or request.state_slot is not None or bool(self._free)

    def allocate(self, request: Request) -> bool:
        """Give ``request`` a slot (idempotent); False when none is free. No-op when disabled."""
        if not self.enabled or request.state_slot is not None:
            return True
        if not self._free:
            return False
        slot = self._free.popleft()
        self._owner[slot] = request.request_id
        request.state_slot = slot
        return True

    def free(self, request: Request) -> None:
        """Return the request's slot, if any, to the free list."""
        slot = request.state_slot
        if slot is None:
            return
        owner = self._owner.get(slot)
        if owner != request.request_id:      # checked before changing anything
            raise RuntimeError(f"state slot {slot} freed by request {request.request_id} but "
                               f"owned by {owner!r}")
        del self._owner[slot]
        self._free.append(slot)
        request.state_slot = None

    def check_invariants(self) -> None:
        """Raise AssertionError if a slot is lost, duplicated, or both free and owned."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a state slot is on the free list twice"
        assert not set(free) & self._owner.keys(), "a state slot is both free and owned"
        assert len(free) + len(self._owner) == self.num_slots, (
            f"free {len(free)} + used {len(self._owner)} != total {self.num_slots}")
        owners = list(self._owner.values())
        assert len(set(owners)) == len(owners), "a request owns two state slots"
