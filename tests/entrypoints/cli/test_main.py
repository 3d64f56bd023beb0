"""The `vllm` console script: `serve` is always listed, and a missing server dependency is a
clear error naming the package and how to install it (it used to make `serve` vanish)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from vllm.entrypoints.cli.main import build_parser


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_serve_is_a_command():
    parser = build_parser()
    args = parser.parse_args(["serve", "--port", "8123", "--moe-expert-cache-size", "4"])
    assert args.command == "serve" and args.port == 8123 and args.moe_expert_cache_size == 4


@pytest.mark.parametrize("module,package", [("fastapi", "fastapi"), ("uvicorn", "uvicorn[standard]"),
                                            ("prometheus_client", "prometheus-client")])
def test_missing_server_dependency_names_the_package(module, package):
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from vllm.entrypoints.cli.main import main\n"
            "sys.exit(main(['serve', '--port', '0']))")
    proc = _run(code)
    assert proc.returncode == 2, proc.stderr
    assert f"`vllm serve` needs the package {package!r}" in proc.stderr
    assert f"pip install '{package}'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_and_generate_work_without_server_dependencies():
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"
            "from vllm.entrypoints.cli.main import build_parser\n"
            "p = build_parser(); print(p.format_help())\n"
            "a = p.parse_args(['serve', '--help'])")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert "serve" in proc.stdout and "generate" in proc.stdout
    assert "--moe-expert-cache-size" in proc.stdout       # serve --help printed its flags
