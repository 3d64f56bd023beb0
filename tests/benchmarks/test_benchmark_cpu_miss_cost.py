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
        assert 0 < r["decision_us"] < 1e6 and 0 < r["decision_balance_us"] < 1e6


def test_the_timed_decision_is_autos_with_and_without_balance(monkeypatch):
    """time_decision runs mode "auto" at the shape's E and top_k, E/4 resident; with
    ``concurrent`` its cost model sends some misses to the CPU (balance), else none."""
    from vllm.model_executor.layers.fused_moe.expert_cache.host_compute import HostMissCompute
    seen = []
    real = HostMissCompute.host_pairs

    def spy(self, topk_ids, slot_of_expert):
        ids, on_cpu = real(self, topk_ids, slot_of_expert)
        seen.append((self.mode, self.cost.concurrent, tuple(ids.shape),
                     int((slot_of_expert >= 0).sum()), int(on_cpu.sum())))
        return ids, on_cpu
    monkeypatch.setattr(HostMissCompute, "host_pairs", spy)
    for concurrent in (False, True):
        seen.clear()
        bench.time_decision(64, 6, concurrent, steps=20)
        assert {s[:4] for s in seen} == {("auto", concurrent, (1, 6), 16)} and len(seen) == 60
        assert (sum(s[4] for s in seen) > 0) == concurrent


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])
    assert "--repeats 0" in capsys.readouterr().err


def test_rows_with_and_without_the_c_kernels(capsys):
    H, N = 64, 32                                   # the tiny shape
    threads = torch.get_num_threads()
    try:
        rows = bench.main(["--shape", "tiny", "--scheme", "bf16", "fp8-channel", "w4a16-gptq",
                           "fp8-block", "nvfp4", "mxfp4", "w4a16-gptq-act", "--dequantize-too",
                           "--repeats", "1", "--json"])
    finally:
        torch.set_num_threads(threads)
    got = [(r["scheme"], r["path"]) for r in rows]
    # 128 x 128 blocks split the tiny model's 32-row w13 halves: dequantized either way.
    assert got == [("bf16", "gemv16"), ("bf16", "torch"),
                   ("fp8-channel", "qgemv"), ("fp8-channel", "dequantize"),
                   ("w4a16-gptq", "qgemv"), ("w4a16-gptq", "dequantize"),
                   ("fp8-block", "dequantize"), ("fp8-block", "dequantize"),
                   ("nvfp4", "qgemv"), ("nvfp4", "dequantize"),
                   ("mxfp4", "qgemv"), ("mxfp4", "dequantize"),
                   ("w4a16-gptq-act", "qgemv"), ("w4a16-gptq-act", "dequantize")]
    fp8 = 3 * H * N + (2 * N + H) * 4                   # codes, f32 per-row scales
    gptq = (3 * H * N // 2 + (2 * N // 8 + H // 8) * 4    # words; one group: packed zeros
            + (2 * N + H) * 2 + (2 * H + N) * 4)          # f16 scales, int32 g_idx
    blocks = 3 * H * N + (2 + 1) * 4                    # one 128 x 128 block per half / w2
    nvfp4 = 3 * H * N // 2 + 3 * H * N // 16 + (2 + 1) * 4   # codes, e4m3 per 16, f32 globals
    mxfp4 = 3 * H * N // 2 + 3 * H * N // 32                  # codes, e8m0 per 32
    bf16 = 3 * H * N * 2
    assert [r["expert_bytes"] for r in rows] == [bf16, bf16, fp8, fp8, gptq, gptq, blocks, blocks,
                                                 nvfp4, nvfp4, mxfp4, mxfp4, gptq, gptq]
    for r in rows:
        assert r["cpu_1_token_ms"] > 0 and r["decision_us"] > 0


def test_the_exp12_row_reads_the_planes(capsys, monkeypatch):
    """bf16-exp12: the bf16 experts as exp12 planes through gemv16_exp12 (one row, with or
    without --dequantize-too); its bytes are the planes' (less than bf16's, more than 0.7 of
    them on random weights), and its CPU time was spent in gemv16_exp12."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_experts
    from vllm.platforms import native_kernels
    if not native_kernels(torch.float32, torch.device("cpu")):
        pytest.skip("the CPU kernels are not built")
    calls = []
    real = host_experts.gemv16_exp12
    monkeypatch.setattr(host_experts, "gemv16_exp12", lambda x, w: calls.append(w.shape) or
                        real(x, w))
    threads = torch.get_num_threads()
    try:
        rows = bench.main(["--shape", "tiny", "--scheme", "bf16", "bf16-exp12",
                           "--dequantize-too", "--repeats", "1", "--json"])
    finally:
        torch.set_num_threads(threads)
    assert [(r["scheme"], r["path"]) for r in rows] == [
        ("bf16", "gemv16"), ("bf16", "torch"), ("bf16-exp12", "gemv16_exp12")]
    assert 0.7 < rows[2]["expert_bytes"] / rows[0]["expert_bytes"] < 1
    assert (64, 64) in calls and (64, 32) in calls       # w13 [2N, H], w2 [H, N]
    assert rows[2]["cpu_1_token_ms"] > 0 and rows[2]["ram_copy_ms"] > 0
