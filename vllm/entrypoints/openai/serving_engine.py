"""What the completion and chat handlers share: the server's request limits, model-name check,
tokenizing a request's prompts (in the tokenizer worker) and adding them to the engine (all or
none), merging their output streams, SSE framing and error mapping."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator

from vllm.engine.async_llm import (AsyncLLM, EngineDead, InternalRequestError, RequestFailed,
                                   RequestStream)
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.entrypoints.openai.protocol import OpenAIError, error_body, param_of
from vllm.entrypoints.openai.tokenizer_pool import TokenizerPool
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass(frozen=True)
class FrontendOptions:
    """What the server allows a request (``vllm serve`` flags)."""
    max_n: int = 128
    """Largest n (and best_of) a request may ask for (--max-n)."""
    trust_request_chat_template: bool = False
    """Whether a request may bring its own chat_template (--trust-request-chat-template): a
    template is code, rendered by the server (in a child process, template_sandbox.py)."""
    chat_template_timeout: float = 5.0
    """Seconds a request's template may take to render before it is stopped (a 400)."""

    def __post_init__(self):
        if self.max_n < 1:
            raise ValueError(f"max_n={self.max_n} is invalid: must be >= 1")
        if not self.chat_template_timeout > 0:
            raise ValueError(f"chat_template_timeout={self.chat_template_timeout} is invalid: "
                             "must be > 0")


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics,
                 tokenizers: TokenizerPool, options: FrontendOptions):
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.options = options

    def check_model(self, name: str | None) -> str:
        """The model name to report; 400 for a name this server does not serve."""
        if name is None or name in self.served_model_names:
            return name or self.served_model_names[0]
        raise OpenAIError(f"model={name!r} does not exist: this server serves "
                          f"{self.served_model_names}", param="model")

    async def add_prompts(self, base_id: str, prompts: list,
                          params: SamplingParams) -> list[RequestStream]:
        """Tokenize (in the tokenizer worker) and add one engine request per prompt (ids
        ``{base_id}-{i}``); a bad prompt aborts the ones already added and becomes a 400 naming
        it. Prompts may be text, token ids or already-tokenized prompt dicts."""
        if params.n > self.options.max_n:
            raise OpenAIError(f"n={params.n} is invalid: this server allows at most "
                              f"{self.options.max_n} completions per prompt (--max-n)", param="n")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                index = i if len(prompts) > 1 else None
                try:
                    tokenized = await self.tokenizers.process(prompt, index)
                    streams.append(await self.engine.add_request(f"{base_id}-{i}", tokenized,
                                                                 params))
                except ValueError as e:
                    msg = str(e)
                    if index is not None and msg.startswith("prompt "):
                        msg = f"prompt[{i}]" + msg[len("prompt"):]
                    raise OpenAIError(msg, param=param_of(msg)) from None
        except BaseException:
            for s in streams:
                s.abort()  # never started from the client's view: not counted as aborted
            raise
        return streams

    async def render_chat(self, messages: list[dict], template: str | None,
                          add_generation_prompt: bool,
                          template_kwargs: dict | None = None) -> dict:
        """Messages rendered (a request's own template only if the server trusts them) and
        tokenized: {"prompt", "prompt_token_ids"}; a 400 naming what is wrong."""
        if template is not None and not self.options.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is refused: a template is code the "
                              "server would run; this server renders its model's template only "
                              "(start it with --trust-request-chat-template to allow them)",
                              param="chat_template")
        try:
            return await self.tokenizers.render_chat(messages, template, add_generation_prompt,
                                                     template_kwargs)
        except ValueError as e:
            msg = str(e)
            param = next((p for p in ("chat_template_kwargs", "chat_template")
                          if msg.startswith(p)), "messages")
            raise OpenAIError(msg, param=param) from None
        except Exception as e:  # noqa: BLE001 - jinja errors: a bad template or message
            raise OpenAIError(f"messages could not be rendered with the chat template: "
                              f"{type(e).__name__}: {e}", param="messages") from None

    def record(self, out: RequestOutput) -> None:
        self.metrics.count_finished(len(out.prompt_token_ids), out.outputs)


async def merge_streams(streams: list[RequestStream], metrics: ServerMetrics | None = None
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from all streams as they arrive. Leaving early (an
    exception, a disconnect) aborts every stream that has not finished."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    q.put_nowait((i, out, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((i, None, e))
            q.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(streams)
            while live:
                i, out, exc = await q.get()
                if exc is not None:
                    raise exc
                if out is None:
                    live -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            if s.abort() and metrics is not None:
                metrics.request_aborted.inc()


async def collect_final(streams: list[RequestStream],
                        metrics: ServerMetrics | None = None) -> list[RequestOutput]:
    """The final output of every stream, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams, metrics):
        if out.finished:
            finals[i] = out
    return finals  # type: ignore[return-value]


def failure_to_error(exc: BaseException, request_id: str) -> OpenAIError:
    """An exception raised while a request ran -> the error the client sees (no internals)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDead):
        return OpenAIError(str(exc), status_code=503, err_type="ServiceUnavailableError")
    if isinstance(exc, RequestFailed) and not isinstance(exc, InternalRequestError):
        return OpenAIError(str(exc), param=param_of(str(exc)))
    if not isinstance(exc, InternalRequestError):
        logger.error("request %s failed", request_id, exc_info=exc)
    return OpenAIError(f"internal server error in request {request_id}; see the server log",
                       status_code=500, err_type="InternalServerError")


def sse(payload) -> str:
    """One Server-Sent Event with a JSON body (a pydantic model or a dict)."""
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


def sse_error(exc: BaseException, request_id: str) -> str:
    err = failure_to_error(exc, request_id)
    return sse(error_body(err.message, err.err_type, err.param, err.status_code))


SSE_DONE = "data: [DONE]\n\n"
