"""``Scheduler.schedule_ahead`` (async scheduling): the step after one in flight, built before
that step's tokens are applied. A fake runner samples ``fake_token`` (a function of the request
and its output position), so a pipelined run can be compared with the plain one step by step."""
from __future__ import annotations

import pytest

from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.request import Request, RequestStatus
from vllm.core.sched_output import RunnerOutput, SampledToken, SchedulerOutput
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams


def _sched(async_scheduling=True, num_blocks=64, block_size=4, max_len=256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     async_scheduling=async_scheduling),
                     CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks), max_len)


def _req(rid: str, n_prompt: int = 3, **params) -> Request:
    params.setdefault("max_tokens", 50)
    return Request(rid, None, [7 + i for i in range(n_prompt)], SamplingParams(**params))


def fake_token(rid: str, n_out: int) -> int:
    return 100 + 10 * (sum(map(ord, rid)) % 7) + n_out


def _sampled(s: Scheduler, out: SchedulerOutput, n_out: dict[str, int]) -> RunnerOutput:
    """The fake runner's tokens for ``out``; ``n_out``: each request's outputs before it (a
    request finished since gets a token that is dropped)."""
    return RunnerOutput({q.req_id: SampledToken(fake_token(q.req_id, n_out.get(q.req_id, -99)))
                         for q in out.sequences if q.do_sample})


def _apply(s: Scheduler, out: SchedulerOutput, runner_out: RunnerOutput,
           stops: dict[str, int]) -> None:
    """update_from_output, then finish as the engine would: at max_tokens, or on a stop
    position (``stops``: request -> the output count at which its token is a stop token)."""
    for r in s.update_from_output(out, runner_out):
        if r.is_finished:
            continue
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        elif stops.get(r.request_id) == r.num_output_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
    s.block_manager.check_invariants()


def _run(s: Scheduler, reqs: list[Request], stops: dict[str, int], ahead: bool):
    """Drive ``s`` to the end, launching ahead where it offers; returns each request's outputs
    and the number of steps scheduled ahead."""
    for r in reqs:
        s.add_request(r)
    outputs, n_ahead, pending = {r.request_id: r for r in reqs}, 0, None
    while s.has_unfinished_requests() or pending is not None:
        out = pending if pending is not None else s.schedule()
        # The step before ``out`` is applied by now: its outputs are the host's.
        n_out = {q.req_id: s.requests[q.req_id].num_output_tokens
                 for q in out.sequences if q.req_id in s.requests}
        runner_out = _sampled(s, out, n_out)
        pending = s.schedule_ahead(out) if ahead else None
        n_ahead += pending is not None
        if pending is not None:
            after = {q.req_id: q.start_pos + q.num_tokens for q in out.sequences}
            for q in pending.sequences:
                if q.pending_token:            # the token out samples, at the next position
                    assert q.do_sample and q.num_tokens == 1 and q.start_pos == after[q.req_id]
                else:                          # admitted: a prefill of known tokens
                    assert q.req_id not in after
                    assert q.start_pos == s.requests[q.req_id].num_computed_tokens
                assert len(q.block_ids) * s.block_manager.block_size >= \
                    q.start_pos + q.num_tokens
        _apply(s, out, runner_out, stops)
    return {rid: r.output_token_ids for rid, r in outputs.items()}, n_ahead


def test_pipelined_run_gives_the_plain_runs_tokens_and_frees_every_block():
    """Requests stop by length and on stop positions (their ahead row is computed and
    dropped); outputs are the plain scheduler's, and every block comes back."""
    def reqs():
        return [_req("a", max_tokens=5), _req("b", 9, max_tokens=12), _req("c", max_tokens=30),
                _req("d", 2, max_tokens=7)]
    stops = {"c": 9, "d": 3}
    plain, none_ahead = _run(_sched(), reqs(), stops, ahead=False)
    s = _sched()
    piped, n_ahead = _run(s, reqs(), stops, ahead=True)
    assert piped == plain and none_ahead == 0
    assert [len(plain[r]) for r in "abcd"] == [5, 12, 9, 3]
    # One prefill step, then b's 11 decode steps, each scheduled ahead (b's 12th token is its
    # last, so none after it).
    assert n_ahead == 11
    assert s.block_manager.num_free_blocks == 64 and not s._in_flight


