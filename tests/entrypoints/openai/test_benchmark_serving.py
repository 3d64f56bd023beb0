"""benchmarks/benchmark_serving.py: percentiles against numpy, and a tiny run against the real
server whose token counts must equal what the server reports in /metrics."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from openai_server_utils import API_KEY

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks",
                     "benchmark_serving.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_serving", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_percentiles_match_numpy(bench):
    values = list(np.random.default_rng(0).exponential(size=37))
    got = bench.percentiles(values)
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert got[name] == pytest.approx(float(np.percentile(values, q)))
    assert got["mean"] == pytest.approx(float(np.mean(values)))


def test_run_against_server(bench, server, tmp_path, capsys):
    gen_before = server.metric("vllm:generation_tokens_total")
    out = tmp_path / "summary.json"
    rc = bench.main(["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
                     "--input-len", "4", "--output-len", "5", "--max-concurrency", "3",
                     "--json-out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["mean_output_tokens"] == 5  # ignore_eos: exactly --output-len each
    # 6 requests + the 2-token warm-up, as counted by the server itself.
    assert server.metric("vllm:generation_tokens_total") - gen_before == 6 * 5 + 2
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert 0 < summary[key]["p50"] <= summary[key]["p99"]
    assert "TTFT" in capsys.readouterr().out
