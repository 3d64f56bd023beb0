"""Replay benchmark CLI and the Belady reference, on small synthetic traces."""
import functools
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from residency_cases import plain_lru

from vllm.model_executor.layers.fused_moe.expert_cache.belady import belady_layer
from vllm.model_executor.layers.fused_moe.expert_cache.policy import (DEFAULT_POLICY,
                                                                       policy_names)
from vllm.model_executor.layers.fused_moe.expert_cache.trace import RoutingTrace, save_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "benchmarks"))
import benchmark_expert_cache as bench  # noqa: E402


def _synthetic_trace(num_tokens=120, layers=2, num_experts=12, top_k=3, seed=0):
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(num_experts, 0.5), size=layers)   # skewed per layer
    experts = np.stack([[rng.choice(num_experts, top_k, replace=False, p=popularity[l])
                         for l in range(layers)] for _ in range(num_tokens)])
    offsets = np.array([0, 30, 55, 90, num_tokens])
    return RoutingTrace(experts.astype(np.uint8), offsets, {"num_experts": num_experts})


def test_cli_json_and_lru_against_plain_python(tmp_path, capsys):
    trace = _synthetic_trace()
    path = str(tmp_path / "t.npz")
    save_trace(path, trace)
    assert bench.main(["--trace", path, "--capacity", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == path and out["capacity"] == 5 and out["batch"] == 1
    assert out["default_policy"] == DEFAULT_POLICY
    assert {"lru", "lfu", "lfru", "lrfu", "belady"} <= set(out["hit_rate"])
    hits = misses = 0
    for layer in range(trace.num_layers):
        h, m = plain_lru([set(row) for row in trace.experts[:, layer].tolist()], 5)
        hits, misses = hits + h, misses + m
    assert out["hit_rate"]["lru"] == pytest.approx(hits / (hits + misses))
    assert all(out["hit_rate"]["belady"] >= v - 1e-12 for v in out["hit_rate"].values())


def test_cli_batch_table_and_bad_args(tmp_path, capsys):
    path = str(tmp_path / "t.npz")
    save_trace(path, _synthetic_trace(num_experts=12, top_k=3))
    # batch 3 x top-3 = up to 9 distinct > 4 slots: the replay has to split waves.
    assert bench.main(["--trace", path, "--capacity", "4", "--batch", "3", "--policy", "lru",
                       "auto", "--max-tokens", "80"]) == 0
    text = capsys.readouterr().out
    assert "batch 3" in text and "belady" in text and "(default)" in text
    with pytest.raises(ValueError, match="capacity 40 is invalid"):
        bench.main(["--trace", path, "--capacity", "40"])
    with pytest.raises(ValueError, match="'nope' is invalid"):
        bench.main(["--trace", path, "--capacity", "4", "--policy", "nope"])


def test_held_out_halves_partition_tokens(tmp_path):
    trace = _synthetic_trace()
    even, odd = (bench.select_sequences(trace, w) for w in ("even", "odd"))
    assert len(even.experts) + len(odd.experts) == len(trace.experts)
    assert np.array_equal(odd.experts[:25], trace.experts[30:55])


def _brute_force_min_misses(steps, capacity):
    """Exhaustive optimum over every eviction choice (waves as in the cache)."""
    @functools.lru_cache(maxsize=None)
    def best(t, resident):
        if t == len(steps):
            return 0
        need = steps[t]
        ordered = [e for e in need if e in resident] + [e for e in need if e not in resident]
        return _waves(t, resident, [ordered[i:i + capacity]
                                    for i in range(0, len(ordered), capacity)])

    def _waves(t, resident, waves):
        if not waves:
            return best(t + 1, resident)
        wave, rest = waves[0], waves[1:]
        misses = [e for e in wave if e not in resident]
        free = capacity - len(resident)
        evictable = sorted(x for x in resident if x not in wave)
        need_evict = max(0, len(misses) - free)
        options = []
        for victims in _combinations(evictable, need_evict):
            new = frozenset((set(resident) - set(victims)) | set(misses))
            options.append(len(misses) + _waves(t, new, rest))
        return min(options)

    return best(0, frozenset())


def _combinations(items, k):
    if k == 0:
        return [()]
    return [(items[i],) + rest for i in range(len(items))
            for rest in _combinations(items[i + 1:], k - 1)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity,top", [(2, 1), (3, 2), (2, 3)])
def test_belady_is_optimal_on_small_cases(seed, capacity, top):
    rng = random.Random(seed)
    steps = [tuple(sorted(rng.sample(range(5), rng.randint(1, top)))) for _ in range(12)]
    needed = np.zeros((len(steps), 5), dtype=bool)
    for t, s in enumerate(steps):
        needed[t, list(s)] = True
    hits, misses = belady_layer(needed, capacity)
    assert hits + misses == needed.sum()
    assert misses == _brute_force_min_misses(steps, capacity)


def test_sweep_reports_fractions_of_belady_and_the_worst_point(tmp_path, capsys):
    paths = []
    for seed, e in ((0, 16), (1, 12)):
        paths.append(str(tmp_path / f"t{seed}.npz"))
        save_trace(paths[-1], _synthetic_trace(num_experts=e, top_k=2, seed=seed))
    assert bench.main(["--sweep", "--trace", *paths, "--batch", "1", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # E=16, k=2: C in {2, 4, 8}; E=12, k=2: {2, 3, 4, 6}; two batches each.
    got = sorted((p["trace"], p["capacity"], p["batch"]) for p in out["points"])
    want = sorted([(paths[0], c, b) for c in (2, 4, 8) for b in (1, 2)]
                  + [(paths[1], c, b) for c in (2, 3, 4, 6) for b in (1, 2)])
    assert got == want
    policies = list(policy_names())                  # the default: every registered one
    for p in out["points"]:
        for pol in policies:
            assert p["of_belady"][pol] == pytest.approx(p["hit_rate"][pol] / p["hit_rate"]["belady"])
            assert p["of_belady"][pol] <= 1 + 1e-12
    for pol in policies:
        fr = [p["of_belady"][pol] for p in out["points"]]
        s = out["summary"]["policies"][pol]
        assert s["mean_of_belady"] == pytest.approx(sum(fr) / len(fr))
        assert s["worst_of_belady"] == min(fr)
        assert len(s["points_below_lru"]) == sum(
            p["hit_rate"][pol] < p["hit_rate"]["lru"] - 1e-12 for p in out["points"])
    best = max(policies, key=lambda q: out["summary"]["policies"][q]["worst_of_belady"])
    assert out["summary"]["best_worst"] == best
    assert bench.main(["--sweep", "--trace", paths[0], "--policy", "lru", "lrfu"]) == 0
    assert "best worst point" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--trace", *paths, "--capacity", "4"])      # several traces need --sweep


def test_bookkeeping_cli_runs_each_policy_step(capsys):
    """--bookkeeping needs no trace; it names the step each policy runs (no timing asserted)."""
    assert bench.main(["--bookkeeping", "--experts", "16", "--top-k", "2", "--iters", "2",
                       "--policy", "lrfu", "lrfu_next", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lrfu_next"]["step_impl"] == out["lrfu"]["step_impl"]   # both have a kernel_code
    assert set(out["lrfu"]) == {"step", "reference", "policy", "step_impl"}
    with pytest.raises(SystemExit):
        bench.main(["--capacity", "4"])            # no --trace and no --bookkeeping
