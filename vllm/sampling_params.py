"""SamplingParams: vLLM's names and semantics; every invalid value raises ValueError naming it."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import IntEnum

_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(IntEnum):
    """What ``LLMEngine.step`` reports for a request (vLLM's names and values)."""
    CUMULATIVE = 0
    """Every step, the whole output so far."""
    DELTA = 1
    """Every step, only the new part (not supported here: rejected)."""
    FINAL_ONLY = 2
    """Only once, when the request finishes (``LLM.generate`` uses this)."""


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain the output to a language (vLLM's guided decoding), exactly one of: ``json`` (a
    JSON schema, dict or str), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of
    these strings) or ``grammar`` (EBNF in xgrammar's GBNF dialect). Tokens outside the
    language are masked before sampling; the output ends where the language allows nothing but
    EOS. Needs the ``xgrammar`` package."""
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_free: bool = True
    """JSON without optional whitespace (one fixed separator style), so a model cannot pad its
    output with endless spaces."""

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"guided choice={self.choice!r} is invalid: must be a non-empty "
                                 "list of non-empty strings")
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"guided decoding needs exactly one of json, json_object, regex, "
                             f"choice, grammar; got {set_ or 'none'}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n)
                    is not None) if not self.json_object else "json_object"


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions returned per prompt."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    max_tokens: int | None = 16
    """Most tokens generated; None = up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop tokens are masked until this many tokens are generated."""
    stop: str | list[str] | None = None
    """Strings that end generation; they are not included in the output text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in token_ids, not in text)."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    logprobs: int | None = None
    """Return the log-probabilities of this many top tokens (plus the sampled one) per step."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token after the first, its log-probability given the tokens
    before it, plus this many top tokens (``RequestOutput.prompt_logprobs``)."""
    guided_decoding: GuidedDecodingParams | None = None
    """Constrain the output (JSON schema, regex, choice, grammar): ``GuidedDecodingParams``."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens seen in prompt or output (HF semantics), > 0."""
    presence_penalty: float = 0.0
    """Subtracted from logits of tokens already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from logits of generated tokens, in [-2, 2]."""
    skip_special_tokens: bool = True
    """Drop special tokens when detokenizing."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """CUMULATIVE (every step) or FINAL_ONLY (only when finished); DELTA is not supported."""
    _all_stop: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._int("n", 1)
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"output_kind={self.output_kind!r} is invalid: must be "
                             "RequestOutputKind.CUMULATIVE or RequestOutputKind.FINAL_ONLY")
        self.output_kind = RequestOutputKind(self.output_kind)
        self._num("temperature", 0.0, None)
        self._num("top_p", 0.0, 1.0, low_open=True)
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1
                or self.top_k > _INT64_MAX):
            raise ValueError(f"top_k={self.top_k!r} is invalid: must be -1, 0 (disabled) or an "
                             f"integer in [1, {_INT64_MAX}]")
        if self.top_k == -1:
            self.top_k = 0
        self._num("min_p", 0.0, 1.0)
        if self.seed is not None:
            self._int("seed", _INT64_MIN, _INT64_MAX)
        if self.max_tokens is not None:
            self._int("max_tokens", 1)
        self._int("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is invalid: must be <= max_tokens="
                             f"{self.max_tokens}")
        if self.logprobs is not None:
            self._int("logprobs", 0, 20)
        if self.prompt_logprobs is not None:
            self._int("prompt_logprobs", 0, 20)
        if self.guided_decoding is not None and not isinstance(self.guided_decoding,
                                                               GuidedDecodingParams):
            raise ValueError(f"guided_decoding={self.guided_decoding!r} is invalid: must be a "
                             "GuidedDecodingParams")
        self._num("repetition_penalty", 0.0, None, low_open=True)
        self._num("presence_penalty", -2.0, 2.0)
        self._num("frequency_penalty", -2.0, 2.0)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} is invalid: must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and 0 <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is invalid: must be "
                             "non-negative integers (token ids)")
        if self.temperature < _EPS:
            # Greedy: sampling knobs have no effect; normalise them so batching is simpler.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _int(self, name: str, low: int, high: int | None = None) -> None:
        v = getattr(self, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
            rng = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"{name}={v!r} is invalid: must be an integer {rng}")

    def _num(self, name: str, low: float, high: float | None, low_open: bool = False) -> None:
        v = getattr(self, name)
        bad = not isinstance(v, (int, float)) or isinstance(v, bool) or v != v
        if not bad:
            bad = (v <= low if low_open else v < low) or (high is not None and v > high)
        if bad:
            lo = "(" if low_open else "["
            hi = f"{high}]" if high is not None else "inf)"
            raise ValueError(f"{name}={v!r} is invalid: must be a number in {lo}{low}, {hi}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def child_seed(self, index: int) -> int | None:
        """Seed of the ``index``-th completion of an n > 1 request (wraps within int64)."""
        if self.seed is None:
            return None
        return (self.seed + index - _INT64_MIN) % 2**64 + _INT64_MIN

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_")]
