"""Recurrent-state slots (core/state_slots.py) and the scheduler's use of them: a running request
holds exactly one slot, no two running requests share one, and finish, abort and preemption
return it (a scheduler that leaks a slot fails these tests)."""
import random

import pytest

from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.request import Request, RequestStatus
from vllm.core.scheduler import Scheduler
from vllm.core.state_slots import StateSlotManager
from vllm.sampling_params import SamplingParams

from test_scheduler import req, step


def make_sched(num_slots, max_seqs=8, num_blocks=64, block_size=4, max_tokens=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens),
                     CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks,
                                 num_state_slots=num_slots), 256)


def check_slots(s: Scheduler) -> None:
    """Every running request holds a distinct slot, nobody else holds one, none is lost."""
    s.state_slots.check_invariants()
    slots = [r.state_slot for r in s.running]
    assert None not in slots and len(set(slots)) == len(slots)
    assert all(r.state_slot is None for r in s.waiting)
    assert s.state_slots.num_used_slots == len(s.running)


def test_manager_allocate_free_and_invariants():
    m = StateSlotManager(2)
    a, b, c = (Request(x, None, [1], SamplingParams()) for x in "abc")
    assert m.allocate(a) and m.allocate(b) and a.state_slot != b.state_slot
    assert m.allocate(a) and m.num_used_slots == 2           # idempotent
    assert not m.can_allocate(c) and not m.allocate(c) and c.state_slot is None
    m.free(a)
    assert a.state_slot is None and m.allocate(c) and m.num_free_slots == 0
    m.free(a)                                                 # holds none: no-op
    c.state_slot = b.state_slot
    with pytest.raises(RuntimeError, match="owned by 'b'"):
        m.free(c)
    m.check_invariants()


def test_manager_disabled_is_a_no_op():
    m = StateSlotManager(0)
    r = Request("a", None, [1], SamplingParams())
    assert not m.enabled and m.can_allocate(r) and m.allocate(r) and r.state_slot is None
    with pytest.raises(ValueError, match="num_state_slots"):
        StateSlotManager(-1)


def test_no_slots_without_recurrent_layers():
    s = make_sched(0)
    s.add_request(req("a", 5))
    out, _ = step(s)
    assert out.sequences[0].state_slot is None and s.requests["a"].state_slot is None


def test_admission_waits_for_a_free_slot():
    s = make_sched(2, max_seqs=4)
    for rid in "abc":
        s.add_request(req(rid, 3, max_tokens=3))
    out, _ = step(s)
    assert [q.req_id for q in out.sequences] == ["a", "b"]   # c: both slots are taken
    assert {q.state_slot for q in out.sequences} == {0, 1}
    check_slots(s)
    while "c" not in [q.req_id for q in step(s)[0].sequences]:
        check_slots(s)
    check_slots(s)                       # a/b finished: c got a returned slot
    assert s.requests["c"].state_slot in (0, 1)


def test_abort_and_finish_free_the_slot():
    s = make_sched(3)
    for rid in "abc":
        s.add_request(req(rid, 4))
    step(s)
    assert s.state_slots.num_free_slots == 0
    s.abort_requests("b")
    assert s.state_slots.num_free_slots == 1
    check_slots(s)
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    s.abort_requests(["c"])
    assert s.state_slots.num_free_slots == 3 and s.state_slots.num_used_slots == 0
    s.add_request(req("d", 4))
    out, _ = step(s)
    assert out.sequences[0].state_slot is not None


def test_preemption_frees_the_slot_and_resumes_from_zero():
    s = make_sched(3, num_blocks=4)
    for rid in "ab":
        s.add_request(req(rid, 7, max_tokens=20))
    preempted = False
    for _ in range(12):
        out, _ = step(s)
        check_slots(s)
        preempted |= out.num_preempted > 0
        for q in out.sequences:          # a resumed request restarts at token 0
            assert (q.start_pos == 0) == (s.requests[q.req_id].num_computed_tokens == q.num_tokens)
    assert preempted


def test_random_workload_never_shares_a_slot():
    rng = random.Random(0)
    s = make_sched(5, max_seqs=6, num_blocks=24)
    n = 0
    for _ in range(150):
        if rng.random() < 0.4:
            s.add_request(req(f"r{n}", rng.randint(1, 20), max_tokens=rng.randint(1, 12)))
            n += 1
        if s.running and rng.random() < 0.1:
            s.abort_requests(rng.choice(s.running).request_id)
        step(s)
        check_slots(s)
        assert len(s.running) <= 5
    s.abort_requests(list(s.requests))
    assert s.state_slots.num_free_slots == 5
