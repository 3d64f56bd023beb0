"""benchmarks/benchmark_moe_layer.py on CPU, eager and ``--graphs`` (the capturer's eager
stand-in): one row per (slot count, token count, routing), the all-hits routing really hitting
everywhere at every slot count, the cache's counters per timed forward, the profile's kernel
lists, and --slots' checks. No timing assertions."""
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


@pytest.mark.parametrize("extra", [[], ["--graphs"]])
def test_one_cached_layer_per_slot_count(extra, keep_threads, capsys):
    """--slots 2 3 (4 experts, top-2): rows per (slots, tokens, routing); all-hits routes among
    the first N experts only, so it hits everywhere at both counts (one wave); --slots 1 < top_k
    has no all-hits row (said on stderr), its random rows stay."""
    argv = ["--num-experts", "4", "--top-k", "2", "--tokens", "1", "3", "--iters", "4", "--json"]
    rows = bench.main(argv + extra + ["--slots", "2", "3", "1"])
    assert [(r["slots"], r["tokens"], r["routing"]) for r in rows] == [
        (n, t, routing) for n in (2, 3) for t in (1, 3) for routing in ("all-hits", "random")
    ] + [(1, 1, "random"), (1, 3, "random")]
    assert "all-hits skipped at --slots 1: top_k=2 > 1" in capsys.readouterr().err
    for r in rows:
        if r["routing"] == "all-hits":
            assert r["hit_rate"] == 1.0 and r["waves_per_forward"] == 1.0


def test_all_hits_routes_among_the_first_n_experts():
    args = bench.parse_args(["--num-experts", "6", "--top-k", "2", "--iters", "3"])
    assert args.slots == [5]                                       # default E-1
    for n in (2, 5):
        for x, logits in bench.make_inputs(args, 4, "all-hits", n, torch.float32):
            assert x.shape == (4, 32) and torch.isfinite(logits[:, :n]).all()
            assert (logits[:, n:] == float("-inf")).all()
    a, b = (bench.make_inputs(args, 4, "all-hits", n, torch.float32) for n in (2, 5))
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))   # same inputs at every N
    assert torch.isfinite(bench.make_inputs(args, 4, "random", 2, torch.float32)[0][1]).all()


@pytest.mark.parametrize("bad", ["0", "8", "9"])
def test_slot_counts_outside_1_to_e_minus_1_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--num-experts", "8", "--slots", "3", bad])
    assert f"--slots {bad} is invalid: each slot count must be in [1, 7]" in \
        capsys.readouterr().err


def test_too_few_iterations_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--iters", "2"])
    assert "--iters 2: at least 3" in capsys.readouterr().err
