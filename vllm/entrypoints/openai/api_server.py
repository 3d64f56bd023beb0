"""`vllm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM.

Routes: GET /health, /version, /v1/models, /metrics; POST /v1/completions,
/v1/chat/completions, /tokenize, /detokenize. Every error is OpenAI's JSON ({"error": {"message", "type", "param",
"code"}}); no traceback ever reaches a client. With --api-key, /v1/* needs
``Authorization: Bearer <key>``. CORS as vLLM's (--allowed-origins ...; preflight requests are
answered before the key check, as browsers send them without it). Prompts are checked, rendered
and tokenized in a tokenizer worker (``tokenizer_pool.py``), never on the engine thread. SIGTERM
or SIGINT: stop accepting, give in-flight requests --shutdown-timeout seconds, cancel the rest
(which aborts their engine requests), stop the engine, exit 0. docs/serving.md lists the flags.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import signal
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, ModelCard, ModelList,
                                              OpenAIError, TokenizeRequest, error_body,
                                              random_id)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import FrontendOptions, failure_to_error
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.entrypoints.openai.tokenizer_pool import TokenizerPool
from vllm.logger import init_logger
from vllm.platforms import platform_for

logger = init_logger(__name__)

_ROUTES = ("/health", "/version", "/metrics", "/v1/models", "/v1/completions",
           "/v1/chat/completions", "/tokenize", "/detokenize")


# ---- CLI --------------------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    """Build the engine, log what it uses, and serve until SIGINT/SIGTERM; 0 after a clean
    shutdown."""
    from vllm import DEFAULT_MODEL
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model_tag
    names = args.served_model_name or [args.model_tag or "default"]
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    async_llm = AsyncLLM.from_engine_args(engine_args)
    app: FastAPI | None = None
    server: GracefulServer | None = None
    try:
        for line in startup_summary(async_llm.engine, names):
            logger.info(line)
        options = FrontendOptions(max_n=args.max_n,
                                  trust_request_chat_template=args.trust_request_chat_template,
                                  chat_template_timeout=args.chat_template_timeout)
        app = build_app(async_llm, names, api_key=api_key,
                        model_root=args.model_tag or DEFAULT_MODEL, options=options)
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_credentials=args.allow_credentials,
                           allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level,
                                timeout_keep_alive=args.timeout_keep_alive,
                                # a backstop: the grace itself ends requests (GracefulServer)
                                timeout_graceful_shutdown=args.shutdown_timeout + 10)
        server = GracefulServer(config, async_llm, args.shutdown_timeout)
        logger.info("serving the OpenAI API on http://%s:%d/v1 (auth: %s)", args.host, args.port,
                    "api key" if api_key else "none")
        with _signal_ends_serving():
            server.run()
        return 0 if server.started else 1
    finally:
        if server is not None:
            server.timer.cancel()
        if app is not None:
            app.state.tokenizers.shutdown()
        async_llm.shutdown()


class GracefulServer(uvicorn.Server):
    """On the first SIGINT/SIGTERM uvicorn stops accepting and waits for open requests;
    ``grace_s`` later every request still in flight is ended with a 503 ("the server is
    shutting down": an error event in a stream) and aborted in the engine, so the wait ends with
    every client answered."""

    def __init__(self, config: uvicorn.Config, async_llm: AsyncLLM, grace_s: float):
        super().__init__(config)
        self.timer = threading.Timer(grace_s, async_llm.fail_all,
                                     args=("the server is shutting down",))
        self.timer.daemon = True

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.timer.start()
        super().handle_exit(sig, frame)


@contextlib.contextmanager
def _signal_ends_serving():
    """uvicorn handles SIGINT/SIGTERM (stop accepting, wait --shutdown-timeout, cancel) and then
    re-raises the signal under the handlers it found; with these no-op ones the re-raise returns,
    so the engine is shut down and the process exits 0 instead of dying by the signal."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(s, lambda *_: None) for s in sigs]
    try:
        yield
    finally:
        for s, handler in zip(sigs, previous):
            signal.signal(s, handler)


def startup_summary(engine, names: list[str]) -> list[str]:
    """Log lines: model, device, expert cache (slots, policy, memory), KV cache."""
    cfg = engine.vllm_config
    mc, cc = cfg.model_config, cfg.cache_config
    runner = engine.runner
    lines = [f"model: {mc.model} ({mc.architecture}, dtype {mc.dtype}, max_model_len "
             f"{mc.max_model_len}), served as {names}",
             f"device: {cfg.device_config.device}" + _device_name(cfg.device_config.device)]
    lines.append(runner.describe_moe_cache())
    lines.append(f"KV cache: {cc.num_gpu_blocks} blocks x {cc.block_size} tokens "
                 f"({cc.num_gpu_blocks * runner.kv_bytes_per_block() / 2**20:.1f} MiB); "
                 f"max_num_seqs {cfg.scheduler_config.max_num_seqs}, max_num_batched_tokens "
                 f"{cfg.scheduler_config.max_num_batched_tokens}")
    return lines


def _device_name(device: str) -> str:
    platform = platform_for(device)
    return f" ({platform.device_name(device)})" if platform.name == "cuda" else ""


# ---- app --------------------------------------------------------------------------------------
def build_app(async_llm: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              model_root: str | None = None, options: FrontendOptions | None = None) -> FastAPI:
    """The FastAPI app over a running AsyncLLM. The caller shuts the engine down, and the app's
    tokenizer worker (``app.state.tokenizers``) when it is done with the app."""
    from vllm import __version__
    options = options or FrontendOptions()
    tokenizers = TokenizerPool.for_engine(
        async_llm.engine, options.chat_template_timeout
        if options.trust_request_chat_template else None)
    app = FastAPI(title="vllm-moe-cache OpenAI-compatible API", version=__version__)
    app.state.tokenizers = tokenizers
    metrics = ServerMetrics(served_model_names[0])
    serving = (async_llm, served_model_names, metrics, tokenizers, options)
    completion = OpenAIServingCompletion(*serving)
    chat = OpenAIServingChat(*serving)
    tokenization = OpenAIServingTokenization(*serving)
    max_model_len = async_llm.engine.vllm_config.model_config.max_model_len
    app.state.metrics = metrics
    app.state.async_llm = async_llm
    _add_error_handlers(app)
    app.add_middleware(_AuthAndCountMiddleware, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        if async_llm.is_running:
            return Response(status_code=200)
        return _error(OpenAIError("the engine is not running", 503, "ServiceUnavailableError"))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=n, root=model_root, max_model_len=max_model_len)
                 for n in served_model_names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/metrics")
    async def prometheus():
        return Response(await metrics.render(async_llm), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        return await _guard(completion.create_completion(request), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await _guard(chat.create_chat_completion(request), raw)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest, raw: Request):
        return await _guard(tokenization.tokenize(request), raw)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw: Request):
        return await _guard(tokenization.detokenize(request), raw)

    return app


async def _guard(coro, raw: Request):
    """Run a handler until it returns a response or the client hangs up (then it is cancelled,
    which aborts its engine requests); a failure becomes an OpenAI error response."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nobody is left to read it
    try:
        return task.result()
    except Exception as e:  # noqa: BLE001
        return _error(failure_to_error(e, random_id("req")))


async def _disconnected(raw: Request) -> None:
    """Returns when the client disconnects (the request body has already been read, so the
    next ASGI message is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error(OpenAIError(f"the request body is not valid JSON: "
                                      f"{first.get('ctx', {}).get('error', first.get('msg'))}"))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        where = f"{param}: " if param else ""
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        return _error(OpenAIError(f"{where}{msg}{more}", 400, "BadRequestError", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kinds = {404: "NotFoundError", 405: "MethodNotAllowedError"}
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
               else str(exc.detail))
        return _error(OpenAIError(msg, exc.status_code, kinds.get(exc.status_code, "HTTPError")))


class _AuthAndCountMiddleware:
    """Pure ASGI (streaming and disconnect detection pass through untouched): checks the API
    key on /v1/* and counts responses by route and status code."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        if self.expected is not None and path.startswith("/v1/"):
            auth = dict(scope.get("headers") or []).get(b"authorization")
            if auth is None or not hmac.compare_digest(auth, self.expected):
                self.metrics.count_http(route, 401)
                why = "missing" if auth is None else "wrong"
                err = OpenAIError(f"Unauthorized: {why} API key (send 'Authorization: Bearer "
                                  "<key>')", 401, "AuthenticationError")
                return await _error(err)(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.count_http(route, message["status"])
            await send(message)
        await self.app(scope, receive, counting_send)


__all__ = ["run_serve", "build_app", "startup_summary", "error_body"]
