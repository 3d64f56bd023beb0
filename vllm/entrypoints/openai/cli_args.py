"""`vllm serve` arguments. Kept apart from api_server.py so the CLI can list and parse `serve`
without importing the server's dependencies (fastapi, uvicorn): a missing one is reported when
`vllm serve` runs, naming the package (``entrypoints/cli/main.py``)."""
from __future__ import annotations

import argparse
import json

from vllm.engine.arg_utils import EngineArgs

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory (default: the shipped default model)")
    g = parser.add_argument_group("server arguments")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $VLLM_API_KEY, "
                        "or no key)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API accepts and reports (default: MODEL as given)")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's log level (default: info)")
    g.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle HTTP keep-alive connection stays open (default: 5)")
    g.add_argument("--shutdown-timeout", type=_seconds, default=5.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before "
                        "they are cancelled (default: 5)")
    g.add_argument("--max-n", type=_positive_int, default=128,
                   help="largest n (and best_of) a request may ask for (default: 128)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (a template is code the "
                        "server runs; refused by default)")
    g.add_argument("--chat-template-timeout", type=_positive_seconds, default=5.0,
                   help="with --trust-request-chat-template: seconds a request's template may "
                        "take to render (in a child process) before it is stopped (default: 5)")
    g.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=["*"],
                   help='CORS allowed origins, a JSON list (default: ["*"])')
    g.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"],
                   help='CORS allowed methods, a JSON list (default: ["*"])')
    g.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"],
                   help='CORS allowed headers, a JSON list (default: ["*"])')
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (default: off)")
    EngineArgs.add_cli_args(parser, skip=("model",))


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port={text!r} is invalid: must be an integer in "
                                         "[0, 65535]")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be a number of seconds >= 0")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be a number of seconds > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be an integer >= 1")
    return value


def _json_list(flag: str):
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag}={text!r} is invalid: must be a JSON list "
                                             f'of strings, e.g. \'["https://example.com"]\'')
        return value
    return parse
