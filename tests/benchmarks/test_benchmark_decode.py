"""benchmarks/benchmark_decode.py on the tiny preset on CPU: one JSON object with a row per (cache
size, batch), the same greedy tokens at every cache size, cache counters that add up; and the big
presets' shape arithmetic (--dry-run: nothing built). No timing assertions."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_decode as bench  # noqa: E402

SIZES, BATCHES, OUTPUT_LEN = [0, 8, 4, 2], [1, 3], 6


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode")
    out_file = tmp / "out.json"
    argv = ["--random-model", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch",
            *map(str, BATCHES), "--moe-expert-cache-size", *map(str, SIZES), "--output-len",
            str(OUTPUT_LEN), "--prompt-len", "5", "--checkpoint", str(tmp / "ckpt"), "--json",
            "--out", str(out_file)]
    return bench.main(argv), out_file, argv


def test_json_fields_and_rows(result, capsys):
    out, out_file, _ = result
    assert json.loads(out_file.read_text()) == out
    assert {"preset", "shape", "device", "device_name", "dtype", "prompt_len", "output_len",
            "batches", "cache_sizes", "rows", "tokens_identical", "all_tokens_identical",
            "checkpoint", "build_seconds", "threads"} <= set(out)
    assert out["device"] == "cpu" and out["dtype"] == "float32" and out["device_name"]
    assert [(r["moe_expert_cache_size"], r["batch"]) for r in out["rows"]] == [
        (n, b) for n in SIZES for b in BATCHES]
    for r in out["rows"]:
        assert r["decode_tokens"] == r["batch"] * (OUTPUT_LEN - 1)     # first token: prefill
        assert r["decode_steps"] == OUTPUT_LEN - 1 and r["decode_seconds"] > 0
        assert r["tok_s"] == pytest.approx(r["decode_tokens"] / r["decode_seconds"])


def test_tokens_identical_across_cache_sizes(result):
    out = result[0]
    assert out["tokens_identical"] == {str(b): True for b in BATCHES}
    assert out["all_tokens_identical"] is True
    assert all(r["tokens_match_first_size"] is True for r in out["rows"])


def test_rows_say_whether_graphs_replayed(result):
    """CPU graphs here (not --enforce-eager): every row names the kind and its captured sizes;
    a cached layer that leaves the graphs would show in ``refused``."""
    for r in result[0]["rows"]:
        g = r["graphs"]
        assert g["kind"] == "DecodeGraphs" and g["refused"] is None, g
        assert isinstance(g["captured_sizes"], list)
    out = bench.main(["--random-model", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch",
                      "1", "--moe-expert-cache-size", "0", "--output-len", "2", "--checkpoint",
                      result[2][result[2].index("--checkpoint") + 1], "--enforce-eager",
                      "--json"])
    assert out["rows"][0]["graphs"] == {"kind": None, "captured_sizes": [],
                                        "refused": "enforce_eager"}


def test_cache_counters(result):
    """N = 0 and N = E (8) run without a cache; N < E counts hits and misses over the decode
    steps, and copies exactly misses x one expert's bytes."""
    out = result[0]
    shape = out["shape"]
    assert (shape["num_experts"], shape["top_k"], shape["moe_layers"]) == (8, 2, 2)
    assert shape["bytes_per_expert"] == 3 * 64 * 32 * 4
    for r in out["rows"]:
        active = 0 < r["moe_expert_cache_size"] < shape["num_experts"]
        assert r["cache_active"] is active
        if not active:
            assert r["hit_rate"] is None and r["bytes_copied"] == 0
            continue
        lookups = r["hits"] + r["misses"]
        assert lookups >= r["decode_steps"] * shape["moe_layers"]
        assert r["hit_rate"] == pytest.approx(r["hits"] / lookups)
        assert r["bytes_copied"] == r["misses"] * shape["bytes_per_expert"]
        assert r["copy_gbps"] == pytest.approx(r["bytes_copied"] / r["decode_seconds"] / 1e9)


def test_checkpoint_is_reused(result, capsys):
    argv = result[2]
    ckpt = argv[argv.index("--checkpoint") + 1]
    out = bench.main(["--random-model", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch",
                      "2", "--moe-expert-cache-size", "0", "--output-len", "3", "--checkpoint",
                      ckpt, "--json"])
    assert out["checkpoint_reused"] and not result[0]["checkpoint_reused"]
    with pytest.raises(ValueError, match=r"holds another model: .*'dtype': \('float32', "
                                         r"'bfloat16'\)"):
        bench.main(["--random-model", "tiny", "--device", "cpu", "--dtype", "bf16",
                    "--checkpoint", ckpt])


