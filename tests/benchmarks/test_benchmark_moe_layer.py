"""benchmarks/benchmark_moe_layer.py on CPU, eager and ``--graphs`` (the capturer's eager
stand-in): one row per (token count, routing), the all-hits routing really hitting everywhere,
the cache's counters per timed forward, and the profile's kernel lists. No timing assertions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_moe_layer as bench  # noqa: E402

ARGS = ["--num-experts", "8", "--top-k", "2", "--hidden", "32", "--inter", "16", "--tokens",
        "1", "4", "--iters", "5", "--json"]


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("extra", [[], ["--graphs", "--profile-iters", "2"]])
def test_rows_and_counters(extra, keep_threads, capsys, tmp_path):
    rows = bench.main(ARGS + extra + ["--out", str(tmp_path / "rows.json")])
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert json.loads(capsys.readouterr().out) == rows
    assert [(r["tokens"], r["routing"]) for r in rows] == [
        (1, "all-hits"), (1, "random"), (4, "all-hits"), (4, "random")]
    for r in rows:
        assert r["slots"] == 7 and r["graphs"] == ("--graphs" in extra)
        assert r["residency_step"] == "cpu_kernel"
        assert r["uncached_ms"] > 0 and r["cached_ms"] > 0
        # 8 experts top-2, 7 slots: at most 8 needed, so at most 2 waves; all-hits needs <= 7.
        assert 1.0 <= r["waves_per_forward"] <= 2.0
        if r["routing"] == "all-hits":          # expert 7 is never routed; the rest stay
            assert r["hit_rate"] == 1.0 and r["waves_per_forward"] == 1.0
        assert ("kernels" in r) == ("--profile-iters" in extra)
        if "kernels" in r:
            assert r["kernels"] == {"uncached": [], "cached": []}    # no device kernels on CPU


def test_too_few_iterations_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--iters", "2"])
    assert "--iters 2: at least 3" in capsys.readouterr().err
