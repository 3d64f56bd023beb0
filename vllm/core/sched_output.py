"""The typed contract between the scheduler and the model runner.

The scheduler produces a ``SchedulerOutput`` (plain Python data, no tensors); the runner
turns it into tensors, runs the model, samples, and returns a ``RunnerOutput``. The runner
never changes request state: the scheduler applies ``RunnerOutput`` in ``update_from_output``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams


@dataclass
class ScheduledSequence:
    """One request's share of a step: a contiguous chunk of its tokens."""

    req_id: str
    token_ids: list[int]
    """Tokens fed this step: a prompt chunk (possibly including recomputed outputs after
    preemption) or the single last sampled token for a decode."""
    start_pos: int
    """Position of ``token_ids[0]``; equals the request's computed-token count."""
    block_ids: list[int]
    """The request's whole block table (covers start_pos + len(token_ids) tokens)."""
    do_sample: bool
    """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    """Read-only views used by penalties (runner must not mutate)."""
    output_token_ids: list[int]
    state_slot: int | None = None
    """The request's recurrent-state slot (models with recurrent layers), else None. The
    runner reads the slot's state only when start_pos > 0."""
    pending_token: bool = False
    """A decode scheduled ahead (``Scheduler.schedule_ahead``): its input token is the one this
    request samples in the step in flight, not yet on the host; ``token_ids`` holds a
    placeholder and the runner takes the token from that step's output on the device."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    """Scheduled requests, decodes first, then prefill chunks; tokens are flattened in this order."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that finished or were aborted since the last step: the runner drops their state."""
    num_preempted: int = 0

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    """Log-probability of the sampled token (only when logprobs were requested)."""
    top_logprobs: list[tuple[int, float]] | None = None
    """The top-k (token id, logprob) pairs, best first (only when logprobs were requested)."""
    rank: int | None = None
    """1-based rank of the sampled token among all tokens by logprob (when logprobs requested)."""


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken]
    """req_id -> the token sampled this step, for every sequence with ``do_sample``."""
    prompt_logprobs: dict[str, list[tuple[int, SampledToken]]] = field(default_factory=dict)
    """req_id -> (prompt index i >= 1, the logprob of prompt token i given tokens < i) for the
    prompt positions this step computed, for requests with ``prompt_logprobs`` set (the
    SampledToken's token_id is the prompt token)."""