@pytest.mark.parametrize("preset,per_expert,moe_layers,experts", [
    ("probe-4.8g", 3 * 2048 * 768 * 2, 8, 64), ("dsv2-lite", 3 * 2048 * 1408 * 2, 26, 64)])
def test_dry_run_shapes(preset, per_expert, moe_layers, experts, capsys):
    out = bench.main(["--random-model", preset, "--dry-run", "--json"])
    assert set(out) == {"preset", "shape"}                            # nothing built or run
    sh = out["shape"]
    assert (sh["bytes_per_expert"], sh["moe_layers"], sh["num_experts"]) == (
        per_expert, moe_layers, experts)
    assert sh["expert_bytes"] == per_expert * moe_layers * experts
    assert sh["expert_bytes"] < sh["checkpoint_bytes"] < 1.1 * sh["expert_bytes"]
    assert json.loads(capsys.readouterr().out) == out


def test_probe_is_4_8_gigabytes_of_9_4_megabyte_experts():
    sh = bench.main(["--random-model", "probe-4.8g", "--dry-run"])["shape"]
    assert round(sh["bytes_per_expert"] / 1e6, 1) == 9.4
    assert round(sh["expert_bytes"] / 1e9, 1) == 4.8


@pytest.mark.parametrize("argv,match", [
    (["--random-model", "huge"], "--random-model 'huge' is invalid"),
    (["--random-model", "tiny", "--batch", "0"], r"--batch \[0\] is invalid"),
    (["--random-model", "tiny", "--moe-expert-cache-size", "-1"], "every value must be >= 0"),
    (["--random-model", "tiny", "--output-len", "0"], "--output-len 0 is invalid"),
    (["--random-model", "tiny", "--profile-trace-dir", "t"], "--profile-trace-dir needs "
                                                              "--profile-steps"),
    (["--random-model", "tiny", "--unrouted-experts", "-1"], "--unrouted-experts -1 is invalid")])
def test_bad_arguments_name_the_value(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


def test_profile_steps_count_what_a_decode_step_dispatches(tmp_path):
    """--profile-steps: per row, K decode steps under torch.profiler; on CPU no CUDA launch, some
    aten ops per step; the wall time per step is positive."""
    out = bench.main(["--random-model", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch",
                      "2", "--moe-expert-cache-size", "0", "4", "--output-len", "3",
                      "--prompt-len", "4", "--checkpoint", str(tmp_path / "ckpt"), "--json",
                      "--profile-steps", "3", "--enforce-eager",
                      "--profile-trace-dir", str(tmp_path / "traces")])
    for r in out["rows"]:
        p = r["profile"]
        assert p["steps"] == 3 and p["launches_per_step"] == 0 == p["graph_launches_per_step"]
        assert p["gpu_kernels_per_step"] == 0 and p["torch_ops_per_step"] > 10
        assert p["wall_ms_per_step"] > 0 and p["gpu_span_ms_per_step"] is None
        assert p["gpu_gaps"] is None
        # the cache's bytes over the profiled steps (none without a cache); no kernel on CPU
        assert ("bytes_copied" in p) == (r["moe_expert_cache_size"] > 0)
        assert p.get("gather_gbps") is None and p["gather_ms_per_step"] == 0
        trace = tmp_path / "traces" / f"decode-n{r['moe_expert_cache_size']}-b2.json"
        assert '"traceEvents"' in trace.read_text()[:4096]


def test_profile_summary_counts_launches():
    """The per-step arithmetic on stand-in profiler events."""
    from types import SimpleNamespace

    import torch
    from decode_profile import summarize
    cuda = torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(key="cudaLaunchKernel", count=30),
              SimpleNamespace(key="cuLaunchKernel", count=10),
              SimpleNamespace(key="cudaGraphLaunch", count=4),
              SimpleNamespace(key="aten::mm", count=8),
              SimpleNamespace(key="gemm_kernel", count=12, device_type=cuda,
                              self_device_time_total=2000.0),
              SimpleNamespace(key="Memcpy HtoD (Pinned -> Device)", count=8, device_type=cuda,
                              self_device_time_total=400.0)]
    got = summarize(events, steps=4, wall_s=0.01)
    assert got["launches_per_step"] == 10 and got["graph_launches_per_step"] == 1
    assert got["torch_ops_per_step"] == 2 and got["gpu_kernels_per_step"] == 3
    assert got["gpu_busy_ms_per_step"] == 0.5 and got["gpu_busy_fraction"] == 0.2
    assert got["gpu_copies_per_step"] == 2 and got["gpu_copy_ms_per_step"] == 0.1
    # Device activities by time per step; host-side events are not among them.
    assert got["kernels"] == [
        {"name": "gemm_kernel", "per_step": 3, "us_per_step": 500.0, "us_each": 2000 / 12},
        {"name": "Memcpy HtoD (Pinned -> Device)", "per_step": 2, "us_per_step": 100.0,
         "us_each": 50.0}]


