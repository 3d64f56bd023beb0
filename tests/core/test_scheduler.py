import random

import pytest

from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.request import Request, RequestStatus
from vllm.core.sched_output import RunnerOutput, SampledToken
from vllm.core.scheduler import Scheduler
from vllm.sampling_params import SamplingParams


def make_sched(num_blocks=64, block_size=4, max_tokens=64, max_seqs=8, max_len=256,
               chunked=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks), max_len)


def req(rid: str, n_prompt: int, max_tokens=100, t=0.0) -> Request:
    prompt = [(hash(rid) + i) % 50 + 1 for i in range(n_prompt)]
    return Request(rid, None, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=t)


def fake_token(rid: str, n_out: int) -> int:
    # Deterministic "model": the token depends only on the request and its output position.
    return 100 + 10 * (sum(map(ord, rid)) % 7) + n_out


def step(s: Scheduler):
    """One engine step with a fake runner; finishes requests at max_tokens like the engine."""
    out = s.schedule()
    sampled = {}
    for seq in out.sequences:
        r = s.requests[seq.req_id]
        assert seq.start_pos == r.num_computed_tokens
        assert len(seq.block_ids) * s.block_manager.block_size >= seq.start_pos + seq.num_tokens
        assert seq.token_ids == r.all_token_ids[seq.start_pos:seq.start_pos + seq.num_tokens]
        if seq.do_sample:
            sampled[seq.req_id] = SampledToken(fake_token(seq.req_id, r.num_output_tokens))
    touched = s.update_from_output(out, RunnerOutput(sampled))
    for r in touched:
        if not r.is_finished and r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    s.block_manager.check_invariants()
    return out, touched


def test_new_request_joins_running_batch():
    s = make_sched()
    s.add_request(req("a", 5))
    out, _ = step(s)
    assert [(q.req_id, q.num_tokens, q.do_sample) for q in out.sequences] == [("a", 5, True)]
    s.add_request(req("b", 6))
    out, touched = step(s)
    # The decode of "a" comes first, then the whole prefill of "b".
    assert [(q.req_id, q.num_tokens, q.start_pos) for q in out.sequences] == [("a", 1, 5),
                                                                              ("b", 6, 0)]
    assert out.sequences[0].token_ids == [fake_token("a", 0)]
    assert {r.request_id for r in touched} == {"a", "b"}
    assert s.requests["a"].num_output_tokens == 2 and s.requests["b"].num_output_tokens == 1
    assert s.num_running == 2 and s.num_waiting == 0


def test_chunked_prefill_chunk_sizes_under_small_budget():
    s = make_sched(max_tokens=8)
    s.add_request(req("a", 20))
    chunks = []
    for _ in range(3):
        out, touched = step(s)
        (q,) = out.sequences
        chunks.append((q.start_pos, q.num_tokens, q.do_sample))
        assert bool(touched) == q.do_sample
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert s.requests["a"].num_output_tokens == 1
    # A second long prompt shares the budget with the running decode: 1 + 7 tokens.
    s.add_request(req("b", 10))
    out, _ = step(s)
    assert [(q.req_id, q.num_tokens) for q in out.sequences] == [("a", 1), ("b", 7)]
    assert out.total_num_tokens == 8
    out, _ = step(s)
    assert [(q.req_id, q.num_tokens, q.do_sample) for q in out.sequences] == [
        ("a", 1, True), ("b", 3, True)]


def test_without_chunking_a_prompt_waits_for_a_full_budget():
    s = make_sched(max_tokens=8, chunked=False)
    s.add_request(req("a", 4))
    step(s)
    s.add_request(req("b", 8))  # 1 decode + 8 > 8: b must wait until a finishes
    out, _ = step(s)
    assert [q.req_id for q in out.sequences] == ["a"]
    s.abort_requests("a")
    out, _ = step(s)
    assert [(q.req_id, q.num_tokens) for q in out.sequences] == [("b", 8)]


