"""`vllm` console script: `vllm generate ...`, `vllm serve ...`.

Engine flags come from ``EngineArgs.add_cli_args`` (one definition shared with ``LLM(...)``).
A bad value exits non-zero with one clear line.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from vllm.engine.arg_utils import EngineArgs


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before an error; one line is easier to read."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline for one or more prompts",
                       description="Generate text offline (greedy unless --temperature > 0).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model directory (default: the shipped default model)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeat for a batch; default: a few built-in prompts)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--show-cache-stats", action=argparse.BooleanOptionalAction, default=True,
                   help="print expert-cache stats when the cache is on")
    EngineArgs.add_cli_args(p, skip=("model",))
    p.set_defaults(func=_run_generate)


def _serve_parser(sub) -> None:
    from vllm.entrypoints.openai.cli_args import add_serve_args
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description="Serve the OpenAI-compatible HTTP API.")
    add_serve_args(p)
    p.set_defaults(func=_run_serve)


# The server's own dependencies (import name -> pip package), checked before it is imported.
SERVER_PACKAGES = {"fastapi": "fastapi", "starlette": "starlette", "uvicorn": "uvicorn[standard]",
                   "prometheus_client": "prometheus-client"}


class MissingDependency(RuntimeError):
    pass


def _run_serve(args: argparse.Namespace) -> int:
    for module, package in SERVER_PACKAGES.items():
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise MissingDependency(
                f"`vllm serve` needs the package {package!r}, which is not installed ({e}): "
                f"pip install '{package}', or reinstall the engine with its dependencies: "
                "pip install -e .") from e
    from vllm.entrypoints.openai.api_server import run_serve
    return run_serve(args)


DEFAULT_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


def _run_generate(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model_tag
    llm = LLM(**vars(engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for out in llm.generate(args.prompt or DEFAULT_PROMPTS, params):
        print(f"--- prompt: {out.prompt!r}\n{out.prompt}{out.outputs[0].text}")
    stats = llm.get_moe_cache_stats()
    if stats and args.show_cache_stats:
        print(f"--- expert cache: hit_rate={stats['hit_rate']:.3f} hits={stats['hits']} "
              f"misses={stats['misses']} evictions={stats['evictions']} "
              f"bytes_copied={stats['bytes_copied']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="vllm", description="vLLM-compatible MoE inference engine "
                                     "with an expert cache (--moe-expert-cache-size N).")
    parser.add_argument("--version", action="version", version="%(prog)s " + _version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    _generate_parser(sub)
    _serve_parser(sub)
    return parser


def _version() -> str:
    from vllm import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, MissingDependency) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
