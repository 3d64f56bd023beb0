"""Prompt types accepted by LLM.generate (vLLM's names)."""
from __future__ import annotations

from typing import TypedDict, Union


class TextPrompt(TypedDict, total=False):
    prompt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
