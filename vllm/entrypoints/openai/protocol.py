"""OpenAI API request/response models (pydantic) and the OpenAI error shape.

Request models type-check fields (a wrong type becomes a 400 naming the field); value ranges
are checked by ``SamplingParams``, whose ValueError names the field. Unknown request fields
are ignored, as OpenAI does, except the known ones this server does not implement
(``UNSUPPORTED_FIELDS``: tools and function calling): those get a 400 naming the field rather
than being ignored. Output constraints (``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) become ``GuidedDecodingParams``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm.sampling_params import GuidedDecodingParams, SamplingParams


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type
        self.param = param

    def to_dict(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.status_code)


def error_body(message: str, err_type: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _off(value) -> bool:
    return value is None


UNSUPPORTED_FIELDS: dict[str, Any] = {
    # field -> which values mean "not used" (accepted; anything else is refused)
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "guided_decoding_backend": lambda v: v in (None, "xgrammar", "auto"),
    "guided_whitespace_pattern": _off,
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Guided decoding (vLLM's fields, OpenAI's response_format): at most one of them.
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def _sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        for name, value in (self.model_extra or {}).items():
            accepts = UNSUPPORTED_FIELDS.get(name)
            if accepts is not None and not accepts(value):
                raise OpenAIError(f"{name} is not supported by this server (it is refused rather "
                                  f"than ignored); remove it from the request", param=name)
        if self.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true",
                              param="stream_options")
        kw: dict[str, Any] = dict(
            guided_decoding=self._guided_decoding(),
            n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return kw

    def _guided_decoding(self) -> GuidedDecodingParams | None:
        """The request's output constraint: response_format, a guided_* field or vLLM's
        structured_outputs dict (at most one); a 400 naming a bad one."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            if rf.get("type") == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif rf.get("type") == "json_schema":
                schema = (rf.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise OpenAIError("response_format json_schema needs json_schema.schema (an "
                                      "object)", param="response_format")
                given.append(("response_format", {"json": schema}))
            else:
                raise OpenAIError(f"response_format type {rf.get('type')!r} is invalid: must be "
                                  "'text', 'json_object' or 'json_schema'",
                                  param="response_format")
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if self.structured_outputs:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        if not given:
            return None
        if len(given) > 1:
            raise OpenAIError(f"give at most one output constraint, got {[n for n, _ in given]}",
                              param=given[1][0])
        name, spec = given[0]
        try:
            return GuidedDecodingParams(**spec)
        except (TypeError, ValueError) as e:
            raise OpenAIError(f"{name} is invalid: {e}", param=name) from None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    include_usage: bool = False


def make_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    """SamplingParams(**kwargs); its ValueError ("name=value is invalid: ...") becomes a 400
    naming the field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param=param_of(str(e))) from None


def param_of(message: str) -> str | None:
    """The field a ValueError message names: "top_k=-5 is invalid" -> "top_k",
    "prompt[1]: ..." -> "prompt"."""
    head = message.split("=", 1)[0].split(":", 1)[0].split("[", 1)[0].split(" ", 1)[0]
    return head if head.isidentifier() else None


# ---- /v1/completions ------------------------------------------------------------------------
class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    """vLLM's extra: each choice's ``prompt_logprobs`` (as ``RequestOutput.prompt_logprobs``)."""
    best_of: int | None = None
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt (and its logprobs) and nothing generated, as
        lm-evaluation-harness asks for loglikelihoods. One token is generated and dropped."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(f"best_of={self.best_of} is not supported: it must equal n",
                              param="best_of")
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        kw = self._sampling_kwargs(default_max_tokens=16)
        if self.echo_only:
            kw["max_tokens"] = 1
        kw["logprobs"] = self.logprobs
        # echo with logprobs reports the prompt's tokens too (OpenAI's layout: None first).
        kw["prompt_logprobs"] = self.prompt_logprobs if self.prompt_logprobs is not None else (
            self.logprobs if self.echo else None)
        return make_sampling_params(kw)

    def prompt_list(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt is empty: give a string, a list of strings, token ids or "
                              "a list of token-id lists", param="prompt")
        if all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def prompt_logprobs_body(plp: list | None) -> list[dict[int, PromptLogprob] | None] | None:
    """``RequestOutput.prompt_logprobs`` as vLLM's responses carry it."""
    if plp is None:
        return None
    return [None if e is None else {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                     decoded_token=lp.decoded_token)
                                    for t, lp in e.items()} for e in plp]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions -------------------------------------------------------------------
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """{"role", "content": str}; text parts of a content list are joined."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(f"messages content part {i} has type "
                                      f"{part.get('type')!r}: only 'text' parts are supported",
                                      param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extra: more template variables (GPT-OSS: reasoning_effort, model_identity)."""
    prompt_logprobs: int | None = None
    """vLLM's extra: the response's ``prompt_logprobs`` (of the rendered prompt)."""

    def to_sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise OpenAIError("messages is empty: at least one message is required",
                              param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise OpenAIError(f"top_logprobs={self.top_logprobs} is invalid: must be an integer "
                              "in [0, 20]", param="top_logprobs")
        kw = self._sampling_kwargs(default_max_tokens=None)
        if self.max_completion_tokens is not None:
            kw["max_tokens"] = self.max_completion_tokens
        kw["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        kw["prompt_logprobs"] = self.prompt_logprobs
        return make_sampling_params(kw)


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------
class TokenizeRequest(BaseModel):
    """A completion prompt (``prompt``) or chat ``messages``, as vLLM's /tokenize takes them."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the template places them)."""
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- /v1/models -----------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