def test_ahead_leaves_out_the_requests_their_token_finishes_by_length():
    s = _sched(max_len=12)
    for r in (_req("a", max_tokens=2), _req("b", 9, max_tokens=50), _req("c")):
        s.add_request(r)
    first = s.schedule()                       # the prefills, each sampling its first token
    ahead = s.schedule_ahead(first)
    assert [(q.req_id, q.start_pos) for q in ahead.sequences] == [("a", 3), ("b", 9), ("c", 3)]
    assert s.schedule_ahead(first) is None     # one step ahead at most
    _apply(s, first, _sampled(s, first, {"a": 0, "b": 0, "c": 0}), {})
    nxt = s.schedule_ahead(ahead)              # a's 2nd token is its last (max_tokens)
    assert [(q.req_id, q.start_pos, q.token_ids) for q in nxt.sequences] == [
        ("b", 10, [0]), ("c", 4, [0])]
    _apply(s, ahead, _sampled(s, ahead, {"a": 1, "b": 1, "c": 1}), {})
    assert "a" not in s.requests
    last = s.schedule_ahead(nxt)               # b's 3rd token reaches max_model_len 12
    assert [q.req_id for q in last.sequences] == ["c"]


@pytest.mark.parametrize("params,why", [
    (dict(repetition_penalty=1.2), "penalties"), (dict(presence_penalty=0.5), "penalties"),
    (dict(frequency_penalty=0.5), "penalties"), (dict(min_tokens=3), "min_tokens"),
])
def test_no_ahead_where_sampling_reads_the_outputs(params, why):
    s = _sched()
    s.add_request(_req("a"))
    s.add_request(_req("b", **params))
    out = s.schedule()
    _apply(s, out, _sampled(s, out, {"a": 0, "b": 0}), {})
    out = s.schedule()
    assert s.schedule_ahead(out) is None, why


def test_min_tokens_reached_allows_ahead():
    """min_tokens masks while the outputs are fewer; the host count is one short ahead, so
    only once it alone reaches min_tokens."""
    s = _sched()
    s.add_request(_req("a", min_tokens=2))
    n = 0
    results = []
    while n < 4:
        out = s.schedule()
        ahead = s.schedule_ahead(out)
        results.append((s.requests["a"].num_output_tokens, ahead is not None))
        if ahead is not None:
            s.drop_ahead()
        _apply(s, out, _sampled(s, out, {"a": s.requests["a"].num_output_tokens}), {})
        n += 1
    assert results == [(0, False), (1, False), (2, True), (3, True)]


def test_no_ahead_when_off_for_a_prompt_chunk_or_short_of_blocks():
    off = _sched(async_scheduling=False)
    off.add_request(_req("a"))
    out = off.schedule()
    _apply(off, out, _sampled(off, out, {"a": 0}), {})
    assert off.schedule_ahead(off.schedule()) is None
    chunked = Scheduler(SchedulerConfig(max_num_batched_tokens=4, async_scheduling=True),
                        CacheConfig(block_size=4, num_gpu_blocks=64), 256)
    chunked.add_request(_req("a", 6))
    out = chunked.schedule()                   # 4 of 6 prompt tokens: samples nothing
    assert not out.sequences[0].do_sample and chunked.schedule_ahead(out) is None
    tight = _sched(num_blocks=1, block_size=4)  # 4 KV slots: prompt 3 + 1 decode
    tight.add_request(_req("a"))
    out = tight.schedule()
    _apply(tight, out, _sampled(tight, out, {"a": 0}), {})
    out = tight.schedule()                     # position 3: the last slot
    assert tight.schedule_ahead(out) is None   # position 4 needs a block there is not


