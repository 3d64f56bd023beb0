"""POST /v1/chat/completions: messages are rendered with the model's chat template in the
tokenizer worker (a request's own template only with --trust-request-chat-template), then
generated like one completion prompt."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from vllm.engine.async_llm import RequestStream
from vllm.entrypoints.openai.protocol import (ChatChoiceLogprobs, ChatCompletionChoice,
                                              ChatCompletionChunk, ChatCompletionRequest,
                                              ChatCompletionResponse, ChatLogprob,
                                              ChatLogprobContent, ChatResponseMessage,
                                              ChatStreamChoice, DeltaMessage, UsageInfo,
                                              prompt_logprobs_body, random_id)
from vllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, collect_final,
                                                    merge_streams, sse, sse_error)
from vllm.outputs import CompletionOutput, SampleLogprobs


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest):
        model = self.check_model(request.model)
        params = request.to_sampling_params()
        messages = [m.as_template_dict() for m in request.messages]
        prompt = await self.render_chat(messages, request.chat_template,
                                        request.add_generation_prompt,
                                        request.chat_template_kwargs)
        request_id = random_id("chatcmpl")
        streams = await self.add_prompts(request_id, [prompt], params)
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, model, streams[0]),
                                     media_type="text/event-stream")
        out = (await collect_final(streams, self.metrics))[0]
        self.record(out)
        choices = [ChatCompletionChoice(
            index=c.index, message=ChatResponseMessage(content=c.text),
            logprobs=_logprobs(c.logprobs, c.token_ids, 0, request.top_logprobs or 0)
            if request.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in out.outputs]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = UsageInfo(prompt_tokens=len(out.prompt_token_ids),
                          completion_tokens=completion_tokens,
                          total_tokens=len(out.prompt_token_ids) + completion_tokens)
        body = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                      prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs))
        return Response(body.model_dump_json(), media_type="application/json")

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                      stream: RequestStream) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices,
                                           usage=usage))
        try:
            # OpenAI opens every choice with the assistant role and empty content.
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                      content=""))
                         for i in range(stream.n)])
            final = None
            async for _, out in merge_streams([stream], self.metrics):
                for c in out.outputs:
                    choice = self._delta(request, c, sent_text, sent_tokens)
                    if choice is not None:
                        yield chunk([choice])
                if out.finished:
                    final = out
                    self.record(out)
            if request.include_usage_in_stream and final is not None:
                completion = sum(len(c.token_ids) for c in final.outputs)
                prompt = len(final.prompt_token_ids)
                yield chunk([], UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                                          total_tokens=prompt + completion))
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in the stream
            yield sse_error(e, request_id)
        yield SSE_DONE

    @staticmethod
    def _delta(request: ChatCompletionRequest, c: CompletionOutput, sent_text: dict[int, int],
               sent_tokens: dict[int, int]) -> ChatStreamChoice | None:
        n_chars, n_tok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
        delta = c.text[n_chars:]
        if n_tok == -1 or (not delta and c.finish_reason is None):
            return None  # finished and reported (n > 1 outputs repeat finished siblings)
        logprobs = (_logprobs(c.logprobs, c.token_ids, n_tok, request.top_logprobs or 0)
                    if request.logprobs else None)
        sent_text[c.index] = len(c.text)
        sent_tokens[c.index] = -1 if c.finish_reason is not None else len(c.token_ids)
        return ChatStreamChoice(index=c.index, delta=DeltaMessage(content=delta or None),
                                logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)


def _logprobs(logprobs: SampleLogprobs | None, token_ids: list[int], start: int,
              top_k: int) -> ChatChoiceLogprobs:
    """OpenAI chat logprobs for output positions [start, end): the sampled token and the
    ``top_k`` most likely tokens at that position (which may include the sampled one)."""
    content = []
    for tid, entries in zip(token_ids[start:], (logprobs or [])[start:]):
        best = sorted(entries.values(), key=lambda lp: -lp.logprob)[:top_k]
        top = [ChatLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                           bytes=list((lp.decoded_token or "").encode())) for lp in best]
        sampled = entries.get(tid)
        token = (sampled.decoded_token or "") if sampled else ""
        content.append(ChatLogprobContent(
            token=token, logprob=sampled.logprob if sampled else float("-inf"),
            bytes=list(token.encode()), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)
