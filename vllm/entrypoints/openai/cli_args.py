"""`vllm serve` arguments. Kept apart from api_server.py so the CLI can list and parse `serve`
without importing the server's dependencies (fastapi, uvicorn): a missing one is reported when
`vllm serve` runs, naming the package (``entrypoints/cli/main.py``)."""
from __future__ import annotations

import argparse

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
