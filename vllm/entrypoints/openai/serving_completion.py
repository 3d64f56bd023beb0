"""POST /v1/completions: one engine request per prompt (n > 1 fans out inside the engine);
choice index = prompt index * n + completion index, as OpenAI numbers them. ``echo`` puts the
prompt before the text and, with ``logprobs``, the prompt tokens' logprobs before the generated
ones (the first prompt token has None, as OpenAI reports it); ``echo`` with ``max_tokens=0``
returns the prompt alone (lm-evaluation-harness' loglikelihood requests)."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from vllm.engine.async_llm import RequestStream
from vllm.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                              CompletionRequest, CompletionResponse,
                                              PromptLogprob, UsageInfo, prompt_logprobs_body,
                                              random_id)
from vllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, collect_final,
                                                    merge_streams, sse, sse_error)
from vllm.outputs import CompletionOutput, RequestOutput, SampleLogprobs


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest):
        model = self.check_model(request.model)
        params = request.to_sampling_params()
        prompts = request.prompt_list()
        request_id = random_id("cmpl")
        streams = await self.add_prompts(request_id, prompts, params)
        echoes = [await self._echo_text(s) if request.echo else "" for s in streams]
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, model, streams, echoes),
                                     media_type="text/event-stream")
        finals = await collect_final(streams, self.metrics)
        choices, usage = [], UsageInfo()
        for i, out in enumerate(finals):
            self.record(out)
            usage.prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                c = _visible(request, c)
                usage.completion_tokens += len(c.token_ids)
                choices.append(CompletionChoice(
                    index=i * params.n + c.index, text=echoes[i] + c.text,
                    logprobs=await self._choice_logprobs(request, out, c, echoes[i], 0, 0),
                    prompt_logprobs=_prompt_logprobs(request, out),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda ch: ch.index)
        body = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def _echo_text(self, stream: RequestStream) -> str:
        if stream.prompt is not None:
            return stream.prompt
        return await self.tokenizers.decode(stream.prompt_token_ids)

    async def _choice_logprobs(self, request: CompletionRequest, out: RequestOutput,
                               c: CompletionOutput, echo: str, n_tok: int, n_chars: int
                               ) -> CompletionLogprobs | None:
        """Logprobs of output positions [n_tok, end) at text offset n_chars of the output,
        preceded on the first chunk (n_tok == 0) of an echo by the prompt's."""
        if request.logprobs is None:
            return None
        result = _logprobs(c.logprobs, c.token_ids, n_tok, len(echo) + n_chars)
        if request.echo and n_tok == 0 and out.prompt_logprobs is not None:
            first = await self.tokenizers.decode(out.prompt_token_ids[:1])
            result = _joined(_prompt_part(out, first), result)
        return result

    async def _stream(self, request: CompletionRequest, request_id: str, model: str,
                      streams: list[RequestStream], echoes: list[str]) -> AsyncIterator[str]:
        n = streams[0].n
        sent_text: dict[int, int] = {}     # choice index -> chars of text already sent
        sent_tokens: dict[int, int] = {}   # choice index -> tokens already sent (-1: finished)
        usage = UsageInfo()
        try:
            async for i, out in merge_streams(streams, self.metrics):
                for c in out.outputs:
                    c = _visible(request, c)
                    idx = i * n + c.index
                    chunk = await self._delta_chunk(request, out, idx, c, sent_text,
                                                    sent_tokens, echoes[i])
                    if chunk is not None:
                        yield sse(CompletionResponse(id=request_id, model=model, choices=[chunk]))
                if out.finished:
                    self.record(out)
                    usage.prompt_tokens += len(out.prompt_token_ids)
                    usage.completion_tokens += sum(len(_visible(request, c).token_ids)
                                                   for c in out.outputs)
            if request.include_usage_in_stream:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                             usage=usage))
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in the stream
            yield sse_error(e, request_id)
        yield SSE_DONE

    async def _delta_chunk(self, request: CompletionRequest, out: RequestOutput, idx: int,
                           c: CompletionOutput, sent_text: dict[int, int],
                           sent_tokens: dict[int, int], echo: str) -> CompletionChoice | None:
        if sent_tokens.get(idx) == -1:
            return None  # finished and reported (n > 1 outputs repeat finished siblings)
        first = idx not in sent_text
        n_chars, n_tok = sent_text.get(idx, 0), sent_tokens.get(idx, 0)
        delta = c.text[n_chars:]
        if first:
            delta = echo + delta
        if not delta and c.finish_reason is None and not first:
            return None  # nothing new yet (text held back, e.g. a possible stop string)
        logprobs = await self._choice_logprobs(request, out, c, echo, n_tok, n_chars)
        sent_text[idx] = len(c.text)
        sent_tokens[idx] = -1 if c.finish_reason is not None else len(c.token_ids)
        return CompletionChoice(index=idx, text=delta, logprobs=logprobs,
                                prompt_logprobs=_prompt_logprobs(request, out) if first else None,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def _visible(request: CompletionRequest, c: CompletionOutput) -> CompletionOutput:
    """The output as the client sees it: nothing generated for echo with max_tokens=0."""
    if not request.echo_only:
        return c
    return CompletionOutput(index=c.index, text="", token_ids=[], logprobs=[],
                            finish_reason=c.finish_reason and "length")


def _prompt_logprobs(request: CompletionRequest, out: RequestOutput
                     ) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` field, for requests that asked for it by that name."""
    return prompt_logprobs_body(out.prompt_logprobs) if request.prompt_logprobs is not None \
        else None


def _prompt_part(out: RequestOutput, first_token: str) -> CompletionLogprobs:
    """The prompt's tokens in OpenAI's echo layout: the first with no logprob, then each
    token's logprob given those before it and its top tokens (text offsets from 0)."""
    first = CompletionLogprobs(tokens=[first_token], token_logprobs=[None], top_logprobs=[None],
                               text_offset=[0])
    rest = _logprobs(out.prompt_logprobs[1:], out.prompt_token_ids[1:], 0, len(first_token))
    return _joined(first, rest)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """a's positions followed by b's (b's text offsets are already absolute)."""
    return CompletionLogprobs(**{name: getattr(a, name) + getattr(b, name)
                                 for name in CompletionLogprobs.model_fields})


def _logprobs(logprobs: SampleLogprobs | None, token_ids: list[int], start: int,
              offset: int) -> CompletionLogprobs:
    """OpenAI's completion logprobs for output positions [start, end); ``offset`` is the text
    offset of position ``start``."""
    result = CompletionLogprobs()
    logprobs = logprobs or []
    for tid, entries in zip(token_ids[start:], logprobs[start:]):
        sampled = entries.get(tid)
        token = (sampled.decoded_token or "") if sampled else ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob if sampled else None)
        result.top_logprobs.append({(lp.decoded_token or ""): lp.logprob
                                    for lp in entries.values()})
        result.text_offset.append(offset)
        offset += len(token)
    return result