def test_ahead_admits_waiting_requests_after_its_decodes():
    """Waiting requests join the step ahead as schedule() admits them (prefills after the
    decodes, in the budget left); a prompt that samples in the step in flight decodes in
    the step ahead of it."""
    s = _sched()
    s.add_request(_req("a"))
    out = s.schedule()
    ahead = s.schedule_ahead(out)              # a's prompt samples: its decode goes ahead
    assert [(q.req_id, q.start_pos, q.pending_token) for q in ahead.sequences] == [
        ("a", 3, True)]
    _apply(s, out, _sampled(s, out, {"a": 0}), {})
    s.add_request(_req("w", 5))
    nxt = s.schedule_ahead(ahead)
    assert [(q.req_id, q.start_pos, q.num_tokens, q.pending_token) for q in nxt.sequences] \
        == [("a", 4, 1, True), ("w", 0, 5, False)]
    assert not s.waiting and s.requests["w"].status is RequestStatus.RUNNING
def test_in_flight_order_and_drop_ahead():
    s = _sched()
    s.add_request(_req("a"))
    out = s.schedule()
    _apply(s, out, _sampled(s, out, {"a": 0}), {})
    out = s.schedule()
    ahead = s.schedule_ahead(out)
    _apply(s, out, _sampled(s, out, {"a": 1}), {})
    with pytest.raises(RuntimeError, match="twice"):
        s.schedule()                           # the ahead step is in flight: apply it first
    _apply(s, ahead, _sampled(s, ahead, {"a": 2}), {})
    assert s.requests["a"].output_token_ids == [fake_token("a", i) for i in range(3)]
    out = s.schedule()
    assert s.schedule_ahead(out) is not None
    s.drop_ahead()                             # its launch failed: nothing in flight after
    s.update_from_output(SchedulerOutput([]), RunnerOutput({}))
    assert s.schedule().sequences[0].start_pos == s.requests["a"].num_computed_tokens


def test_ahead_reports_finished_ids_once():
    s = _sched()
    for r in ("a", "b"):
        s.add_request(_req(r))
    out = s.schedule()
    _apply(s, out, _sampled(s, out, {"a": 0, "b": 0}), {})
    s.abort_requests("b")
    out = s.schedule()
    assert out.finished_req_ids == {"b"}
    s.abort_requests("a")                      # aborted while its decode is in flight
    assert s.schedule_ahead(out) is None       # nothing left to run ahead
    _apply(s, out, RunnerOutput({"a": SampledToken(1)}), {})
    assert s.schedule().finished_req_ids == {"a"}


@pytest.mark.parametrize("seed", range(10))
def test_random_pipelined_runs_keep_every_invariant(seed):
    """Random arrivals, aborts (also of requests in a step ahead) and stop positions over few
    blocks (preemption: in 5 of these 10 runs) and a small token budget (prompts in chunks),
    pipelined where the scheduler offers: every block comes back, and each request's outputs
    are exactly the fake model's tokens up to where it stopped (max_tokens, a stop position,
    or its abort)."""
    import random
    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12,
                                  async_scheduling=True),
                  CacheConfig(block_size=4, num_gpu_blocks=10), 40)
    reqs, stops, aborted = {}, {}, set()
    pending, step, n_ahead = None, 0, 0
    while step < 12 or s.has_unfinished_requests() or pending is not None:
        if step < 12 and rng.random() < 0.6:
            rid = f"q{step}"
            reqs[rid] = _req(rid, rng.randint(1, 20), max_tokens=rng.randint(1, 12))
            stops[rid] = rng.randint(1, 14)
            s.add_request(reqs[rid])
        if s.running and rng.random() < 0.1:          # also while a step is ahead
            victim = rng.choice(s.running).request_id
            s.abort_requests(victim)
            aborted.add(victim)
        out = pending if pending is not None else s.schedule()
        n_out = {q.req_id: s.requests[q.req_id].num_output_tokens
                 for q in out.sequences if q.req_id in s.requests}
        runner_out = _sampled(s, out, n_out)
        pending = s.schedule_ahead(out)
        n_ahead += pending is not None
        _apply(s, out, runner_out, stops)
        step += 1
        assert step < 500
    assert s.block_manager.num_free_blocks == 10 and not s._in_flight
    for rid, r in reqs.items():
        n = len(r.output_token_ids)
        assert r.output_token_ids == [fake_token(rid, i) for i in range(n)]
        if rid not in aborted and r.status is not RequestStatus.FINISHED_ERROR:
            assert n == min(r.sampling_params.max_tokens, stops[rid]), rid
    assert n_ahead > 0
