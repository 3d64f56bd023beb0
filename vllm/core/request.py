"""Per-request state shared by the scheduler, block manager and output processor.

Only the scheduler changes a request's state (tokens, computed count, blocks, status); the
output processor decides *whether* a request stops and the engine tells the scheduler via
``Scheduler.finish_request``. The model runner only reads ``ScheduledSequence`` copies.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from vllm.outputs import Logprob
from vllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def at_length_limit(self, n_out: int, max_model_len: int | None) -> bool:
        """Whether ``n_out`` output tokens finish this request by length: ``max_tokens``, or
        prompt plus outputs reaching ``max_model_len`` (the output processor's check, which the
        scheduler also makes ahead of the tokens)."""
        max_tokens = self.sampling_params.max_tokens
        return (max_tokens is not None and n_out >= max_tokens) or (
            max_model_len is not None and self.num_prompt_tokens + n_out >= max_model_len)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason string for a finished status; None otherwise (and for errors)."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})
_FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (invariant: <= num_tokens; reset to 0 on preemption)."""
    block_ids: list[int] = field(default_factory=list)
    """Block table: block i holds the KV of tokens [i*block_size, (i+1)*block_size)."""
    state_slot: int | None = None
    """Recurrent-state slot while running (models with recurrent layers only; None otherwise,
    and while waiting or preempted): ``core/state_slots.py``."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if any."""
    error: str | None = None
    """Why the request failed (status FINISHED_ERROR)."""
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    """One dict per output token, filled only when sampling_params.logprobs is set."""
    cumulative_logprob: float | None = None
    """Sum of the sampled tokens' logprobs (only when logprobs were requested)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """[num_prompt_tokens] when sampling_params.prompt_logprobs is set: entry i is prompt token
    i's logprob given the tokens before it (plus the top-k), filled chunk by chunk; entry 0
    stays None (nothing precedes the first token)."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id={self.request_id!r} is invalid: must be a non-empty str")
        ids = self.prompt_token_ids
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids={ids!r} is invalid: "
                             "must be a non-empty list of token ids")
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(f"request {self.request_id}: sampling_params must be a SamplingParams, "
                             f"got {type(self.sampling_params).__name__}")
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without copying the whole sequence."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    def at_length_limit(self, n_out: int, max_model_len: int | None) -> bool:
        """Whether ``n_out`` output tokens finish this request by length: ``max_tokens``, or
        prompt plus outputs reaching ``max_model_len`` (the output processor's check, which the
        scheduler also makes ahead of the tokens)."""
        max_tokens = self.sampling_params.max_tokens
        return (max_tokens is not None and n_out >= max_tokens) or (
            max_model_len is not None and self.num_prompt_tokens + n_out >= max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
