"""The Buildkite pipeline names only things that exist: files and test paths, registered pytest
markers, script flags, pip extras; and it covers what CI must run (the README's test command,
the SM90 and SM120 queues with their arch, the gpu marker, a benchmark)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:                     # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = yaml.safe_load((ROOT / ".buildkite" / "test-pipeline.yaml").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _steps():
    return PIPELINE["steps"]


def _commands():
    """Every simple command of every step, as argv lists (split at && and ;)."""
    out = []
    for step in _steps():
        cmds = step.get("commands") or [step["command"]]
        for cmd in cmds:
            for part in re.split(r"&&|;", cmd):
                out.append((step["label"], shlex.split(part)))
    return out


def _markers() -> set[str]:
    return {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}


def _script_flags(script: str) -> set[str]:
    help_text = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True,
                               text=True, cwd=ROOT).stdout
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", help_text))


def test_cpu_step_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    [cpu] = [s for s in _steps() if s.get("key") == "cpu-suite"]
    assert cpu["command"] in readme
    assert cpu["command"] in (ROOT / ".ci" / "run").read_text()


def test_gpu_matrix_has_sm90_and_sm120_with_their_arch():
    [gpu] = [s for s in _steps() if "matrix" in s]
    setup = gpu["matrix"]["setup"]
    assert set(setup["queue"]) == {"gpu-sm90", "gpu-sm120"}
    skipped = {(a["with"]["queue"], a["with"]["arch"]) for a in gpu["matrix"]["adjustments"]
               if a.get("skip")}
    kept = {(q, a) for q in setup["queue"] for a in setup["arch"]} - skipped
    assert kept == {("gpu-sm90", "9.0a"), ("gpu-sm120", "12.0a")}
    assert gpu["agents"]["queue"] == "{{matrix.queue}}"
    assert gpu["env"]["TORCH_CUDA_ARCH_LIST"] == "{{matrix.arch}}"
    assert gpu["env"]["VLLM_TARGET_DEVICE"] == "cuda"
    cmds = " ; ".join(gpu["commands"])
    assert "pytest -q -m gpu" in cmds and "benchmarks/" in cmds


@pytest.mark.parametrize("label,argv", _commands(), ids=lambda x: " ".join(x)[:60]
                         if isinstance(x, list) else "")
def test_command_names_what_exists(label, argv):
    env = [a for a in argv if re.fullmatch(r"[A-Z_]+=.*", a)]
    argv = argv[len(env):]
    if argv[:3] == [argv[0], "-m", "pytest"] and argv[0].startswith("python"):
        args = argv[3:]
        for i, a in enumerate(args):
            if a == "-m":
                assert args[i + 1] in _markers(), f"{label}: marker {args[i + 1]!r}"
            elif a == "-n":                                     # pytest-xdist's worker count
                assert args[i + 1].isdigit() or args[i + 1] == "auto", f"{label}: -n {args[i + 1]}"
            elif not a.startswith("-") and (i == 0 or args[i - 1] not in ("-m", "-n")):
                assert (ROOT / a.split("::")[0]).exists(), f"{label}: {a} does not exist"
    elif argv[0].startswith("python") and argv[1].endswith(".py"):
        assert (ROOT / argv[1]).is_file(), f"{label}: {argv[1]} does not exist"
        flags = {a.split("=")[0] for a in argv[2:] if a.startswith("--")}
        missing = flags - _script_flags(argv[1])
        assert not missing, f"{label}: {argv[1]} has no {sorted(missing)}"
    elif argv[0] == "pip":
        for a in argv:
            m = re.fullmatch(r"\.\[(.*)\]", a)
            if m:
                extras = set(PYPROJECT["project"]["optional-dependencies"])
                assert set(m.group(1).split(",")) <= extras, f"{label}: extras {a}"
    elif argv[:2] == ["python", "-c"]:
        compile(argv[2], "<pipeline>", "exec")
    else:
        pytest.fail(f"{label}: a command this test does not know how to check: {argv}")
