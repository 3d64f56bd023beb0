"""tools/gpu_session.sh (a GPU session's stages): valid bash, and every benchmark command it runs
is accepted by that benchmark's own argument parser (checked through DRY=1, which prints the
commands instead of running them)."""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_session.sh")


def _bench(name: str, folder: str = "benchmarks"):
    sys.path.insert(0, os.path.join(ROOT, folder))           # their sibling modules
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, folder,
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@pytest.mark.parametrize("stage,bench,count", [("first", "benchmark_decode", 4),
                                               ("first", "benchmark_quantization", 2),
                                               ("first", "benchmark_expert_offload", 1),
                                               ("first", "benchmark_moe_layer", 1),
                                               ("retry", "benchmark_quantization", 2),
                                               ("decode", "benchmark_decode", 4),
                                               ("offload", "benchmark_expert_offload", 1),
                                               ("quant", "benchmark_quantization", 2),
                                               ("tune", "tune_fused_moe", 1),
                                               ("flashinfer", "benchmark_decode", 2)])
def test_every_benchmark_command_parses(tmp_path, stage, bench, count):
    out = subprocess.run(["bash", SCRIPT, stage], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "DRY": "1", "OUT": str(tmp_path),
                              "LOGS": str(tmp_path / "logs")}, check=True)
    lines = [shlex.split(line) for line in out.stdout.splitlines() if f"{bench}.py" in line]
    assert len(lines) == count, out.stdout
    folder = "tools" if bench.startswith("tune") else "benchmarks"
    parse = _bench(bench, folder).parse_args
    for words in lines:
        args = parse(words[words.index(f"{folder}/{bench}.py") + 1:])
        assert (folder == "tools" or args.json) and str(tmp_path) in args.out


def test_first_skips_the_steps_past_its_budget(tmp_path):
    """Stage first: with under 30 s of BUDGET left no step starts; each is listed as skipped,
    in the order of value, so what a cut command leaves in $OUT says what did not run."""
    out = subprocess.run(["bash", SCRIPT, "first"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "DRY": "1", "OUT": str(tmp_path), "BUDGET": "20"},
                         check=True)
    assert "benchmarks/" not in out.stdout and "pytest" not in out.stdout
    skipped = [line.split()[0] for line in (tmp_path / "summary.txt").read_text().splitlines()]
    assert skipped == ["pytest-gpu", "decode-graphs", "decode-async", "moe-layer", "offload",
                       "quant", "quant-cutlass", "decode-exp12", "decode-eager"]


@pytest.mark.parametrize("stage", ["first", "check", "suite", "decode", "offload", "quant",
                                   "tune", "flashinfer"])
def test_a_stage_returns_at_most_eight_files(tmp_path, stage):
    """The device tool brings back at most 8 files from $OUT: summary.txt, logs.tgz and one
    JSON per benchmark step, or a step's JSON in $LOGS, packed into logs.tgz with the logs; the
    pytest steps run on past the server's test modules, whose packages the GPU image lacks."""
    logs = tmp_path / "logs"
    out = subprocess.run(["bash", SCRIPT, stage], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "DRY": "1", "OUT": str(tmp_path / "out"),
                              "LOGS": str(logs)}, check=True)
    lines = [shlex.split(line) for line in out.stdout.splitlines()]
    outs = {w[w.index("--out") + 1] for w in lines if "--out" in w}
    assert all(o.startswith((str(tmp_path / "out"), str(logs))) for o in outs)
    assert len([o for o in outs if o.startswith(str(tmp_path / "out"))]) + 2 <= 8
    for w in lines:
        if "pytest" in w:
            assert "--continue-on-collection-errors" in w


def test_an_unknown_stage_is_refused():
    out = subprocess.run(["bash", SCRIPT, "nope"], capture_output=True, text=True,
                         env={**os.environ, "DRY": "1"})
    assert out.returncode == 2 and "unknown stage nope" in out.stdout
