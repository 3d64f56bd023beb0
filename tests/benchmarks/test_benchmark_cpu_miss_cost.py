"""benchmarks/benchmark_cpu_miss_cost.py: its rows (not their timings)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_cpu_miss_cost as bench  # noqa: E402


def test_rows_per_shape_and_thread_count(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = bench.main(["--shape", "tiny", "--threads", "1", "2", "--repeats", "2", "--json"])
        assert torch.get_num_threads() == 1       # restored: other tests' bits depend on it
    finally:
        torch.set_num_threads(threads)
    assert json.loads(capsys.readouterr().out) == rows
    assert [(r["shape"], r["threads"]) for r in rows] == [("tiny", 1), ("tiny", 2)]
    for r in rows:
        assert r["expert_bytes"] == 3 * 64 * 32 * 2          # bf16 gate, up and down
        assert r["cpu_1_token_ms"] > 0 and r["ram_copy_ms"] > 0 and r["cpu_per_token_ms"] >= 0
        assert r["break_even_gbps"] == pytest.approx(
            r["expert_bytes"] / (r["cpu_1_token_ms"] / 1e3) / 1e9)


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])
    assert "--repeats 0" in capsys.readouterr().err
