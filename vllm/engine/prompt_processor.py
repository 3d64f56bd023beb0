"""Prompt processing: tokenizer loading, prompt validation/tokenization, chat templates."""
from __future__ import annotations

import inspect
import json
import os

from vllm.config import ModelConfig


class PromptProcessor:
    def __init__(self, model_config: ModelConfig):
        from transformers import AutoTokenizer
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.hf_config.vocab_size
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer={model_config.tokenizer!r}: could not load a tokenizer "
                             f"(tokenizer.json / tokenizer_config.json expected): {e}") from e
        gen_eos = _generation_config_eos(model_config.model)
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None and gen_eos:
            self.eos_token_id = gen_eos[0]
        self.extra_stop_token_ids = [t for t in gen_eos if t != self.eos_token_id]
        """generation_config.json's other EOS ids (e.g. a chat model's end-of-turn token): they
        end generation like EOS, as in transformers and vLLM."""
        # No token covers more characters than its vocabulary string has (byte-level BPE: one
        # char per byte; byte-fallback pieces like <0x41> over-count), so a text longer than
        # max_chars cannot fit in max_model_len tokens: it is refused before tokenizing.
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_chars = (self.max_model_len - 1) * max(longest, 1)

    def process(self, prompt, index: int | None = None) -> tuple[str | None, list[int]]:
        """-> (prompt text or None, token ids). Raises ValueError naming the bad prompt."""
        where = "prompt" if index is None else f"prompt[{index}]"
        text: str | None = None
        if isinstance(prompt, str):
            text, ids = prompt, self.encode_text(where, prompt)
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif isinstance(prompt.get("prompt"), str):
                text = prompt["prompt"]
                ids = self.encode_text(where, text)
            else:
                raise ValueError(f"{where}: a prompt dict needs 'prompt' (str) or "
                                 f"'prompt_token_ids' (list of int), got keys {sorted(prompt)}")
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"{where}: type {type(prompt).__name__} is invalid: must be str, list of "
                             "token ids, or a TokensPrompt/TextPrompt dict")
        self._validate(where, ids)
        return text, ids

    def check_text(self, where: str, text: str) -> None:
        """ValueError for text that is not valid Unicode (a lone surrogate, which JSON can
        carry) or too long to fit in max_model_len tokens (checked before any tokenizing)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} is not valid Unicode text: a lone surrogate "
                             f"U+{ord(text[e.start]):04X} at character {e.start}") from None
        if len(text) > self.max_chars:
            per_token = self.max_chars // max(self.max_model_len - 1, 1)
            raise ValueError(f"{where} has {len(text)} characters, which cannot fit in "
                             f"max_model_len={self.max_model_len} tokens (a token of this "
                             f"tokenizer covers at most {per_token} characters)")

    def encode_text(self, where: str, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text(where, text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt (the template placed the special tokens)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode_ids(self, ids: list[int]) -> str:
        """Text of token ids; ValueError naming an id outside the vocabulary."""
        self._check_ids("tokens", ids)
        return self.tokenizer.decode(ids)

    def _check_ids(self, where: str, ids: list[int]) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]!r} is invalid: must be an integer in "
                             f"[0, {self.vocab_size})")

    def _validate(self, where: str, ids: list[int]) -> None:
        if not ids:
            raise ValueError(f"{where} is empty: at least one token is required")
        self._check_ids(where, ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{where} has {len(ids)} tokens, but max_model_len={self.max_model_len} "
                             f"allows at most {self.max_model_len - 1} prompt tokens")

    def check_stop_token_ids(self, stop_token_ids: list[int]) -> None:
        bad = [t for t in stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is invalid: must be in "
                             f"[0, {self.vocab_size})")

    def render_chat(self, messages, chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> dict:
        """Render messages with the tokenizer's chat template -> a TokensPrompt dict."""
        text = self.render_chat_text(messages, chat_template, add_generation_prompt,
                                     chat_template_kwargs)
        return {"prompt": text, "prompt_token_ids": self.encode_rendered(text)}

    def render_chat_text(self, messages, chat_template: str | None = None,
                         add_generation_prompt: bool = True,
                         chat_template_kwargs: dict | None = None) -> str:
        """The chat prompt as text (checked like any prompt text). ValueError for bad
        messages or template variables, a missing template or over-long text."""
        self.check_messages(messages, chat_template)
        kwargs = self.check_template_kwargs(chat_template_kwargs)
        # transformers renders in an ImmutableSandboxedEnvironment (no attribute access to
        # Python internals, no mutation of the inputs) and gives templates raise_exception,
        # strftime_now, tojson and jinja's namespace (GPT-OSS's harmony template uses them).
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template, **kwargs)
        self.check_text("the rendered chat prompt", text)
        return text

    def check_template_kwargs(self, kwargs: dict | None) -> dict:
        """``chat_template_kwargs``: extra variables for the template (GPT-OSS's
        reasoning_effort, model_identity, builtin_tools; ``tools``, ``documents``). Names the
        rendering call sets itself (tokenize, add_generation_prompt, ...) are refused: they would
        change what is rendered rather than what the template sees."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError("chat_template_kwargs must be a dict with string keys")
        reserved = sorted(set(kwargs) & _reserved_template_kwargs(self.tokenizer))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved} are set by the rendering call, "
                             "not template variables")
        return kwargs

    def check_messages(self, messages, chat_template: str | None) -> None:
        """What rendering needs: well-formed messages with checked text, and a template."""
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        for i, m in enumerate(messages):
            if isinstance(m["content"], str):
                self.check_text(f"messages[{i}].content", m["content"])


def _reserved_template_kwargs(tokenizer) -> set[str]:
    """``apply_chat_template``'s own parameters (and the ``messages`` it renders), except the
    template inputs it forwards unchanged."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    names = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return (names | {"messages", "conversation"}) - {"tools", "documents"}


def _generation_config_eos(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json (an int or a list there), or []."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    return [t for t in eos if isinstance(t, int)]
