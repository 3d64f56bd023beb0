"""POST /tokenize and /detokenize, as vLLM's: a prompt or chat messages to token ids (with their
count and the server's max_model_len), token ids to text. Both run in the tokenizer worker;
chat messages render as /v1/chat/completions renders them (same template rules)."""
from __future__ import annotations

from fastapi.responses import Response

from vllm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, OpenAIError,
                                              TokenizeRequest, TokenizeResponse, param_of)
from vllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeRequest) -> Response:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of prompt (text) and messages (a chat)",
                              param="prompt")
        if request.prompt is not None:
            add_special = request.add_special_tokens is not False
            try:
                ids = await self.tokenizers.encode(request.prompt, add_special)
            except ValueError as e:
                raise OpenAIError(str(e), param="prompt") from None
        else:
            messages = [m.as_template_dict() for m in request.messages]
            rendered = await self.render_chat(messages, request.chat_template,
                                              request.add_generation_prompt,
                                              request.chat_template_kwargs)
            ids = rendered["prompt_token_ids"]
            if request.add_special_tokens:
                ids = await self.tokenizers.encode(rendered["prompt"], True)
        strs = await self.tokenizers.token_strs(ids) if request.return_token_strs else None
        max_len = self.engine.engine.vllm_config.model_config.max_model_len
        body = TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids,
                                token_strs=strs)
        return Response(body.model_dump_json(), media_type="application/json")

    async def detokenize(self, request: DetokenizeRequest) -> Response:
        self.check_model(request.model)
        try:
            text = await self.tokenizers.decode(request.tokens)
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        return Response(DetokenizeResponse(prompt=text).model_dump_json(),
                        media_type="application/json")