def test_preempts_newest_and_resumes_with_outputs():
    # 6 blocks x 2 tokens; three 3-token prompts take 2 blocks each after prefill.
    s = make_sched(num_blocks=6, block_size=2)
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 3, t=float(i)))
    step(s)  # prefill all: 2 blocks each, 0 free
    out, _ = step(s)  # decode: 4 tokens each still fit in 2 blocks
    assert out.num_preempted == 0 and s.block_manager.num_free_blocks == 0
    c = s.requests["c"]
    c_outputs = list(c.output_token_ids)
    assert len(c_outputs) == 2
    out, _ = step(s)  # 5 tokens need a 3rd block each: the newest ("c") is preempted
    assert out.num_preempted == 1
    assert [q.req_id for q in out.sequences] == ["a", "b"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and not c.block_ids
    assert list(s.waiting) == [c]
    s.abort_requests(["a", "b"])
    out, touched = step(s)
    (q,) = out.sequences
    # Resume recomputes the prompt and the outputs generated before preemption.
    assert q.req_id == "c" and q.start_pos == 0 and q.do_sample
    assert q.token_ids == c.prompt_token_ids + c_outputs
    assert out.finished_req_ids == {"a", "b"}
    assert c.output_token_ids == c_outputs + [fake_token("c", 2)]
    assert c.num_computed_tokens == 5 and c.num_preemptions == 1


def test_lone_request_preempts_itself_then_stops_at_capacity():
    s = make_sched(num_blocks=2, block_size=2)  # 4 token slots
    s.add_request(req("a", 2))
    for _ in range(6):
        if not s.has_unfinished_requests():
            break
        _, touched = step(s)
    assert not s.has_unfinished_requests()
    # It produced output before running out of KV cache, so it stops as "length".
    assert touched and touched[0].status is RequestStatus.FINISHED_LENGTH
    assert touched[0].num_output_tokens >= 2
    assert s.block_manager.num_free_blocks == 2


def test_abort_frees_blocks_and_reports_finished_ids():
    s = make_sched(num_blocks=10, block_size=4)
    s.add_request(req("a", 9))
    s.add_request(req("b", 3))
    step(s)
    assert s.block_manager.num_free_blocks == 10 - 3 - 1
    aborted = s.abort_requests(["a", "nope"])
    assert [r.request_id for r in aborted] == ["a"]
    assert aborted[0].status is RequestStatus.FINISHED_ABORTED and not aborted[0].block_ids
    assert s.block_manager.num_free_blocks == 10 - 1
    out, _ = step(s)
    assert out.finished_req_ids == {"a"}
    assert [q.req_id for q in out.sequences] == ["b"]
    out, _ = step(s)
    assert out.finished_req_ids == set()
    s.abort_requests("b")
    assert s.kv_usage == 0.0 and not s.has_unfinished_requests()


def test_abort_of_waiting_request():
    s = make_sched(max_seqs=1)
    s.add_request(req("a", 3))
    s.add_request(req("b", 3))
    step(s)
    s.abort_requests("b")
    assert s.num_waiting == 0 and s.get_num_unfinished_requests() == 1
    assert s.schedule().finished_req_ids == {"b"}


def test_max_num_seqs_respected():
    s = make_sched(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, max_tokens=3, t=float(i)))
    out, _ = step(s)
    assert [q.req_id for q in out.sequences] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 1
    step(s)
    out, _ = step(s)  # r0 and r1 reach max_tokens=3 here and are finished by the engine
    assert "r2" not in {q.req_id for q in out.sequences}
    out, _ = step(s)
    assert [q.req_id for q in out.sequences] == ["r2"]
    assert out.finished_req_ids == {"r0", "r1"}


@pytest.mark.parametrize("n_prompt,max_len,why", [(40, 256, "KV capacity"),
                                                  (20, 16, "max_model_len")])
def test_request_that_never_fits_fails_without_hanging(n_prompt, max_len, why):
    s = make_sched(num_blocks=8, block_size=4, max_len=max_len)  # 32 token slots
    s.add_request(req("big", n_prompt))
    s.add_request(req("ok", 4))
    out, touched = step(s)
    assert [q.req_id for q in out.sequences] == ["ok"]
    big = next(r for r in touched if r.request_id == "big")
    assert big.status is RequestStatus.FINISHED_ERROR
    assert why in big.error and str(n_prompt) in big.error
    assert "big" in out.finished_req_ids
    assert s.get_num_unfinished_requests() == 1


def test_random_workload_invariants_and_completion():
    rng = random.Random(1)
    s = make_sched(num_blocks=12, block_size=4, max_tokens=16, max_seqs=4)  # 48 token slots
    reqs = []
    for i in range(12):
        reqs.append(req(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12), t=float(i)))
        s.add_request(reqs[-1])
    preempted = 0
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s)
        preempted += out.num_preempted
        assert out.total_num_tokens <= 16 and len(out.sequences) <= 4
        assert len({q.req_id for q in out.sequences}) == len(out.sequences)
    assert not s.has_unfinished_requests(), "workload did not drain"
    assert preempted > 0, "workload too small to exercise preemption"
    assert s.block_manager.num_free_blocks == 12
    for r in reqs:
        # Every request fits (<= 32 tokens), so each ends by length with the exact outputs
        # the fake model produces, however often it was preempted and recomputed.
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [fake_token(r.request_id, k)
                                      for k in range(r.sampling_params.max_tokens)]


def test_failure_is_reported_even_when_nothing_is_scheduled():
    s = make_sched(num_blocks=2, block_size=2)
    s.add_request(req("big", 9))
    out = s.schedule()
    assert out.is_empty and out.finished_req_ids == {"big"}
    (r,) = s.update_from_output(out, RunnerOutput({}))
    assert r.status is RequestStatus.FINISHED_ERROR and not s.has_unfinished_requests()
    assert s.schedule().is_empty  # an empty step needs no update before the next schedule


def test_schedule_twice_without_update_is_an_error():
    s = make_sched()
    s.add_request(req("a", 3))
    s.schedule()
    with pytest.raises(RuntimeError, match="update_from_output"):
        s.schedule()


def test_duplicate_request_id_rejected():
    s = make_sched()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="'a'"):
        s.add_request(req("a", 3))
