"""LLMEngine: add_request / step / abort. One step = schedule -> run -> process outputs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.config import VllmConfig
from vllm.core.request import Request
from vllm.core.sched_output import RunnerOutput, SchedulerOutput
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.moe_stats import MoEStatsReporter
from vllm.engine.output_processor import OutputProcessor, make_request_output
from vllm.engine.prompt_processor import PromptProcessor
from vllm.engine.structured_output import StructuredOutputManager
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.worker.model_runner import ModelRunner
from vllm.worker.pending_step import PendingStep
from vllm.worker.sampler import TokenMasks

logger = init_logger(__name__)


@dataclass
class _Parent:
    """Fan-in of an n > 1 request: child i is request ``f"{i}_{request_id}"``."""

    child_ids: list[str]
    latest: dict[str, CompletionOutput] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        logger.info("Initializing engine: %s", vllm_config.summary())
        self.prompts = PromptProcessor(mc)
        self.tokenizer = self.prompts.tokenizer
        self.runner = ModelRunner(vllm_config)
        self.runner.eos_token_id = self.prompts.eos_token_id
        sc = vllm_config.scheduler_config
        if sc.async_scheduling and self.runner.routing_recorder is not None:
            # A step ahead computes rows whose tokens are then dropped: the trace would hold
            # their routing as if they were the requests' tokens.
            logger.info("async_scheduling off: a routing trace is recorded")
            sc.async_scheduling = False
        self.scheduler = Scheduler(vllm_config.scheduler_config, vllm_config.cache_config,
                                   mc.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, mc.max_model_len)
        eos = [self.prompts.eos_token_id] if self.prompts.eos_token_id is not None else []
        self.structured = StructuredOutputManager(self.tokenizer, mc.hf_config.vocab_size,
                                                  eos + self.prompts.extra_stop_token_ids)
        self.moe_stats = MoEStatsReporter(self.runner, vllm_config.moe_cache_config)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}
        self._dropped_children: set[str] = set()
        """Children of aborted parents whose final outputs may still arrive this step."""
        self._ahead: tuple[SchedulerOutput, PendingStep] | None = None
        """The step launched ahead (async scheduling), applied by the next ``step()``."""
        self._closed = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    # ---- requests --------------------------------------------------------------------------
    def process_prompt(self, prompt, index: int | None = None) -> tuple[str | None, list[int]]:
        """Validate and tokenize one prompt -> (text or None, token ids). Raises ValueError."""
        return self.prompts.process(prompt, index)

    def render_chat(self, messages, chat_template=None, add_generation_prompt=True,
                    chat_template_kwargs: dict | None = None) -> dict:
        return self.prompts.render_chat(messages, chat_template, add_generation_prompt,
                                        chat_template_kwargs)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. ``prompt``: text, token ids, or a TokensPrompt/TextPrompt dict. A bad or
        too-long prompt raises ValueError and leaves the engine untouched."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self.prompts.process(prompt)
        self.prompts.check_stop_token_ids(params.stop_token_ids)
        if params.guided_decoding is not None:
            self.structured.check(params.guided_decoding)    # compiles: a bad spec fails here
        extra = [t for t in self.prompts.extra_stop_token_ids if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            params = params.clone(stop_token_ids=params.stop_token_ids + extra)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.vllm_config.model_config.max_model_len
                                  - len(token_ids))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        taken = [i for i in ids + [request_id] if i in self.scheduler.requests
                 or i in self._parents or i in self._child_to_parent]
        if taken:
            raise ValueError(f"request_id={request_id!r} is invalid: id {taken[0]!r} is in use")
        if params.n == 1:
            self._enqueue(request_id, text, token_ids, params, arrival)
            return
        self._parents[request_id] = _Parent(ids)
        for i, child_id in enumerate(ids):
            self._child_to_parent[child_id] = request_id
            self._enqueue(child_id, text, token_ids,
                          params.clone(n=1, seed=params.child_seed(i)), arrival)

    def _enqueue(self, request_id, text, token_ids, params, arrival) -> None:
        req = Request(request_id, text, list(token_ids), params, arrival_time=arrival,
                      eos_token_id=self.prompts.eos_token_id)
        self.scheduler.add_request(req)
        if params.guided_decoding is not None:
            self.structured.add(request_id, params.guided_decoding)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        expanded = []
        for rid in ids:
            parent = self._parents.pop(rid, None)
            children = parent.child_ids if parent else [rid]
            for c in children:
                if self._child_to_parent.pop(c, None) is not None:
                    self._dropped_children.add(c)
            expanded.extend(children)
        for req in self.scheduler.abort_requests(expanded):
            self.output_processor.abort(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output (cumulative text) for every request that made
        progress or finished in it. With async scheduling the step applied may be the one the
        last call launched ahead, and the step after it is launched before its tokens are read
        (``Scheduler.schedule_ahead``), so the host's work here overlaps the device's."""
        sched_out, pending = self._launch_next()
        try:
            ahead = self.scheduler.schedule_ahead(sched_out)
            if ahead is not None:
                self.structured.drop(ahead.finished_req_ids)
                # Masks only for rows it admitted: a guided row never decodes ahead.
                self._ahead = (ahead, self.runner.launch(ahead, self._masks(ahead), pending))
            runner_out = pending.result()
        except BaseException:
            self._ahead = None
            self.scheduler.drop_ahead()
            self.scheduler.update_from_output(SchedulerOutput([]), RunnerOutput({}))
            raise
        sampling = [seq for seq in sched_out.sequences if seq.do_sample]
        touched = self.scheduler.update_from_output(sched_out, runner_out)
        for seq in sampling:
            if self.structured.has(seq.req_id) and seq.req_id in runner_out.sampled:
                self.structured.accept(seq.req_id, runner_out.sampled[seq.req_id].token_id)
        outputs = []
        for req in touched:
            result = self.output_processor.process(req)
            if result.finish_status is not None:
                self.scheduler.finish_request(req.request_id, result.finish_status,
                                              result.stop_reason)
            final_only = req.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY
            if final_only and not result.finished:
                continue  # nothing to report yet: skip building the cumulative output
            out = self._fan_in(make_request_output(req, result))
            if out is not None and (out.finished or not final_only):
                outputs.append(out)
        self._dropped_children.clear()
        self.moe_stats.maybe_log()
        return outputs

    def _launch_next(self) -> tuple[SchedulerOutput, PendingStep]:
        """The step to apply now: the one the last call launched ahead, else a new one."""
        if self._ahead is not None:
            launched, self._ahead = self._ahead, None
            return launched
        sched_out = self.scheduler.schedule()
        self.structured.drop(sched_out.finished_req_ids)
        try:
            return sched_out, self.runner.launch(sched_out, self._masks(sched_out))
        except BaseException:
            # Leave the scheduler consistent (nothing computed) so the engine stays usable; the
            # caller decides which requests to fail or abort.
            self.scheduler.update_from_output(SchedulerOutput([]), RunnerOutput({}))
            raise

    def _masks(self, sched_out: SchedulerOutput) -> TokenMasks | None:
        """Guided decoding's token masks for the step's sampled rows, in the runner's order."""
        return self.structured.masks([seq for seq in sched_out.sequences if seq.do_sample])

    def _fan_in(self, out: RequestOutput) -> RequestOutput | None:
        parent_id = self._child_to_parent.get(out.request_id)
        if parent_id is None:
            # A child of an already failed/aborted parent reports nothing of its own.
            return None if out.request_id in self._dropped_children else out
        parent = self._parents[parent_id]
        index = parent.child_ids.index(out.request_id)
        if out.error is not None:
            # One child failing means the whole request failed (they share the prompt).
            self.abort_request(parent_id)
            return RequestOutput(parent_id, out.prompt, out.prompt_token_ids, [], True,
                                 error=out.error)
        completion = out.outputs[0]
        completion.index = index
        parent.latest[out.request_id] = completion
        if out.finished:
            parent.finished.add(out.request_id)
            self._child_to_parent.pop(out.request_id, None)
        done = len(parent.finished) == len(parent.child_ids)
        if done:
            del self._parents[parent_id]
        completions = [parent.latest[c] for c in parent.child_ids if c in parent.latest]
        return RequestOutput(parent_id, out.prompt, out.prompt_token_ids, completions, done,
                             prompt_logprobs=out.prompt_logprobs)

    # ---- introspection ---------------------------------------------------------------------
    def get_moe_cache_stats(self) -> dict | None:
        return self.moe_stats.stats()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.moe_stats.close()
        self.runner.save_routing_trace()
