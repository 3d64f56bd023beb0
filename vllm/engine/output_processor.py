"""Incremental detokenization, stop checking and RequestOutput construction.

This is the one place that decides when a request stops (the scheduler only finishes
requests that can never fit, and aborted ones). Checks run after every new token, in this
order: (1) min_tokens not reached -> only length checks apply; (2) EOS (unless ignore_eos)
or a stop_token_id -> "stop"; (3) a stop string in the new text -> "stop", text truncated
before it (after it with include_stop_str_in_output); (4) max_tokens or max_model_len ->
"length". Stop tokens are kept in token_ids; their text is dropped unless
include_stop_str_in_output (as vLLM does).

Engine loop::

    for req in scheduler.update_from_output(sched_out, runner_out):
        res = output_processor.process(req)
        if res.finish_status is not None:
            scheduler.finish_request(req.request_id, res.finish_status, res.stop_reason)
        outputs.append(make_request_output(req, res))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.core.request import Request, RequestStatus
from vllm.outputs import CompletionOutput, RequestOutput

_PREFIX_WINDOW = 6  # prompt tokens kept as decoding context by the fallback detokenizer


def _fast_backend(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer``, or None for slow tokenizers."""
    from tokenizers import Tokenizer
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Turns output token ids into text one step at a time.

    Fast tokenizers use ``tokenizers.decoders.DecodeStream`` (seeded with the prompt so the
    first output token decodes in context); others use the prefix-offset method: decode a
    short window before and after the new tokens and emit the difference once it does not
    end in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_text = ""
        self._backend = _fast_backend(tokenizer)
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream
            self._stream = DecodeStream(ids=list(prompt_token_ids),
                                        skip_special_tokens=skip_special_tokens)
        else:
            self._ids = list(prompt_token_ids[-_PREFIX_WINDOW:])
            self._prefix_offset = 0
            self._read_offset = len(self._ids)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Decode ``token_ids`` (the next output tokens); returns the new text (may be "")."""
        new = []
        for tid in token_ids:
            chunk = (self._stream.step(self._backend, tid) if self._backend is not None
                     else self._fallback_step(tid))
            if chunk:
                new.append(chunk)
        delta = "".join(new)
        self.output_text += delta
        return delta

    def _fallback_step(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # incomplete character (or nothing visible yet): wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]


@dataclass
class ProcessedOutput:
    """What one ``OutputProcessor.process`` call found for one request."""

    request_id: str
    text: str
    """Output text so far (while running, a tail that may start a stop string is held back)."""
    delta_text: str
    """Text made visible since the previous call (for streaming)."""
    new_token_ids: list[int]
    num_output_tokens: int
    """Output tokens that belong to the completion (tokens past a stop are excluded)."""
    finished: bool
    finish_reason: str | None = None
    """"stop", "length", "abort", or None (running, or failed with an error)."""
    stop_reason: int | str | None = None
    finish_status: RequestStatus | None = None
    """Set when this call decided the request stops: pass it to ``Scheduler.finish_request``."""
    error: str | None = None


@dataclass
class _State:
    detok: IncrementalDetokenizer | None
    text: str = ""  # full detokenized output (truncated at a stop string)
    num_processed: int = 0  # output tokens already detokenized and checked
    num_sent_chars: int = 0  # chars of text already reported (streaming)
    max_stop_len: int = 0
    decided: tuple | None = field(default=None)  # (status, stop_reason) once stopped
    prompt_decoded: bool = False  # prompt logprob entries have their decoded_token


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, max_model_len: int | None = None):
        """``tokenizer``: a Hugging Face or ``tokenizers.Tokenizer`` (None: no text)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._states: dict[str, _State] = {}

    def _state(self, req: Request) -> _State:
        st = self._states.get(req.request_id)
        if st is None:
            sp = req.sampling_params
            if self.tokenizer is None and sp.stop:
                raise ValueError(f"request {req.request_id}: stop={sp.stop!r} needs a tokenizer")
            detok = (None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, sp.skip_special_tokens))
            st = _State(detok, max_stop_len=max((len(s) for s in sp.stop), default=0))
            self._states[req.request_id] = st
        return st

    def process(self, req: Request) -> ProcessedOutput:
        """Detokenize and stop-check the request's output tokens not seen before.

        Call once per step for each request returned by ``update_from_output``, and once for
        each request returned by ``abort_requests`` (or call ``abort``). State is dropped
        when a result with ``finished=True`` is returned; do not process that request again.
        """
        st = self._state(req)
        new_ids = req.output_token_ids[st.num_processed:]
        if req.status.is_finished and st.decided is None:
            # Finished by the scheduler (abort, capacity): decode what is left, no stop checks.
            if st.detok is not None:
                st.text += st.detok.add_tokens(new_ids)
            st.num_processed += len(new_ids)
        else:
            for i, tid in enumerate(new_ids):
                st.num_processed += 1
                st.decided = self._check_token(req, st, tid)
                if st.decided is not None:
                    new_ids = new_ids[:i + 1]  # tokens past a stop are not reported
                    break
        self._decode_logprobs(req, st.num_processed - len(new_ids), st.num_processed)
        if req.prompt_logprobs is not None and not st.prompt_decoded and req.output_token_ids:
            # Complete once a token was sampled: the whole prompt has been computed.
            self._decode_entries(req.prompt_logprobs[1:])
            st.prompt_decoded = True
        return self._result(req, st, new_ids)

    def _decode_logprobs(self, req: Request, start: int, end: int) -> None:
        """Fill ``decoded_token`` of the logprob entries of output positions [start, end)."""
        if req.sampling_params.logprobs is not None:
            self._decode_entries(req.output_logprobs[start:end])

    def _decode_entries(self, positions: list) -> None:
        if self.tokenizer is None:
            return
        for entries in positions:
            for tid, lp in (entries or {}).items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([tid])

    def _check_token(self, req: Request, st: _State, tid: int) -> tuple | None:
        """Append one output token; return (status, stop_reason) if the request stops here."""
        sp = req.sampling_params
        n_out = st.num_processed
        checks_on = n_out >= sp.min_tokens
        stop_token = checks_on and ((tid == req.eos_token_id and not sp.ignore_eos)
                                    or tid in sp.stop_token_ids)
        if st.detok is not None and (not stop_token or sp.include_stop_str_in_output):
            prev_len = len(st.text)
            st.text += st.detok.add_tokens([tid])
            if checks_on and not stop_token and sp.stop:
                hit = self._find_stop(st, sp, prev_len)
                if hit is not None:
                    return hit
        if stop_token:
            # EOS reports stop_reason None, as vLLM does; a stop_token_id reports the id.
            return RequestStatus.FINISHED_STOPPED, (None if tid == req.eos_token_id
                                                    and tid not in sp.stop_token_ids else tid)
        if req.at_length_limit(n_out, self.max_model_len):
            return RequestStatus.FINISHED_LENGTH, None
        return None

    @staticmethod
    def _find_stop(st: _State, sp, prev_len: int) -> tuple | None:
        """Earliest stop string ending in the new text; truncates ``st.text`` at it."""
        best: tuple[int, str] | None = None
        for stop in sp.stop:
            # A match ending inside the new text may start up to len(stop)-1 chars earlier.
            idx = st.text.find(stop, max(0, prev_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        st.text = st.text[:idx + len(stop) if sp.include_stop_str_in_output else idx]
        return RequestStatus.FINISHED_STOPPED, stop

    def _result(self, req: Request, st: _State, new_ids: list[int]) -> ProcessedOutput:
        finish_status, stop_reason = st.decided or (None, None)
        finished = finish_status is not None or req.status.is_finished
        if finish_status is None and req.status.is_finished:
            stop_reason = req.stop_reason
        if finished:
            visible = st.text
            self._states.pop(req.request_id, None)
        else:
            # Hold back a tail that might be the start of a stop string (vLLM does the same).
            hold = st.max_stop_len - 1 if st.max_stop_len and not req.sampling_params.\
                include_stop_str_in_output else 0
            visible = st.text[:max(st.num_sent_chars, len(st.text) - hold)]
        delta = visible[st.num_sent_chars:]
        st.num_sent_chars = len(visible)
        status = finish_status or req.status
        return ProcessedOutput(
            request_id=req.request_id, text=visible, delta_text=delta, new_token_ids=new_ids,
            num_output_tokens=st.num_processed, finished=finished, finish_reason=status.finish_reason if finished else None,
            stop_reason=stop_reason, finish_status=finish_status,
            error=req.error if req.status is RequestStatus.FINISHED_ERROR else None)

    def abort(self, request_id: str) -> None:
        """Drop a request's state without reporting (e.g. aborted before any output)."""
        self._states.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._states)


def make_request_output(req: Request, result: ProcessedOutput, delta: bool = False,
                        index: int = 0) -> RequestOutput:
    """A vLLM RequestOutput for ``req`` after ``process``; ``delta`` gives only the new text,
    tokens and logprobs (streaming). A failed request gets ``error`` and no outputs."""
    if req.status is RequestStatus.FINISHED_ERROR:
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs=[],
                             finished=True, error=result.error or req.error)
    n_kept = result.num_output_tokens
    token_ids = req.output_token_ids[:n_kept]
    logprobs = req.output_logprobs[:n_kept] if req.sampling_params.logprobs is not None else None
    if delta:
        n_new = len(result.new_token_ids)
        token_ids = token_ids[len(token_ids) - n_new:]
        logprobs = logprobs[len(logprobs) - n_new:] if logprobs is not None else None
    completion = CompletionOutput(
        index=index, text=result.delta_text if delta else result.text, token_ids=list(token_ids),
        cumulative_logprob=req.cumulative_logprob, logprobs=logprobs,
        finish_reason=result.finish_reason, stop_reason=result.stop_reason)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                         finished=result.finished,
                         prompt_logprobs=req.prompt_logprobs if req.output_token_ids else None)

