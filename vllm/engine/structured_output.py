"""Guided decoding: per-request grammar matchers (xgrammar) and the token masks they allow.

The engine owns this manager (the scheduler stays tensor-free; the runner never changes request
state): ``add`` compiles a request's ``GuidedDecodingParams`` (compiled grammars are cached by
spec) when it is added; before each step ``masks`` asks every guided sequence that samples
this step for its allowed tokens, as one packed bitmask handed to the runner's sampler; after
the step ``accept`` advances each matcher by its sampled token. Finished and aborted requests
are dropped when the scheduler reports them. Logprobs stay raw (before masking), as vLLM's.
"""
from __future__ import annotations

import json
from typing import Any

from vllm.core.sched_output import ScheduledSequence
from vllm.sampling_params import GuidedDecodingParams
from vllm.worker.sampler import TokenMasks


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("guided decoding needs the package 'xgrammar', which is not installed "
                         f"({e}): pip install xgrammar") from None
    return xgrammar


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler = None
        self._compiled: dict[tuple, Any] = {}
        self._matchers: dict[str, Any] = {}

    def _compile(self, spec: GuidedDecodingParams):
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info)
        c, ws = self._compiler, not spec.whitespace_free
        kind = spec.kind
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return c.compile_json_schema(schema, any_whitespace=ws)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            alts = " | ".join(json.dumps(ch) for ch in spec.choice)   # GBNF string literals
            return c.compile_grammar(f"root ::= {alts}")
        return c.compile_grammar(spec.grammar)

    def check(self, spec: GuidedDecodingParams):
        """The spec's compiled grammar (cached); ValueError naming the problem for a spec
        xgrammar rejects, or when xgrammar is missing."""
        key = (spec.kind, json.dumps(spec.json, sort_keys=True) if isinstance(spec.json, dict)
               else spec.json, spec.regex, spec.choice, spec.grammar, spec.whitespace_free)
        if key not in self._compiled:
            try:
                self._compiled[key] = self._compile(spec)
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 - xgrammar's parse errors name the problem
                raise ValueError(f"guided_decoding {spec.kind} is invalid: {e}") from None
        return self._compiled[key]

    def add(self, request_id: str, spec: GuidedDecodingParams) -> None:
        """Start the request's matcher (``check`` first: this compiles on a cache miss)."""
        self._matchers[request_id] = _xgrammar().GrammarMatcher(self.check(spec))

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def masks(self, sampled: list[ScheduledSequence]) -> TokenMasks | None:
        """Allowed tokens of this step's guided sequences (``sampled``: the sequences that
        sample, in the runner's order)."""
        if not self._matchers:
            return None
        rows = [i for i, s in enumerate(sampled) if s.req_id in self._matchers]
        if not rows:
            return None
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)      # [m, ceil(V/32)]
        for j, i in enumerate(rows):
            self._matchers[sampled[i].req_id].fill_next_token_bitmask(bitmask, j)
        return TokenMasks(rows=rows, bitmask=bitmask)

    def accept(self, request_id: str, token_id: int) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.is_terminated():
            if not matcher.accept_token(token_id):
                raise RuntimeError(f"request {request_id}: sampled token {token_id} is outside "
                                   "its grammar (the mask was not applied)")
