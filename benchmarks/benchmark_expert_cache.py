"""Replay a routing trace through the expert cache's own Residency + eviction policies.

    python benchmarks/benchmark_expert_cache.py --trace T.npz --capacity 16 [--policy lru ...]
        [--batch 8] [--sequences odd] [--max-tokens N] [--json]
    python benchmarks/benchmark_expert_cache.py --sweep --trace A.npz B.npz --batch 1 8 [--json]
    python benchmarks/benchmark_expert_cache.py --bookkeeping [--experts 64 --capacity 12 --top-k 6]

--sweep replays every trace at C in {top_k, 2 top_k, E/4, E/2} and every --batch, and reports each
policy's hit rate as a fraction of Belady's per point, with each policy's mean and worst fraction
(and where), the points where it falls below LRU, and the policy with the best worst point (how
the default is chosen: by the worst point, not the mean).

One plan() per layer per step (all layers of a step in one batched Residency, which is the same
code as the per-layer one), steps needing more than C experts split with the cache's split_waves.
Hit rate = hits / (hits + misses) over (layer, step, distinct needed expert). Belady (the offline
optimum, an independent implementation) is always reported.

--bookkeeping times one layer's residency step per policy on the CPU, as the engine runs it
(``select_residency_step``: the C kernel for policies with a kernel_code, else the torch
reference) and the policy's own torch calls alone (wave_keep_score + on_access).

The replay runs one torch thread: its ops are tiny, and a second OpenMP thread only waits on a
busy machine (the [L, E, E] tensors of lrfu_next cross the parallel grain size).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm.model_executor.layers.fused_moe.expert_cache.belady import belady_hit_rate
from vllm.model_executor.layers.fused_moe.expert_cache.policy import (DEFAULT_POLICY, get_policy,
                                                                       policy_names)
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency, split_waves
from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import (
    ReferenceStep, select_residency_step)
from vllm.model_executor.layers.fused_moe.expert_cache.trace import (RoutingTrace, load_trace,
                                                                     step_masks)


@dataclass
class ReplayResult:
    policy: str
    hits: int
    misses: int
    evictions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


def replay(masks: np.ndarray, capacity: int, policy: str, max_needed: int) -> ReplayResult:
    """masks [S, L, E] bool (experts needed per step and layer); max_needed: the static bound on
    distinct experts per step (batch * top_k), which fixes the wave count like the engine's T*k."""
    start = time.perf_counter()
    needed = torch.from_numpy(masks)
    res = Residency(masks.shape[2], capacity, get_policy(policy), layers=masks.shape[1])
    with torch.inference_mode():
        for step in needed:                                              # [L, E]
            for wave in split_waves(step, res.slot_of_expert, capacity, max_needed):
                res.plan(wave)
    return ReplayResult(policy, int(res.hits.sum()), int(res.misses.sum()),
                        int(res.evictions.sum()), time.perf_counter() - start)


def select_sequences(trace: RoutingTrace, which: str) -> RoutingTrace:
    """"all", or the "even"/"odd"-indexed sequences (the tuning / held-out halves)."""
    if which == "all":
        return trace
    first = {"even": 0, "odd": 1}.get(which)
    if first is None:
        raise ValueError(f"--sequences {which!r} is invalid: must be all, even or odd")
    return trace.subset(range(first, trace.num_sequences, 2))


def run(trace_path: str, capacity: int, policies: list[str], batch: int = 1,
        max_tokens: int | None = None, sequences: str = "all") -> dict:
    trace = select_sequences(load_trace(trace_path), sequences)
    if max_tokens is not None:
        trace = trace.truncated(max_tokens)
    if not 1 <= capacity <= trace.num_experts:
        raise ValueError(f"--capacity {capacity} is invalid: must be in [1, {trace.num_experts}]")
    masks = step_masks(trace, batch)
    results = [replay(masks, capacity, p, batch * trace.top_k) for p in policies]
    start = time.perf_counter()
    belady = belady_hit_rate(masks, capacity)
    return {"trace": trace_path, "capacity": capacity, "batch": batch,
            "default_policy": DEFAULT_POLICY,
            "hit_rate": {**{r.policy: r.hit_rate for r in results}, "belady": belady},
            "_results": results, "_belady_seconds": time.perf_counter() - start,
            "_tokens": len(trace.experts), "_steps": len(masks), "_sequences": sequences}


