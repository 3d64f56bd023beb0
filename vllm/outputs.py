"""Request outputs, as vLLM returns them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length", or "abort"; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended generation, if any."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams(prompt_logprobs=k)``: one entry per prompt token, None for the
    first, else {token id: Logprob} for the prompt token (its rank among all tokens) and the k
    most likely tokens at that position."""
    error: str | None = None
    """Set when the request failed (e.g. prompt too long); outputs are then empty."""
    metrics: dict = field(default_factory=dict)
