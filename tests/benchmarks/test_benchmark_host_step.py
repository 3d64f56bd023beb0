"""benchmarks/benchmark_host_step.py on CPU: a row per batch whose decode steps replayed CPU
graphs (their time is measured, so host = step - replays), the inputs' share of the host's
time, as many decode steps as asked, and the timed methods restored afterwards. No timing
assertions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_host_step as bench  # noqa: E402


def test_rows_split_each_step_into_replays_and_host(tmp_path, capsys):
    from vllm.kernels.cpu.graph import CpuGraph
    from vllm.worker.model_runner import ModelRunner
    replay, prepare = CpuGraph.replay, ModelRunner._prepare_inputs
    out = bench.main(["--batch", "1", "3", "--steps", "6", "--repeat", "2", "--json", "--out",
                      str(tmp_path / "host.json")])
    assert json.loads(capsys.readouterr().out) == out
    assert json.loads((tmp_path / "host.json").read_text()) == out
    assert [r["batch"] for r in out["rows"]] == [1, 3]
    for r in out["rows"]:
        assert r["steps"] == 6                      # the decode steps after the prefill's token
        assert 0 < r["replay_ms"] < r["step_ms"]    # every decode step replayed its graphs
        assert r["host_ms"] == pytest.approx(r["step_ms"] - r["replay_ms"])
        assert r["host_ms_per_request"] == pytest.approx(r["host_ms"] / r["batch"])
        assert 0 < r["inputs_ms"] < r["host_ms"]   # every step built its inputs, on the host
    assert CpuGraph.replay is replay and ModelRunner._prepare_inputs is prepare


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "0"])
    assert "--steps [0] is invalid" in capsys.readouterr().err


def test_cuda_graph_path_rows_are_host_work_alone():
    """--cuda-graph-path: the steps go through CudaDecodeGraphs, whose replays return their
    captures' output (no CPU graph replays), and the module is restored afterwards; with
    --async-scheduling too."""
    from vllm.worker import cuda_graphs
    saved = cuda_graphs.uses_cuda_graphs, cuda_graphs.default_capturer
    out = bench.main(["--batch", "2", "--steps", "5", "--repeat", "1", "--cuda-graph-path",
                      "--async-scheduling"])
    assert out["cuda_graph_path"] and out["async_scheduling"]
    (row,) = out["rows"]
    assert row["steps"] == 5 and row["replay_ms"] == 0 and row["host_ms"] == row["step_ms"]
    assert row["aten_ops_per_step"] > 0
    assert (cuda_graphs.uses_cuda_graphs, cuda_graphs.default_capturer) == saved
