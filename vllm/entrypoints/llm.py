"""The offline ``LLM`` class (vLLM's interface)."""
from __future__ import annotations

import itertools
import weakref
from typing import Sequence

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline batched generation. Keyword arguments are ``EngineArgs`` fields; unknown ones
    raise ``TypeError`` naming them."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        # Not __del__: at interpreter exit a __del__ may run after module globals are torn
        # down; a finalizer runs from atexit first, or when the LLM is collected.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompt_list)} prompts; "
                                 "pass one, or one per prompt")
        # Validate every prompt first so a bad one leaves no half-submitted batch behind.
        processed = [self.llm_engine.process_prompt(p, index=i) for i, p in enumerate(prompt_list)]
        ids = []
        for (text, token_ids), sp in zip(processed, params):
            # Only finished outputs are returned: the engine need not build the others.
            sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            request_id = str(next(self._counter))
            prompt = {"prompt_token_ids": token_ids} if text is None else {
                "prompt_token_ids": token_ids, "prompt": text}
            self.llm_engine.add_request(request_id, prompt, sp)
            ids.append(request_id)
        return self._run_engine(ids)

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Render one conversation (a list of {"role", "content"} dicts) or a list of them with the
        tokenizer's chat template, then generate. ``chat_template_kwargs``: extra template
        variables (e.g. GPT-OSS's {"reasoning_effort": "low"})."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.llm_engine.render_chat(c, chat_template, add_generation_prompt,
                                               chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_moe_cache_stats(self) -> dict | None:
        """Expert-cache totals and per-layer lists (hits, misses, evictions, bytes_copied,
        hit_rate); None when the cache is off."""
        return self.llm_engine.get_moe_cache_stats()

    def _run_engine(self, request_ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        engine = self.llm_engine
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            engine.abort_request([i for i in request_ids if i not in done])
            raise
        return [done[i] for i in request_ids]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # a single token-id prompt
    return list(prompts)
