"""AsyncLLM: the synchronous LLMEngine driven by one background thread, for asyncio servers.

Threading contract: only the engine thread touches the LLMEngine (scheduler, runner and the
tokenizer, which is not safe to share). Everything else crosses over through ``_commands``
(a thread-safe queue, drained between steps): adding and aborting requests, failing all of them
(a server's shutdown grace), and ``call(fn)`` for anything else (metric snapshots). The server
hands it token ids: checking, rendering and tokenizing text happen in its tokenizer worker. Outputs go back to each request's
asyncio.Queue with ``loop.call_soon_threadsafe``. Concurrent requests batch in the engine.

Failure isolation: a bad request fails at ``add_request`` (ValueError) and never enters the
engine; an exception while delivering one request's output fails that request only; an
exception inside ``engine.step()`` fails the requests that were running (the step's batch),
is logged, and the loop keeps serving the rest.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

_IDLE_POLL_S = 0.5  # how often an idle engine thread wakes up to notice a stop


class RequestFailed(RuntimeError):
    """The engine failed this request after accepting it (its message is safe to show)."""


class InternalRequestError(RequestFailed):
    """The request failed on an unexpected exception (details are in the server log only)."""


class EngineDead(RuntimeError):
    """The engine thread is not running (shut down or crashed)."""


@dataclass
class RequestStream:
    """Outputs of one request, consumed on the event loop that added it.

    Each item is a cumulative RequestOutput; a slow consumer only sees the latest one (items
    are coalesced), which is safe because every output carries the full text so far.
    """

    request_id: str
    n: int
    prompt_token_ids: list[int]
    prompt: str | None
    _engine: "AsyncLLM" = field(repr=False)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    finished: bool = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and not _is_final(item):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.error is not None:
            self.finished = True
            raise RequestFailed(item.error)
        self.finished = item.finished
        return item

    def abort(self) -> bool:
        """Abort the request unless it already finished (safe to call more than once);
        True if this call aborted it."""
        if self.finished:
            return False
        self.finished = True
        self._engine.abort(self.request_id)
        return True


def _is_final(item) -> bool:
    return isinstance(item, BaseException) or item.finished or item.error is not None


@dataclass
class _Pending:
    """A request added in the engine thread whose outputs go to ``stream`` on ``loop``."""

    loop: asyncio.AbstractEventLoop
    stream: RequestStream


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._pending: dict[str, _Pending] = {}  # engine thread only
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLM":
        return cls(LLMEngine.from_engine_args(engine_args))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- event-loop side ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Validate, tokenize and queue a request in the engine thread. Raises ValueError for
        a bad prompt or parameters (nothing is queued then); returns its output stream."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._send(("add", request_id, prompt, params, loop, fut))
        return await fut

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        """Async iterator of cumulative RequestOutputs; aborts the request if the consumer stops
        early (cancelled, disconnected, or an exception)."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        if self._thread.is_alive():
            self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps; return (or raise) its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._send(("call", fn, loop, fut))
        return await fut

    def fail_all(self, message: str) -> None:
        """End every request in flight with ``EngineDead(message)`` (a 503 to its client) and
        abort it in the engine; the engine keeps running. For a server's shutdown grace."""
        if self.is_running:
            self._commands.put(("fail_all", message))

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self._stopping:
            self._stopping = True
            self._commands.put(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.engine.shutdown()

    def _send(self, cmd: tuple) -> None:
        if not self.is_running:
            raise EngineDead(f"the engine is not running ({self.dead_error or 'shut down'})")
        self._commands.put(cmd)

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stopping or not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - isolate, log, keep serving
                    logger.exception("engine step failed; failing the requests in its batch")
                    self._fail_running(e)
                    continue
                for out in outputs:
                    self._deliver(out)
        except BaseException as e:  # the loop itself broke: nothing can be served any more
            logger.exception("engine thread crashed")
            self.dead_error = e
        finally:
            self._stopping = True
            self._fail_all(EngineDead("the engine has shut down"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "stop":
            self._stopping = True
        elif kind == "abort":
            if self._pending.pop(cmd[1], None) is not None:
                self.engine.abort_request(cmd[1])
        elif kind == "call":
            _, fn, loop, fut = cmd
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller gets the exception
                _resolve(loop, fut, None, e)
            else:
                _resolve(loop, fut, result, None)
        elif kind == "add":
            self._add(*cmd[1:])
        elif kind == "fail_all":
            for rid in list(self._pending):
                self._fail(rid, EngineDead(cmd[1]))

    def _add(self, request_id, prompt, params, loop, fut) -> None:
        try:
            engine = self.engine
            text, ids = engine.process_prompt(prompt)
            max_len = engine.vllm_config.model_config.max_model_len
            if params.max_tokens is not None and len(ids) + params.max_tokens > max_len:
                raise ValueError(
                    f"max_tokens={params.max_tokens} is too large: the prompt has {len(ids)} "
                    f"tokens and max_model_len={max_len} allows at most "
                    f"{max_len - len(ids)} more tokens")
            if request_id in self._pending:
                raise ValueError(f"request_id={request_id!r} is already in use")
            engine.add_request(request_id, {"prompt_token_ids": ids, "prompt": text}, params)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone
            if not isinstance(e, ValueError):
                logger.exception("request %s: adding it failed", request_id)
                e = InternalRequestError(f"internal error while adding the request "
                                         f"({type(e).__name__})")
            _resolve(loop, fut, None, e)
            return
        stream = RequestStream(request_id, params.n, ids, text, self)
        # The queue belongs to ``loop``; it is only touched there (put via call_soon_threadsafe).
        self._pending[request_id] = _Pending(loop, stream)
        # If the caller is gone (cancelled, or its loop closed) nobody will read the outputs.
        if not _resolve(loop, fut, stream, None, on_cancelled=lambda: self.abort(request_id)):
            self._pending.pop(request_id, None)
            engine.abort_request(request_id)

    def _deliver(self, out: RequestOutput) -> None:
        pending = self._pending.get(out.request_id)
        if pending is None:
            return  # aborted meanwhile
        if out.finished or out.error is not None:
            del self._pending[out.request_id]
        try:
            pending.loop.call_soon_threadsafe(pending.stream._queue.put_nowait, out)
        except Exception:  # noqa: BLE001 - e.g. the consumer's loop closed: drop this request
            if pending.loop.is_closed():   # its server is gone (shutdown): nobody is waiting
                logger.info("request %s: its event loop is closed; aborting it", out.request_id)
            else:
                logger.exception("request %s: could not deliver its output; aborting it",
                                 out.request_id)
            self._pending.pop(out.request_id, None)
            self.engine.abort_request(out.request_id)

    def _fail_running(self, exc: Exception) -> None:
        """After a failed step: fail every request that was scheduled (running) or is no longer
        known to the engine, abort them, and leave waiting requests alone."""
        sched = self.engine.scheduler
        running = {r.request_id for r in sched.running}
        err = InternalRequestError(f"internal error while running the request ({type(exc).__name__})")
        for rid, pending in list(self._pending.items()):
            ids = [rid] if pending.stream.n == 1 else [f"{i}_{rid}" for i in range(pending.stream.n)]
            if any(i in running for i in ids) or not any(i in sched.requests for i in ids):
                self._fail(rid, err)
        # LLMEngine.step() already closed the failed step in the scheduler.

    def _fail(self, rid: str, exc: BaseException) -> None:
        pending = self._pending.pop(rid, None)
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001
            logger.exception("request %s: abort failed", rid)
        if pending is not None:
            try:
                pending.loop.call_soon_threadsafe(pending.stream._queue.put_nowait, exc)
            except RuntimeError:
                pass  # its loop is closed: nobody is waiting

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._pending):
            self._fail(rid, exc)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "call"):
                _resolve(cmd[-2], cmd[-1], None, exc)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result, exc,
             on_cancelled: Callable[[], None] | None = None) -> bool:
    """Complete ``fut`` on its loop from any thread; False if the loop is closed.
    ``on_cancelled`` runs (on the loop) if the caller cancelled ``fut`` meanwhile."""
    def done():
        if fut.cancelled():
            if on_cancelled is not None:
                on_cancelled()
        elif not fut.done():
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
    try:
        loop.call_soon_threadsafe(done)
        return True
    except RuntimeError:
        return False