def test_profile_summary_times_the_miss_copies_by_their_kernels():
    """The gather kernels' device time, and the bytes the cache copied over the profiled steps
    over it: 94 MB in 2 ms of copy kernels is 47 GB/s, whatever else ran."""
    from types import SimpleNamespace

    import torch
    from decode_profile import summarize
    cuda = torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(key="gemm_kernel", count=12, device_type=cuda,
                              self_device_time_total=3000.0),
              SimpleNamespace(key="void vllm::(anonymous namespace)::expert_gather_many_kernel"
                              "(vllm::(anonymous namespace)::GatherBatch, long const*)", count=8,
                              device_type=cuda, self_device_time_total=1500.0),
              SimpleNamespace(key="_expert_gather_kernel", count=4, device_type=cuda,
                              self_device_time_total=500.0)]
    got = summarize(events, steps=4, wall_s=0.01, bytes_copied=94_000_000)
    assert got["gather_ms_per_step"] == 0.5 and got["bytes_copied"] == 94_000_000
    assert got["gather_gbps"] == 47.0
    plain = summarize(events, steps=4, wall_s=0.01)
    assert "gather_gbps" not in plain and plain["gather_ms_per_step"] == 0.5
    assert summarize(events[:1], 4, 0.01, bytes_copied=0)["gather_gbps"] is None


def test_profile_kernels_are_cut_to_the_largest_and_ordered_by_time():
    from types import SimpleNamespace

    import torch
    from decode_profile import TOP_KERNELS, summarize
    cuda = torch.autograd.DeviceType.CUDA
    long = "k" * 5000                          # a C++ template name
    events = [SimpleNamespace(key=f"{long}{i:03d}", count=1, device_type=cuda,
                              self_device_time_total=float(i % 7)) for i in range(40)]
    got = summarize(events, steps=1, wall_s=1.0)["kernels"]
    assert len(got) == TOP_KERNELS and all(len(k["name"]) <= 100 for k in got)
    times = [k["us_per_step"] for k in got]
    assert times == sorted(times, reverse=True) and times[0] == 6.0


def test_device_span_runs_from_the_first_device_event_to_the_last():
    from types import SimpleNamespace

    import torch
    from decode_profile import device_span_ms
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(device, start, end):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start,
                                                                              end=end))
    events = [event(cpu, 0, 50_000), event(cuda, 1_000, 2_000), event(cuda, 7_000, 9_000),
              event(cuda, 4_000, 5_000)]
    assert device_span_ms(events, steps=2) == 4.0            # (9000 - 1000) us over 2 steps
    assert device_span_ms([event(cpu, 0, 10)], steps=1) is None


def test_device_gaps_merge_the_streams_and_name_the_activity_around_each():
    """Idle time on one device timeline: overlapping events (a copy on a side stream beside a
    GEMM) leave no gap; each gap names the activity that ended last before it and the next."""
    from types import SimpleNamespace

    import torch
    from decode_profile import TOP_GAPS, device_gaps
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start, end=end))
    events = [event("host", 0, 90_000, cpu), event("norm", 1_000, 1_010),
              event("gemm", 1_020, 1_100), event("gather", 1_030, 1_200),    # beside gemm
              event("residency", 1_250, 1_260), event("logits", 1_300, 1_310),
              event("norm", 2_000, 2_010)]
    got = device_gaps(events, steps=2)
    # gaps: 10 (norm -> gemm), 50 (gather -> residency), 40, 690 (logits -> next step's norm)
    assert got["idle_ms_per_step"] == (10 + 50 + 40 + 690) / 1e3 / 2
    assert got["largest"][:2] == [{"us": 690, "after": "logits", "before": "norm"},
                                  {"us": 50, "after": "gather", "before": "residency"}]
    assert len(got["largest"]) == 4 <= TOP_GAPS
    assert device_gaps([event("host", 0, 1, cpu)], steps=1) is None


