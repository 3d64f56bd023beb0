"""Request-supplied chat templates (``--trust-request-chat-template``) render in a child process
with a time limit and a size limit, so a template that loops for ever or writes gigabytes costs
its request a 400 and nothing else: the child is killed and a fresh one started for the next
template. The model's own template renders in-process (``tokenizer_pool.py``): it is the
operator's, and its input is bounded.

The child loads the tokenizer itself and calls ``apply_chat_template`` exactly as the server
would (transformers' sandboxed Jinja environment, the tokenizer's special tokens), so a request
template renders the same text in or out of process. Protocol over a pipe: the child sends
("ready", None) once loaded; then per request (messages, template, add_generation_prompt,
template kwargs) -> (True, text) or (False, "ErrorType: message").
"""
from __future__ import annotations

import multiprocessing
import threading

_STARTUP_TIMEOUT_S = 300.0


def _child_main(tokenizer_path: str, max_chars: int, conn) -> None:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    conn.send(("ready", None))
    while True:
        try:
            messages, template, add_generation_prompt, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 chat_template=template, **kwargs)
        except Exception as e:  # noqa: BLE001 - the template's error goes to its request
            conn.send((False, f"{type(e).__name__}: {e}"))
            continue
        if len(text) > max_chars:   # checked here: do not ship gigabytes through the pipe
            conn.send((False, f"the rendered chat prompt has {len(text)} characters, more "
                              f"than max_model_len tokens can cover ({max_chars})"))
        else:
            conn.send((True, text))


class TemplateSandbox:
    """One child process rendering one template at a time (callers block; run it in a
    thread). ``render`` raises ValueError for a template error, an over-long result or a
    render that took longer than ``timeout_s`` (the child is then killed)."""

    def __init__(self, tokenizer_path: str, max_chars: int, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"chat_template_timeout={timeout_s} is invalid: must be > 0 s")
        self.tokenizer_path, self.max_chars, self.timeout_s = tokenizer_path, max_chars, timeout_s
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a threaded server
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def start(self) -> None:
        """Start the child now (it takes seconds to load), rather than at the first render."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_child_main, name="vllm-template-sandbox", daemon=True,
                                 args=(self.tokenizer_path, self.max_chars, child))
        proc.start()
        child.close()
        if not parent.poll(_STARTUP_TIMEOUT_S) or parent.recv() != ("ready", None):
            proc.kill()
            raise RuntimeError("the chat-template sandbox process did not start")
        self._proc, self._conn = proc, parent

    def render(self, messages: list[dict], template: str, add_generation_prompt: bool,
               template_kwargs: dict | None = None) -> str:
        with self._lock:
            self._ensure()
            self._conn.send((messages, template, add_generation_prompt, template_kwargs or {}))
            if not self._conn.poll(self.timeout_s):
                self._kill()
                raise ValueError(f"chat_template took longer than {self.timeout_s:g} s to "
                                 f"render (--chat-template-timeout): rendering was stopped")
            try:
                ok, value = self._conn.recv()
            except (EOFError, OSError):         # the child died (e.g. out of memory)
                self._kill()
                raise ValueError("chat_template could not be rendered: the rendering "
                                 "process died") from None
        if not ok:
            raise ValueError(f"messages could not be rendered with the chat template: {value}")
        return value

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._kill()