def sweep_capacities(num_experts: int, top_k: int) -> list[int]:
    """{top_k, 2 top_k, E/4, E/2}, within [1, E], sorted."""
    caps = {top_k, 2 * top_k, num_experts // 4, num_experts // 2}
    return sorted(c for c in caps if 1 <= c <= num_experts)


def run_sweep(trace_paths: list[str], batches: list[int], policies: list[str],
              max_tokens: int | None = None, sequences: str = "all") -> dict:
    points = []
    for path in trace_paths:
        trace = select_sequences(load_trace(path), sequences)
        for batch in batches:
            for cap in sweep_capacities(trace.num_experts, trace.top_k):
                out = run(path, cap, policies, batch, max_tokens, sequences)
                hr = out["hit_rate"]
                points.append({"trace": path, "capacity": cap, "batch": batch, "hit_rate": hr,
                               "of_belady": {p: hr[p] / hr["belady"] if hr["belady"] else 1.0
                                             for p in policies}})
    return {"points": points, "summary": summarize(points, policies),
            "default_policy": DEFAULT_POLICY}


def summarize(points: list[dict], policies: list[str]) -> dict:
    """Per policy: mean and worst fraction of Belady (and the worst point), and the points where
    it is below LRU; "best_worst": the policy whose worst point is highest."""
    summary = {}
    for p in policies:
        fracs = [pt["of_belady"][p] for pt in points]
        worst = min(range(len(points)), key=lambda i: fracs[i])
        below = [{k: pt[k] for k in ("trace", "capacity", "batch")} for pt in points
                 if "lru" in pt["hit_rate"] and pt["hit_rate"][p] < pt["hit_rate"]["lru"] - 1e-12]
        summary[p] = {"mean_of_belady": sum(fracs) / len(fracs), "worst_of_belady": fracs[worst],
                      "worst_point": {k: points[worst][k] for k in ("trace", "capacity", "batch")},
                      "points_below_lru": below}
    best = max(policies, key=lambda p: summary[p]["worst_of_belady"])
    return {"policies": summary, "best_worst": best}


def time_bookkeeping(policies: list[str], num_experts: int, num_slots: int, top_k: int,
                     iters: int = 2000) -> dict[str, dict[str, float]]:
    """Microseconds per decode step of one layer (one token, ``top_k`` random experts) on the
    CPU: "step", the residency step the engine selects; "reference", the torch reference step;
    "policy", the policy's wave_keep_score + on_access alone."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(64)])
    out = {}
    for name in policies:
        res = Residency(num_experts, num_slots, get_policy(name))
        step, ref = select_residency_step(res, torch.device("cpu")), ReferenceStep(True)
        pol, state = res.policy, res.policy_state
        needed = torch.zeros(num_experts, dtype=torch.bool)
        needed[ids[0]] = True
        timings = {}
        with torch.inference_mode():
            for key, fn in (("step", lambda i: step(res, ids[i % 64:i % 64 + 1], None, 0)),
                            ("reference", lambda i: ref(res, ids[i % 64:i % 64 + 1], None, 0)),
                            ("policy", lambda i: (pol.wave_keep_score(state, res.clock, needed),
                                                  pol.on_access(state, needed, res.clock)))):
                for i in range(50):
                    fn(i)
                start = time.perf_counter()
                for i in range(iters):
                    fn(i)
                timings[key] = (time.perf_counter() - start) / iters * 1e6
        out[name] = {**timings, "step_impl": step.name}
    return out


def _print_sweep(out: dict, policies: list[str]) -> None:
    print("| trace | C | batch | " + " | ".join(policies) + " | Belady |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in policies) + " | --- |")
    for pt in out["points"]:
        cells = [f"{pt['hit_rate'][p]:.3f} ({pt['of_belady'][p]:.2f})" for p in policies]
        print(f"| {pt['trace']} | {pt['capacity']} | {pt['batch']} | " + " | ".join(cells)
              + f" | {pt['hit_rate']['belady']:.3f} |")
    summ = out["summary"]["policies"]
    print("\n| policy | mean of Belady | worst of Belady (trace, C, batch) | points below LRU |")
    print("| --- | --- | --- | --- |")
    for p in policies:
        w = summ[p]["worst_point"]
        print(f"| {p} | {summ[p]['mean_of_belady']:.3f} | {summ[p]['worst_of_belady']:.3f} "
              f"({w['trace']}, {w['capacity']}, {w['batch']}) | {len(summ[p]['points_below_lru'])} |")
    print(f"\nbest worst point: {out['summary']['best_worst']} (default: {out['default_policy']})")


def _print_table(out: dict) -> None:
    print(f"trace {out['trace']} ({out['_sequences']} sequences, {out['_tokens']} tokens, "
          f"{out['_steps']} steps), capacity {out['capacity']}, batch {out['batch']}")
    print(f"{'policy':<12}{'hit rate':>10}{'misses':>12}{'evictions':>12}{'seconds':>10}")
    for r in out["_results"]:
        mark = " (default)" if r.policy == out["default_policy"] else ""
        print(f"{r.policy:<12}{r.hit_rate:>10.4f}{r.misses:>12}{r.evictions:>12}"
              f"{r.seconds:>10.1f}{mark}")
    print(f"{'belady':<12}{out['hit_rate']['belady']:>10.4f}{'':>24}"
          f"{out['_belady_seconds']:>10.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", nargs="+",
                    help="routing trace .npz (shared trace format); several with --sweep")
    ap.add_argument("--capacity", type=int, default=None, help="expert slots per MoE layer")
    ap.add_argument("--sweep", action="store_true",
                    help="capacities top_k, 2 top_k, E/4, E/2 x every --batch x every --trace")
    ap.add_argument("--policy", nargs="+", default=None,
                    help=f"policies to replay (default: all of {list(policy_names())})")
    ap.add_argument("--batch", type=int, nargs="+", default=[1],
                    help="sequences interleaved per step (several with --sweep)")
    ap.add_argument("--max-tokens", type=int, default=None, help="replay only the first N tokens")
    ap.add_argument("--sequences", default="all", choices=("all", "even", "odd"),
                    help="all sequences, or the even-/odd-indexed half (tuning / held-out)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--bookkeeping", action="store_true",
                    help="time one layer's residency step per policy (CPU), no trace needed")
    ap.add_argument("--experts", type=int, default=64, help="--bookkeeping: experts per layer")
    ap.add_argument("--top-k", type=int, default=6, help="--bookkeeping: experts per token")
    ap.add_argument("--iters", type=int, default=2000, help="--bookkeeping: timed steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    policies = args.policy or list(policy_names())
    for p in policies:
        get_policy(p)                                  # fails early naming the allowed names
    policies = list(dict.fromkeys(DEFAULT_POLICY if p == "auto" else p for p in policies))
    if any(b < 1 for b in args.batch):
        ap.error(f"--batch {args.batch} is invalid: every batch must be >= 1")
    if args.bookkeeping:
        out = time_bookkeeping(policies, args.experts, args.capacity or 2 * args.top_k, args.top_k,
                               args.iters)
        if args.json:
            print(json.dumps(out))
        for name, t in ([] if args.json else out.items()):
            print(f"{name:<10} step {t['step']:7.1f} us ({t['step_impl']:<10}) reference step "
                  f"{t['reference']:7.1f} us  policy alone {t['policy']:7.1f} us")
        return 0
    if not args.trace:
        ap.error("--trace is required (except with --bookkeeping)")
    if args.sweep:
        out = run_sweep(args.trace, args.batch, policies, args.max_tokens, args.sequences)
        print(json.dumps(out)) if args.json else _print_sweep(out, policies)
        return 0
    if args.capacity is None or len(args.trace) > 1 or len(args.batch) > 1:
        ap.error("give one --trace, one --batch and --capacity, or use --sweep")
    out = run(args.trace[0], args.capacity, policies, args.batch[0], args.max_tokens,
              args.sequences)
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if not k.startswith("_")}))
    else:
        _print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