def test_a_run_cut_short_keeps_the_rows_it_measured(result, monkeypatch, tmp_path):
    """--out is rewritten after every row (marked partial), so a GPU session's command that
    times out mid-run still returns its figures; the finished run's file has no mark."""
    argv = result[2]
    ckpt = argv[argv.index("--checkpoint") + 1]
    out_file = tmp_path / "cut.json"
    real_decode = bench.decode
    calls = []

    def decode_then_die(llm, prompts, n):
        calls.append(n)
        if len(calls) > 2:                       # warm-up and timed pass of the first row
            raise KeyboardInterrupt("cut")
        return real_decode(llm, prompts, n)

    monkeypatch.setattr(bench, "decode", decode_then_die)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--random-model", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch",
                    "1", "2", "--moe-expert-cache-size", "0", "4", "--output-len", "3",
                    "--checkpoint", ckpt, "--json", "--out", str(out_file)])
    kept = json.loads(out_file.read_text())
    assert kept["partial"] is True and kept["preset"] == "tiny" and kept["device"] == "cpu"
    assert [(r["moe_expert_cache_size"], r["batch"]) for r in kept["rows"]] == [(0, 1)]
    assert "partial" not in json.loads(result[1].read_text())


def test_cpu_compute_rows_keep_the_tokens_and_copy_nothing(result):
    """--moe-expert-cpu-compute always: every miss runs on the CPU (nothing copied), and on a
    CPU device the tokens equal the uncached engine's."""
    argv = result[2]
    ckpt = argv[argv.index("--checkpoint") + 1]
    out = bench.main(["--random-model", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch",
                      "2", "--moe-expert-cache-size", "0", "2", "--output-len", "3",
                      "--checkpoint", ckpt, "--moe-expert-cpu-compute", "always", "--json"])
    assert out["moe_expert_cpu_compute"] == "always" and out["all_tokens_identical"]
    cached = [r for r in out["rows"] if r["moe_expert_cache_size"] == 2]
    assert cached and all(r["bytes_copied"] == 0 and r["misses"] == 0 and r["cpu_pairs"] > 0
                          for r in cached)
    assert all("cpu_pairs" not in r for r in result[0]["rows"])
    assert all("cpu_cost" not in r for r in out["rows"])         # 'always' has no cost model


def test_auto_cpu_compute_rows_carry_the_measured_cost_model(result):
    argv = result[2]
    ckpt = argv[argv.index("--checkpoint") + 1]
    out = bench.main(["--random-model", "tiny", "--device", "cpu", "--dtype", "fp32", "--batch",
                      "1", "--moe-expert-cache-size", "0", "2", "--output-len", "2",
                      "--checkpoint", ckpt, "--moe-expert-cpu-compute", "auto", "--json"])
    (uncached,), (cached,) = ([r for r in out["rows"] if r["moe_expert_cache_size"] == n]
                              for n in (0, 2))
    assert "cpu_cost" not in uncached
    cost = cached["cpu_cost"]
    assert cost["copy_seconds"] > 0 and cost["cpu_fixed"] >= 0 and not cost["concurrent"]


def test_unrouted_experts_make_a_cache_of_the_rest_hit_on_every_access(tmp_path):
    """--unrouted-experts 1 on tiny-e32: the last expert's router rows are zero in the checkpoint,
    and a cache of 31 slots then serves the timed decode with no miss (after the slot-filling
    warm-up), with the uncached tokens; without the flag the same cache misses."""
    from safetensors import safe_open
    common = ["--random-model", "tiny-e32", "--device", "cpu", "--dtype", "fp32", "--batch",
              "2", "--moe-expert-cache-size", "0", "31", "--output-len", "6", "--prompt-len",
              "4", "--json"]
    out = bench.main(common + ["--unrouted-experts", "1", "--checkpoint", str(tmp_path / "u")])
    cached = next(r for r in out["rows"] if r["moe_expert_cache_size"] == 31)
    assert cached["cache_active"] and cached["hits"] > 0
    assert cached["misses"] == 0 and cached["hit_rate"] == 1.0
    assert out["all_tokens_identical"]
    routers = 0
    for shard in (tmp_path / "u").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if name.endswith("mlp.gate.weight"):
                    w = f.get_tensor(name)                        # [32, 64]
                    assert not w[31].any() and w[:31].abs().min() > 0
                    routers += 1
    assert routers == 2
    plain = bench.main(common + ["--checkpoint", str(tmp_path / "p")])
    assert next(r for r in plain["rows"] if r["moe_expert_cache_size"] == 31)["misses"] > 0
    with pytest.raises(ValueError, match=r"--unrouted-experts 31 is invalid for tiny-e32: at "
                                         r"most 30 \(E=32 experts, top 2 routed\)"):
        bench.main(["--random-model", "tiny-e32", "--unrouted-experts", "31", "--dry-run"])
    with pytest.raises(ValueError, match="holds another model"):
        bench.main(common + ["--checkpoint", str(tmp_path / "u")])   # built with 1 unrouted
