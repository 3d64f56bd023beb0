"""Continuous batching with chunked prefill and recompute preemption.

Each ``schedule()`` step:
1. Running requests, oldest first, get their next tokens: one for a decode, or the next
   chunk of an unfinished (chunked) prefill, within the token budget. When a request's block
   table cannot grow, the newest running request is preempted (blocks freed, progress
   dropped, put back at the front of the waiting queue) until it can, or it is itself the
   newest and is preempted.
2. If nothing was preempted, waiting requests join in FCFS order while the token budget
   (``max_num_batched_tokens``), ``max_num_seqs`` and free blocks allow; a prompt longer
   than the remaining budget is chunked. A preempted request resumes by recomputing its
   prompt *and* already generated outputs as a prefill.

Where requests stop: every stop decision except capacity errors (EOS, stop tokens, stop
strings, max_tokens and max_model_len -> "length") is made by
``vllm.engine.output_processor.OutputProcessor``; the engine then calls ``finish_request``
before the next ``schedule()``. The scheduler itself only finishes requests that can never
fit (FINISHED_ERROR) and aborted ones. It never touches tensors.

Recurrent state (models with Mamba / Gated DeltaNet layers, ``cache_config.num_state_slots``
> 0): a request also needs a state slot (``state_slots.py``) to be admitted; it keeps it while
running and frees it with its blocks on finish, abort and preemption.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from typing import Iterable

from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.core.request import Request, RequestStatus
from vllm.core.sched_output import (RunnerOutput, SampledToken, ScheduledSequence,
                                     SchedulerOutput)
from vllm.core.state_slots import StateSlotManager
from vllm.logger import init_logger
from vllm.outputs import Logprob

logger = init_logger(__name__)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 max_model_len: int):
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks is None: the engine must size the KV "
                             "cache before building the scheduler")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len!r} is invalid: must be an int >= 1")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(cache_config.num_gpu_blocks, cache_config.block_size)
        self.state_slots = StateSlotManager(cache_config.num_state_slots)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by admission order: oldest first
        self._order: dict[str, int] = {}  # request id -> admission counter (FCFS key)
        self._counter = itertools.count()
        self._finished_ids: set[str] = set()  # finished since the last schedule()
        self._failed: list[Request] = []  # finished by schedule(); returned by next update
        self._in_flight = False  # a SchedulerOutput awaits update_from_output
        self._ahead: SchedulerOutput | None = None
        """``schedule_ahead``'s step: in flight once the one before it is applied."""
        self.num_preemptions_total = 0  # for metrics and tests

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id={req.request_id!r} is already in the scheduler")
        if req.status is not RequestStatus.WAITING:
            raise ValueError(f"request {req.request_id}: status {req.status.name}, expected WAITING")
        self.requests[req.request_id] = req
        self._order[req.request_id] = next(self._counter)
        self.waiting.append(req)

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort the given unfinished requests (unknown ids are ignored); returns the aborted."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = []
        for rid in request_ids:
            if rid in self.requests:
                aborted.append(self.finish_request(rid, RequestStatus.FINISHED_ABORTED))
        return aborted

    def finish_request(self, req_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> Request:
        """Mark a request finished, free its blocks and forget it."""
        if not status.is_finished:
            raise ValueError(f"status={status.name} is invalid: must be a FINISHED_* status")
        req = self.requests.pop(req_id, None)
        if req is None:
            raise KeyError(f"request_id={req_id!r} is not an unfinished request")
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free(req)
        self.state_slots.free(req)
        self._order.pop(req_id, None)
        req.status = status
        req.stop_reason = stop_reason
        self._finished_ids.add(req_id)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.block_manager.usage

    # ---- scheduling --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._in_flight:
            raise RuntimeError("schedule() called twice without update_from_output()")
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        budget, num_preempted = self._schedule_running(budget, decodes, prefills)
        if num_preempted == 0:
            self._schedule_waiting(budget, prefills)
        out = SchedulerOutput(sequences=decodes + prefills, finished_req_ids=self._finished_ids,
                              num_preempted=num_preempted)
        self._finished_ids = set()
        self._in_flight = bool(out.sequences)
        return out

    def _schedule_running(self, budget: int, decodes: list[ScheduledSequence],
                          prefills: list[ScheduledSequence]) -> tuple[int, int]:
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_for(req, req.num_computed_tokens + n_new):
                victim = self.running[-1]  # newest admitted; never one scheduled this step
                self._preempt(victim)
                num_preempted += 1
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req was the newest and got preempted: nothing newer is left
            seq = self._make_seq(req, n_new)
            (decodes if n_new == 1 and seq.do_sample else prefills).append(seq)
            budget -= n_new
            i += 1
        return budget, num_preempted

    def _schedule_waiting(self, budget: int, prefills: list[ScheduledSequence]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._fail_if_never_fits(req):
                continue
            n_new = req.num_tokens - req.num_computed_tokens
            if n_new > budget and not self.config.enable_chunked_prefill:
                break  # wait for a step with enough budget (never-fits handled above)
            n_new = min(n_new, budget)
            if not self.state_slots.can_allocate(req):
                break  # every state slot is held by a running request
            if not self.block_manager.allocate_for(req, req.num_computed_tokens + n_new):
                break  # FCFS: later requests wait behind this one
            self.state_slots.allocate(req)      # cannot fail: checked above
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            keys = [self._order[r.request_id] for r in self.running]
            self.running.insert(bisect.bisect(keys, self._order[req.request_id]), req)
            prefills.append(self._make_seq(req, n_new))
            budget -= n_new

    def _fail_if_never_fits(self, req: Request) -> bool:
        """Finish ``req`` if its next step can never be scheduled, so the engine cannot hang."""
        need = req.num_tokens + 1  # the tokens so far plus the KV slot of the next token
        capacity = self.block_manager.capacity_tokens
        cfg = self.config
        if need <= min(capacity, self.max_model_len) and (
                cfg.enable_chunked_prefill or req.num_tokens <= cfg.max_num_batched_tokens):
            return False
        if req.num_output_tokens > 0:
            # It already produced output: stop it as "length" rather than lose that output.
            logger.warning("request %s: %d tokens exceed KV capacity %d (max_model_len %d); "
                           "finishing with reason 'length'", req.request_id, need, capacity,
                           self.max_model_len)
            self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
        else:
            self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
            req.error = (f"prompt of {req.num_prompt_tokens} tokens can never be scheduled: it "
                         f"needs {need} token slots but KV capacity is {capacity} tokens "
                         f"({self.block_manager.num_blocks} blocks x "
                         f"{self.block_manager.block_size}) and max_model_len is "
                         f"{self.max_model_len}"
                         + ("" if cfg.enable_chunked_prefill else
                            f", max_num_batched_tokens is {cfg.max_num_batched_tokens} "
                            "with chunked prefill disabled"))
        self._failed.append(req)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        self.state_slots.free(req)      # recomputed from token 0: its state restarts from zeros
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def _make_seq(self, req: Request, n_new: int) -> ScheduledSequence:
        start = req.num_computed_tokens
        end = start + n_new
        return ScheduledSequence(
            req_id=req.request_id, token_ids=req.token_slice(start, end), start_pos=start,
            block_ids=list(req.block_ids), do_sample=end == req.num_tokens,
            sampling_params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids, state_slot=req.state_slot)

    # ---- async scheduling: the next decode step while one is in flight -----------------
    def schedule_ahead(self, sched: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``sched`` (in flight: scheduled, not yet applied), as ``schedule()``
        will make it once ``sched``'s tokens are in, so the runner can launch it before they
        reach the host (``SchedulerConfig.async_scheduling``). Every request that samples in
        ``sched`` and is still running decodes once more, at the position after its chunk,
        its input the token it samples there (``pending_token``), except those that token
        finishes by length (max_tokens, max_model_len); then waiting requests are admitted as
        ``schedule()`` admits them, in the token budget left. A request its token stops (EOS,
        a stop token or string) is computed once more and that result dropped:
        ``update_from_output`` skips finished requests. None where only ``schedule()`` can
        decide: a chunk of ``sched`` does not sample (a prompt's next chunk), a sampled row
        reads its output tokens (penalties, min_tokens not yet reached, guided decoding), or a
        block is short (preemption). The returned step is in flight after
        ``update_from_output(sched)``; apply it next."""
        if (not self.config.async_scheduling or not self._in_flight or self._ahead is not None
                or not sched.sequences):
            return None
        decodes: list[ScheduledSequence] = []
        for s in sched.sequences:
            if not s.do_sample:
                return None                     # a prompt's next chunk: schedule()'s
            req = self.requests.get(s.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue                        # aborted since: nothing to compute
            if req.num_computed_tokens != s.start_pos or _reads_outputs(req):
                return None
            if req.at_length_limit(req.num_output_tokens + 1, self.max_model_len):
                continue                        # sched's token is its last
            pos = s.start_pos + s.num_tokens    # where sched's token goes
            if not self.block_manager.allocate_for(req, pos + 1):
                return None
            decodes.append(ScheduledSequence(
                req_id=req.request_id, token_ids=[0], start_pos=pos,
                block_ids=list(req.block_ids), do_sample=True,
                sampling_params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids, state_slot=req.state_slot,
                pending_token=True))
        prefills: list[ScheduledSequence] = []
        self._schedule_waiting(self.config.max_num_batched_tokens - len(decodes), prefills)
        if not decodes and not prefills:
            return None
        self._ahead = SchedulerOutput(sequences=decodes + prefills,
                                      finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        return self._ahead

    def drop_ahead(self) -> None:
        """Forget ``schedule_ahead``'s step (its launch or the step before it failed): the next
        ``update_from_output`` leaves nothing in flight. Blocks it allocated stay with their
        requests, for the steps that will use them."""
        self._ahead = None

    # ---- applying the runner's results -------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: RunnerOutput) -> list[Request]:
        """Advance computed counts and append sampled tokens.

        Returns the requests with something to report this step: those that got a new token,
        then those that ``schedule()`` finished because they can never fit (status
        FINISHED_ERROR with ``error`` set, or FINISHED_LENGTH). Call it after every
        ``schedule()``, with ``RunnerOutput({})`` when the output is empty, so those failures
        are reported. Requests finished or aborted since ``schedule()`` are skipped.
        """
        self._in_flight, self._ahead = self._ahead is not None, None
        touched: list[Request] = []
        now = time.monotonic()
        for seq in sched_out.sequences:
            req = self.requests.get(seq.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += seq.num_tokens
            for index, entry in runner_out.prompt_logprobs.get(seq.req_id, ()):
                # By index: a chunk recomputed after preemption writes the same values again.
                req.prompt_logprobs[index] = _logprob_dict(entry)
            if not seq.do_sample:
                continue
            sampled = runner_out.sampled.get(seq.req_id)
            if sampled is None:
                raise RuntimeError(f"runner returned no sampled token for request {seq.req_id} "
                                   "scheduled with do_sample=True")
            req.output_token_ids.append(sampled.token_id)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.sampling_params.logprobs is not None and sampled.logprob is not None:
                req.output_logprobs.append(_logprob_dict(sampled))
                req.cumulative_logprob = (req.cumulative_logprob or 0.0) + sampled.logprob
            touched.append(req)
        touched.extend(self._failed)
        self._failed = []
        return touched


def _reads_outputs(req: Request) -> bool:
    """Whether sampling ``req``'s next token needs its output tokens on the host: penalties,
    a min_tokens mask that may still apply (the count known here is one short), guided
    decoding's grammar state."""
    sp = req.sampling_params
    return (sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
            or sp.frequency_penalty != 0.0 or req.num_output_tokens < sp.min_tokens
            or sp.guided_decoding is not None)


def _logprob_dict(sampled: SampledToken) -> dict[int, Logprob]:
    """One position as vLLM reports it: the sampled token first (with its rank), then the top-k."""
    top = sampled.top_logprobs or []
    rank = next((i + 1 for i, (tid, _) in enumerate(top) if tid == sampled.token_id),
                sampled.rank)
    entries = {sampled.token_id: Logprob(sampled.logprob, rank=rank)}
    for i, (tid, lp) in enumerate(top):
        entries.setdefault(tid, Logprob(lp, rank=i + 1))
    return entries
