"""The server's tokenizing worker: request text is checked, chat templates rendered and prompts
tokenized here, off the engine thread (which then only validates token ids, schedules and
steps) and off the event loop (which keeps serving other clients meanwhile).

It owns its own ``PromptProcessor`` (its own tokenizer instance: a Rust tokenizer is not shared
across threads) and one tokenizing thread, so prompts are tokenized in arrival order. Chat
templates render on two other threads (Jinja does not touch the tokenizer), so a slow template
never delays the tokenizing of other requests. Every text is bounded before any tokenizing or
rendering (``PromptProcessor.check_text``: valid Unicode, no more characters than max_model_len
tokens can cover). A request-supplied template (refused unless the server runs with
``--trust-request-chat-template``) renders in a child process with a time and a size limit
(``template_sandbox.py``); the model's own renders here, in transformers' sandboxed Jinja
environment.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from vllm.engine.prompt_processor import PromptProcessor
from vllm.entrypoints.openai.template_sandbox import TemplateSandbox


class TokenizerPool:
    def __init__(self, processor: PromptProcessor, sandbox: TemplateSandbox | None = None):
        self.processor = processor
        self.sandbox = sandbox
        """Renders request-supplied templates; None: they are not accepted here."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-tokenizer")
        self._templates = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-template")

    @classmethod
    def for_engine(cls, engine, template_timeout_s: float | None = None) -> "TokenizerPool":
        """With ``template_timeout_s``, request templates render in a started sandbox process
        with that time limit."""
        processor = PromptProcessor(engine.vllm_config.model_config)
        sandbox = None
        if template_timeout_s is not None:
            sandbox = TemplateSandbox(engine.vllm_config.model_config.tokenizer,
                                      processor.max_chars, template_timeout_s)
            sandbox.start()
        return cls(processor, sandbox)

    async def _run(self, fn: Callable[..., Any], *args, pool: ThreadPoolExecutor | None = None
                   ) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool or self._pool, fn, *args)

    async def process(self, prompt, index: int | None = None) -> dict:
        """A prompt (text, token ids or a prompt dict) -> {"prompt", "prompt_token_ids"} for
        ``AsyncLLM.add_request``. ValueError names the bad prompt."""
        text, ids = await self._run(self.processor.process, prompt, index)
        return {"prompt": text, "prompt_token_ids": ids}

    async def render_chat(self, messages: list[dict], chat_template: str | None,
                          add_generation_prompt: bool,
                          template_kwargs: dict | None = None) -> dict:
        """Rendered and tokenized messages: {"prompt", "prompt_token_ids"}. A template from the
        request renders in the sandbox (ValueError where there is none); ``template_kwargs``
        are extra template variables (``chat_template_kwargs``)."""
        if chat_template is None:
            render = self.processor.render_chat_text
        elif self.sandbox is None:
            raise ValueError("chat_template: request templates are not accepted here")
        else:
            render = self._render_in_sandbox
        text = await self._run(render, messages, chat_template, add_generation_prompt,
                               template_kwargs, pool=self._templates)
        ids = await self._run(self.processor.encode_rendered, text)
        return {"prompt": text, "prompt_token_ids": ids}

    def _render_in_sandbox(self, messages: list[dict], chat_template: str,
                           add_generation_prompt: bool, template_kwargs: dict | None) -> str:
        """render_chat_text's checks around the sandbox's render (on a template thread)."""
        self.processor.check_messages(messages, chat_template)
        kwargs = self.processor.check_template_kwargs(template_kwargs)
        text = self.sandbox.render(messages, chat_template, add_generation_prompt, kwargs)
        self.processor.check_text("the rendered chat prompt", text)
        return text

    async def decode(self, token_ids: list[int]) -> str:
        """Text of token ids (ValueError for an id outside the vocabulary)."""
        return await self._run(self.processor.decode_ids, token_ids)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of checked text (no max_model_len bound on the count)."""
        return await self._run(self.processor.encode_text, "prompt", text, add_special_tokens)

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        return await self._run(self.processor.tokenizer.convert_ids_to_tokens, token_ids)

    def shutdown(self) -> None:
        for pool in (self._pool, self._templates):
            pool.shutdown(wait=False, cancel_futures=True)
        if self.sandbox is not None:
            self.sandbox.close()
