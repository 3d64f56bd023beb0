"""The README's commands as a newcomer runs them (the main job against the shipped default model)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_command(marker: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)\n```", f.read(), re.S)
    matches = [b for b in blocks if marker in b]
    assert len(matches) == 1, f"README has {len(matches)} bash blocks containing {marker!r}"
    return matches[0].strip()


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert _readme_command("pytest") in f.read()


@pytest.mark.skipif(not os.path.isdir(vllm.DEFAULT_MODEL), reason="default model not shipped")
def test_readme_main_command_generates_what_the_api_does():
    """The command as written (through the expert cache) prints, per built-in prompt, the text
    greedy decoding gives through LLM() without the cache, and the cache's counters."""
    cmd = _readme_command("vllm generate")
    # The install steps are what CI already did; run the generate part as written.
    generate = cmd.split("&&")[-1].strip()
    assert generate.startswith("vllm generate") and "--moe-expert-cache-size" in generate
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main"] + generate.split()[1:]
    proc = subprocess.run(argv + ["--max-tokens", "16"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.cli.main import DEFAULT_PROMPTS
    outs = LLM().generate(DEFAULT_PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    printed, stats = proc.stdout.split("--- expert cache: ")
    expected = "".join(f"--- prompt: {p!r}\n{p}{o.outputs[0].text}\n"
                       for p, o in zip(DEFAULT_PROMPTS, outs))
    assert printed == expected
    fields = dict(kv.split("=") for kv in stats.split())
    hits, misses = int(fields["hits"]), int(fields["misses"])
    assert misses > 0 and float(fields["hit_rate"]) == pytest.approx(hits / (hits + misses),
                                                                     abs=1e-3)
