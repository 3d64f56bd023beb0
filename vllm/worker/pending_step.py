"""A launched step (``ModelRunner.launch``): its sampled tokens on the device, on their way to
the host, and what the next step scheduled ahead reads from it.

The engine reads ``result()`` once the step after it is launched (async scheduling): the copy of
the tokens to the host and the host's work on the step's outputs then overlap the device's
work on the next step. A decode scheduled ahead (``ScheduledSequence.pending_token``) takes its
input token from ``token_ids`` on the device (``tokens_for``), never from the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm.core.sched_output import RunnerOutput, SampledToken
from vllm.platforms import platform_for
from vllm.worker.sampler import to_sampled_tokens


@dataclass
class PendingStep:
    req_ids: list[str]
    """The sampled rows' requests, in row order."""
    token_ids: torch.Tensor | None
    """[n] int64 on the runner's device (None: nothing sampled)."""
    raw_logprobs: torch.Tensor | None = None
    """[n, V] f32 when a row asks for logprobs (read on the host by ``result``)."""
    num_logprobs: list[int | None] = field(default_factory=list)
    prompt_logprobs: dict[str, list[tuple[int, SampledToken]]] = field(default_factory=dict)
    host_tokens: Callable[[], torch.Tensor] | None = None
    """Waits for the copy of ``token_ids`` to the host (``Platform.download``) and returns it."""
    on_error: Callable[[], None] | None = None
    """Called when reading the result raises (the runner drops what its caches trust)."""
    _output: RunnerOutput | None = None

    @classmethod
    def done(cls, output: RunnerOutput) -> "PendingStep":
        """A step whose output is already on the host (nothing sampled on the device)."""
        return cls(req_ids=[], token_ids=None, _output=output)

    def result(self) -> RunnerOutput:
        """The step's tokens on the host (waits for the device; once)."""
        if self._output is None:
            try:
                self._output = RunnerOutput(sampled=dict(zip(self.req_ids, self._sampled())),
                                            prompt_logprobs=self.prompt_logprobs)
            except BaseException:
                if self.on_error is not None:
                    self.on_error()
                raise
        return self._output

    def _sampled(self) -> list[SampledToken]:
        # The host copy where one was started (the runner starts one unless logprobs are read).
        tokens = self.token_ids if self.host_tokens is None else self.host_tokens()
        return to_sampled_tokens(tokens, self.raw_logprobs, self.num_logprobs)

    def tokens_for(self, req_ids: list[str]) -> torch.Tensor:
        """[len(req_ids)] int64 on the device: the token each request sampled in this step."""
        if self.token_ids is None:
            raise RuntimeError("a decode scheduled ahead follows a step that sampled nothing")
        if req_ids == self.req_ids:
            return self.token_ids
        row = {r: i for i, r in enumerate(self.req_ids)}
        missing = [r for r in req_ids if r not in row]
        if missing:
            raise RuntimeError(f"requests {missing} were scheduled ahead of a step that did not "
                               f"sample them (it sampled {self.req_ids})")
        index = torch.tensor([row[r] for r in req_ids], dtype=torch.int64)
        dev = self.token_ids.device
        return self.token_ids.index_select(0, platform_for(dev).upload(index, dev))
