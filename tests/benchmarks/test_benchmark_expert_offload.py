"""benchmarks/benchmark_expert_offload.py on the tiny shape and a small made-up trace: every
design computes the same outputs (same forced routing), copies exactly misses x expert bytes
(+ prefetch loads), and hits as a replay of the trace through the same policy."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefetch_audit import brute_wanted
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
from vllm.model_executor.layers.fused_moe.expert_cache.trace import (RoutingTrace, interleave,
                                                                     save_trace, step_masks)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_expert_cache as replay_bench  # noqa: E402
import benchmark_expert_offload as bench  # noqa: E402
import offload_bounds  # noqa: E402

E, K, L = 8, 2, 3
CAPS, BATCHES = [2, 4], [1, 3]


def _trace(path: str) -> None:
    """12 sequences; each layer's experts follow the previous layer's (a shifted pick with
    noise), so the co-occurrence predictor has something to find."""
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 9, 12)
    rows = []
    popularity = np.linspace(2, 0.5, E) / np.linspace(2, 0.5, E).sum()
    for _ in range(int(lens.sum())):
        first = rng.choice(E, K, replace=False, p=popularity)
        layers = [first]
        for _ in range(L - 1):
            nxt = (layers[-1] + 1) % E if rng.random() < 0.7 else rng.choice(E, K, replace=False)
            layers.append(nxt)
        rows.append(layers)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    save_trace(path, RoutingTrace(np.array(rows, dtype=np.uint8), offsets,
                                  {"num_experts": E, "top_k": K}))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("offload") / "trace.npz")
    _trace(path)
    args = bench.parse_args(["--trace", path, "--shape", "tiny", "--dtype", "float32",
                             "--capacity", *map(str, CAPS), "--batch", *map(str, BATCHES)])
    return path, args, bench.run(args, keep_outputs=True, count=True)


def _rows(out, design, batch):
    return [r for r in out["rows"] if r["design"] == design and r["batch"] == batch]


def test_same_outputs_for_every_design(result):
    _, _, out = result
    for batch in BATCHES:
        rows = [r for r in out["rows"] if r["batch"] == batch]
        assert {r["design"] for r in rows} == set(bench.DESIGNS)
        # exp12 needs a platform with its copy kernel (test_offload_exp12.py runs it).
        refused = {r["design"]: r["status"] for r in rows if r["status"] != "ok"}
        exp12 = {d for d in bench.DESIGNS if d.endswith("+exp12")}
        assert set(refused) == exp12 and len(exp12) == 3
        assert all("exp12 copy kernel" in refused[d] for d in exp12)
        rows = [r for r in rows if r["status"] == "ok"]
        ref = rows[0]["_outputs"]
        assert len(ref) == len(interleave(bench.prepare_trace(result[0])[0].offsets, batch))
        for r in rows[1:]:
            assert all(torch.equal(a, b) for a, b in zip(ref, r["_outputs"])), r["design"]


def test_bytes_copied_are_misses_times_expert_bytes(result):
    _, _, out = result
    per_expert = out["shape"]["bytes_per_expert"]
    assert per_expert == 4 * (2 * 16 * 32 + 32 * 16)                  # f32 w13 + w2, tiny
    for r in out["rows"]:
        if r["status"] != "ok":
            continue
        if r["design"] in ("resident", "uva"):              # no slots
            assert r["bytes_copied"] == 0 and r["misses"] == 0
            continue
        loads = r.get("prefetch", {}).get("prefetch_loads", 0)
        assert r["bytes_copied"] == r["bytes_copied_counted"] == (r["misses"] + loads) * per_expert
        assert r["copy_gbps"] == pytest.approx(r["bytes_copied"] / r["seconds"] / 1e9)
        assert r["bound_s"] == pytest.approx(max(r["compute_s"],
                                                 r["bytes_copied"] / (out["bandwidth_gbps"] * 1e9)))


def test_hit_rates_equal_a_replay_through_the_same_policy(result):
    path, args, out = result
    trace = bench.prepare_trace(path)[0]
    for batch in BATCHES:
        masks = step_masks(trace, batch)
        needed = int(masks.sum())
        for design, policy in (("ours", out["policy"]), ("sync-lfru", "lfru")):
            for r in _rows(out, design, batch):
                rep = replay_bench.replay(masks, r["capacity"], policy, batch * K)
                assert (r["hits"], r["misses"]) == (rep.hits, rep.misses), (design, batch)
        for r in _rows(out, "ours+prefetch", batch):
            assert r["hits"] + r["misses"] == needed


def test_prefetch_recall_against_brute_force(result):
    path, _, out = result
    trace, fit = bench.prepare_trace(path)
    pred = bench.predict_next(trace, bench.fit_affinity(fit)).numpy()          # [T, L, K]
    for batch in BATCHES:
        steps = [row[row >= 0] for row in interleave(trace.offsets, batch)]
        for r in _rows(out, "ours+prefetch", batch):
            recalled = needed = 0
            for tokens in steps:
                for layer in range(1, L):
                    want = brute_wanted(pred[tokens, layer].tolist(), r["capacity"])
                    real = set(trace.experts[tokens, layer].ravel().tolist())
                    recalled, needed = recalled + len(want & real), needed + len(real)
            pf = r["prefetch"]
            assert (pf["prefetch_recalled"], pf["prefetch_needed"]) == (recalled, needed)
            assert pf["per_layer_recall"][0] is None
            assert pf["prefetch_wasted_bytes"] == pf["prefetch_wasted"] * \
                out["shape"]["bytes_per_expert"]


def test_cli_prints_one_json_object(result, tmp_path, capsys):
    path = result[0]
    out_file = tmp_path / "o.json"
    bench.main(["--trace", path, "--shape", "tiny", "--capacity", "2", "--batch", "2",
                "--designs", "resident", "ours", "--repeat", "2", "--json", "--out",
                str(out_file)])
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(out_file.read_text())
    assert {"trace", "sequences", "tokens", "layers", "device", "shape", "policy",
            "bandwidth_gbps", "bandwidth_what", "copy_engine_gbps", "copy_engine",
            "copy_engine_gbps_by_entries", "prefetch_predictor", "rows"} <= set(out)
    assert "partial" not in out and out["copy_engine_gbps"] > 0
    by_entries = out["copy_engine_gbps_by_entries"]
    assert list(by_entries) == ["1", "2", "4", "8"] and all(v > 0 for v in by_entries.values())
    assert [r["design"] for r in out["rows"]] == ["resident", "ours"]
    row = out["rows"][1]
    assert {"design", "capacity", "batch", "status", "tokens", "seconds", "tok_s", "hit_rate",
            "hits", "misses", "bytes_copied", "copy_gbps", "link_bytes", "link_gbps",
            "compute_s", "bound_s",
            "bound_tok_s", "seconds_over_bound"} <= set(row)
    assert row["tok_s"] == pytest.approx(row["tokens"] / row["seconds"])
    assert len(row["all_seconds"]) == 2 and row["seconds"] == max(row["all_seconds"])  # median


def test_every_timed_job_is_warmed_up_first(result, monkeypatch):
    """Each (batch, design, capacity) runs two untimed steps right before its first timed
    round, so no row's seconds include a kernel's first compile (the fused residency step
    specializes on the capacity), and a run cut short has written the rows before."""
    path, args, _ = result
    calls = []
    real = bench.run_design

    def spy(setup, design, capacity, batch, policy, keep_outputs=False, count=False,
            max_steps=None, use_graphs=False):
        calls.append((batch, design, capacity, max_steps))
        return real(setup, design, capacity, batch, policy, keep_outputs, count, max_steps,
                    use_graphs)
    monkeypatch.setattr(bench, "run_design", spy)
    args = bench.parse_args(["--trace", path, "--shape", "tiny", "--dtype", "float32",
                             "--capacity", "2", "4", "--batch", "3", "--designs", "resident",
                             "ours", "--repeat", "2"])
    bench.run(args)
    jobs = [(3, "resident", None), (3, "ours", 2), (3, "ours", 4)]
    assert calls == [c for j in jobs for c in ((*j, 2), (*j, None))] + \
        [(*j, None) for j in jobs]


def test_link_bytes_per_design(result):
    """Cached designs: the bytes copied; resident: 0; uva: each (step, layer)'s distinct experts
    x expert bytes (the trace's step masks), which is ours' lookups; the bound uses them."""
    path, _, out = result
    trace, per_expert = bench.prepare_trace(path)[0], out["shape"]["bytes_per_expert"]
    bandwidth = out["bandwidth_gbps"] * 1e9
    for batch in BATCHES:
        needed = int(step_masks(trace, batch).sum())
        for r in [r for r in out["rows"] if r["batch"] == batch and r["status"] == "ok"]:
            want = {"resident": 0, "uva": needed * per_expert}.get(r["design"], r["bytes_copied"])
            assert r["link_bytes"] == want, r["design"]
            assert r["link_gbps"] == pytest.approx(want / r["seconds"] / 1e9)
            assert r["bound_s"] == pytest.approx(max(r["compute_s"], want / bandwidth))
        [uva], ours = _rows(out, "uva", batch), _rows(out, "ours", batch)
        assert uva["link_bytes"] > 0 and uva["bytes_copied"] == uva["misses"] == 0
        assert all(uva["link_bytes"] == (r["hits"] + r["misses"]) * per_expert for r in ours)


def test_timed_loop_reads_no_routing_from_the_host(result, monkeypatch):
    """Every step's ids and predictions are indexed and uploaded before the clock starts."""
    path = result[0]
    trace, fit = bench.prepare_trace(path)
    setup = bench.Setup(trace, "tiny", torch.float32, "cpu", 3)
    setup.affinity_pred = bench.predict_next(trace, bench.fit_affinity(fit))
    timing, reads = [False], []

    class Clock:
        @staticmethod
        def perf_counter():
            timing[0] = not timing[0]           # run_design reads it at start, then at the end
            return 0.0 if timing[0] else 1.0

    class Guard:
        def __init__(self, t):
            self.t = t

        def __getitem__(self, key):
            reads.append(timing[0])
            return self.t[key]
    setup.ids, setup.affinity_pred = Guard(setup.ids), Guard(setup.affinity_pred)
    monkeypatch.setattr(bench, "time", Clock)
    row = bench.run_design(setup, "ours+prefetch", 2, 3, "auto")
    steps = len(setup.steps(3))
    assert row["status"] == "ok" and len(reads) == 2 * steps and not any(reads)


def test_copy_engine_times_a_full_plan(result, monkeypatch):
    """measure_copy_engine runs the provider's engine (named as select_copy picks it) on
    experts 0..E-1 into slots 0..E-1."""
    setup = bench.Setup(bench.prepare_trace(result[0])[0], "tiny", torch.float32, "cpu", 1)
    real = offload_bounds.select_copy
    gbps, name = offload_bounds.measure_copy_engine(setup.store, setup.device, 0.01)
    assert gbps > 0 and name.startswith(type(real(setup.store, setup.device)).__name__)
    calls = []

    def spy(store, device):
        engine = real(store, device)
        return lambda slots, plan: (calls.append((slots, plan)), engine(slots, plan))
    monkeypatch.setattr(offload_bounds, "select_copy", spy)
    offload_bounds.measure_copy_engine(setup.store, setup.device, 0.01)
    slots, plan = calls[-1]
    assert len(calls) >= 2                                  # an untimed call, then timed ones
    assert plan.experts.tolist() == plan.slots.tolist() == list(range(E)) and plan.valid.all()
    assert all(torch.equal(slots[n], t) for n, t in setup.store.tensors.items())


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_copy_engine_on_a_plan_of_k_entries(result, monkeypatch, k):
    """measure_copy_engine(entries=k): plans of max(k, min(E, 8)) entries, the first k valid
    (padding -1), each call copying exactly k experts into slots 0..k-1 (the other slots stay
    zero) and the next k experts each call; bytes per second counts k experts per call (a fake
    clock: 1 s per reading)."""
    setup = bench.Setup(bench.prepare_trace(result[0])[0], "tiny", torch.float32, "cpu", 1)
    store, real, calls = setup.store, offload_bounds.select_copy, []

    def spy(store, device):
        engine = real(store, device)
        return lambda slots, plan: (engine(slots, plan), calls.append(
            ({n: t.clone() for n, t in slots.items()}, plan)))       # the slots after the call
    clock = iter(range(10 ** 6))
    monkeypatch.setattr(offload_bounds, "select_copy", spy)
    monkeypatch.setattr(offload_bounds, "time", SimpleNamespace(
        perf_counter=lambda: float(next(clock))))
    gbps, _ = offload_bounds.measure_copy_engine(store, setup.device, 0.5, entries=k)
    per_pass = -(-E // k)                                   # plans r*k .. r*k+k-1 (mod E)
    assert len(calls) == 1 + per_pass                       # an untimed call, then one pass
    assert gbps == (len(calls) - 1) * k * store.bytes_per_expert      # elapsed = 1 "second"
    seen = []
    for slots, plan in calls:
        assert plan.valid.tolist() == [i < k for i in range(8)]
        assert plan.slots.tolist() == list(range(k)) + [-1] * (8 - k)
        assert plan.experts[k:].tolist() == [-1] * (8 - k)
        seen += plan.experts[:k].tolist()
        for name, src in store.tensors.items():
            assert torch.equal(slots[name][:k], src[plan.experts[:k]])    # exactly k copied
            assert not slots[name][k:].any()
    assert set(seen) == set(range(E)) and len(set(seen[:k])) == k


def test_copy_engine_by_entries_times_1_2_4_8_and_e(result, monkeypatch):
    """One measurement per valid-entry count, 1, 2, 4, 8 up to E and E itself, keyed by the
    count (E=8 here; a 6-expert store: 1, 2, 4, 6); a plan without a valid entry is refused."""
    setup = bench.Setup(bench.prepare_trace(result[0])[0], "tiny", torch.float32, "cpu", 1)
    entries = []
    real = offload_bounds.measure_copy_engine
    monkeypatch.setattr(offload_bounds, "measure_copy_engine", lambda s, d, t, k: (
        entries.append((k, t)), real(s, d, t, k))[1])
    got = offload_bounds.measure_copy_engine_by_entries(setup.store, setup.device, 0.01)
    assert list(got) == ["1", "2", "4", "8"] and all(v > 0 for v in got.values())
    assert entries == [(1, 0.01), (2, 0.01), (4, 0.01), (8, 0.01)]
    six = HostStore.from_experts({"w": torch.arange(6 * 4.0).reshape(6, 4)}, dict, None)
    entries.clear()
    assert list(offload_bounds.measure_copy_engine_by_entries(six, setup.device, 0.01)) == [
        "1", "2", "4", "6"] and [k for k, _ in entries] == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="invalid"):
        offload_bounds.entries_plans(E, 0, 8, setup.device)


def test_out_is_rewritten_after_every_row(result, tmp_path, monkeypatch):
    """--out holds the rows so far ("partial": true) after each timed row; a run cut short
    keeps them; the final write has no "partial"."""
    path, out_file = result[0], tmp_path / "o.json"
    argv = ["--trace", path, "--shape", "tiny", "--capacity", "2", "--batch", "2",
            "--designs", "resident", "uva", "ours", "--repeat", "2", "--out", str(out_file)]
    writes = []
    real_write = bench.write_json
    monkeypatch.setattr(bench, "write_json", lambda p, obj: (writes.append(json.loads(
        json.dumps(obj))), real_write(p, obj)))
    final = bench.main(argv + ["--json"])
    assert [len(w["rows"]) for w in writes] == [1, 2, 3, 3, 3, 3, 3]
    assert all(w["partial"] is True for w in writes[:-1]) and "partial" not in writes[-1]
    assert json.loads(out_file.read_text()) == writes[-1] == json.loads(json.dumps(final))
    assert [len(r["all_seconds"]) for r in writes[2]["rows"]] == [1, 1, 1]
    assert all("link_gbps" in r and "bound_s" in r for r in writes[0]["rows"])

    real_run, timed = bench.run_design, []

    def cut(*a, max_steps=None, **k):       # the second timed row never finishes
        if max_steps is None:
            timed.append(1)
            if len(timed) == 2:
                raise KeyboardInterrupt
        return real_run(*a, max_steps=max_steps, **k)
    monkeypatch.setattr(bench, "run_design", cut)
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    kept = json.loads(out_file.read_text())
    assert kept["partial"] is True and [r["design"] for r in kept["rows"]] == ["resident"]


def test_cpu_compute_design_serves_misses_on_the_cpu(result, monkeypatch):
    """ours+cpu with a made-up cost model (one copy costs about three CPU calls): a missing
    expert runs on the CPU until the CPU has spent a copy's worth on it, then it is copied; the
    outputs stay bitwise the resident design's (the CPU device runs one kernel), every needed
    (step, layer, expert) is a hit, a miss or a CPU call, and only misses copy."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_compute, provider
    path, _, out = result
    cheap = host_compute.HostCostModel(copy_seconds=3.5e-3, cpu_fixed=1e-3, cpu_per_token=0)
    monkeypatch.setattr(provider, "cost_model_for", lambda *a, **k: cheap)
    args = bench.parse_args(["--trace", path, "--shape", "tiny", "--dtype", "float32",
                             "--capacity", "2", "--batch", "1", "3", "--designs", "resident",
                             "ours+cpu"])
    rows = bench.run(args, keep_outputs=True, count=True)["rows"]
    trace = bench.prepare_trace(path)[0]
    per_expert = out["shape"]["bytes_per_expert"]
    for batch in (1, 3):
        (ref,), (cpu,) = (_rows({"rows": rows}, d, batch) for d in ("resident", "ours+cpu"))
        assert all(torch.equal(a, b) for a, b in zip(ref["_outputs"], cpu["_outputs"]))
        needed = int(step_masks(trace, batch).sum())
        assert cpu["cpu_expert_calls"] > 0 and cpu["cpu_pairs"] >= cpu["cpu_expert_calls"]
        assert cpu["misses"] > 0 and cpu["hits"] > 0
        assert cpu["hits"] + cpu["misses"] + cpu["cpu_expert_calls"] == needed
        assert cpu["bytes_copied"] == cpu["bytes_copied_counted"] == cpu["misses"] * per_expert
        assert cpu["cpu_cost"]["copy_seconds"] == 3.5e-3 and not cpu["cpu_cost"]["concurrent"]


def test_a_given_cpu_cost_is_used_as_a_gpu_hosts(result, monkeypatch):
    """--cpu-cost: ours+cpu takes the given cost model (nothing measured) with the copies beside
    the CPU; the CPU is slower than a copy here (1.2 against 1.0 ms), so ski rental alone rents
    nothing and every CPU call is ``balance``'s. Outputs stay bitwise the resident design's."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_compute, provider

    def no_measuring(*a, **k):
        raise AssertionError("measured a cost model although --cpu-cost gave one")
    monkeypatch.setattr(provider, "cost_model_for", no_measuring)
    monkeypatch.setattr(host_compute, "measure_cost_model", no_measuring)
    path, _, _ = result
    args = bench.parse_args(["--trace", path, "--shape", "tiny", "--dtype", "float32",
                             "--capacity", "2", "--batch", "1", "--designs", "resident",
                             "ours+cpu", "--cpu-cost", "1.0", "1.2", "0"])
    out = bench.run(args, keep_outputs=True)
    assert out["cpu_cost_given"] == {"copy_seconds": 1e-3, "cpu_fixed": 1.2e-3,
                                     "cpu_per_token": 0.0, "concurrent": True}
    (ref,), (cpu,) = (_rows(out, d, 1) for d in ("resident", "ours+cpu"))
    assert all(torch.equal(a, b) for a, b in zip(ref["_outputs"], cpu["_outputs"]))
    assert cpu["cpu_cost"] == out["cpu_cost_given"] and "cpu_cost" not in ref
    trace = bench.prepare_trace(path)[0]
    assert cpu["cpu_expert_calls"] > 0 and cpu["misses"] > 0
    assert cpu["hits"] + cpu["misses"] + cpu["cpu_expert_calls"] == int(step_masks(trace, 1).sum())
    # Each (layer, step) waits max(copies x 1.0, CPU calls x 1.2) ms: at least the larger of
    # the totals spread evenly, at most their sum.
    copies, calls = cpu["misses"] * 1e-3, cpu["cpu_expert_calls"] * 1.2e-3
    steps = len(interleave(trace.offsets, 1)) * trace.num_layers
    wait = cpu["modelled_wait_seconds"]
    assert max(copies, calls, (copies + calls) / 2) - 1e-9 <= wait <= copies + calls + 1e-9
    assert wait <= steps * 2.4e-3 + 1e-9            # never more than two CPU calls per step
    assert "modelled_wait_seconds" not in ref


@pytest.mark.parametrize("bad", [["0", "1", "0"], ["1", "-1", "0"], ["1", "1", "-0.5"]])
def test_bad_cpu_costs_are_refused(result, bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--trace", result[0], "--cpu-cost", *bad])
    err = capsys.readouterr().err
    assert f"--cpu-cost {[float(v) for v in bad]} is invalid" in err, err


def test_the_table_prints_the_cost_model_and_the_modelled_wait(result, capsys):
    bench.main(["--trace", result[0], "--shape", "tiny", "--dtype", "float32", "--capacity", "2",
                "--batch", "1", "--designs", "ours", "ours+cpu", "--cpu-cost", "1", "1.2", "0"])
    out = capsys.readouterr().out
    assert "ours+cpu C=2 batch 1: " in out and "cost model: copy 1.000 ms, CPU 1.200 + 0.000 ms" \
        in out and "(concurrent True)" in out
    assert out.count("modelled wait for misses") == 2
