"""Replay a routing trace through the expert cache's own Residency + eviction policies.

    python benchmarks/benchmark_expert_cache.py --trace T.npz --capacity 16 [--policy lru ...]
        [--batch 8] [--sequences odd] [--max-tokens N] [--json]

One plan() per layer per step (all layers of a step in one batched Residency, which is the same
code as the per-layer one), steps needing more than C experts split with the cache's split_waves.
Hit rate = hits / (hits + misses) over (layer, step, distinct needed expert). Belady (the offline
optimum, an independent implementation) is always reported.
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
    ap.add_argument("--trace", required=True, help="routing trace .npz (shared trace format)")
    ap.add_argument("--capacity", type=int, required=True, help="expert slots per MoE layer")
    ap.add_argument("--policy", nargs="+", default=None,
                    help=f"policies to replay (default: all of {list(policy_names())})")
    ap.add_argument("--batch", type=int, default=1, help="sequences interleaved per step")
    ap.add_argument("--max-tokens", type=int, default=None, help="replay only the first N tokens")
    ap.add_argument("--sequences", default="all", choices=("all", "even", "odd"),
                    help="all sequences, or the even-/odd-indexed half (tuning / held-out)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    args = ap.parse_args(argv)
    policies = args.policy or list(policy_names())
    for p in policies:
        get_policy(p)                                  # fails early naming the allowed names
    policies = [DEFAULT_POLICY if p == "auto" else p for p in policies]
    if args.batch < 1:
        ap.error(f"--batch {args.batch} is invalid: must be >= 1")
    out = run(args.trace, args.capacity, list(dict.fromkeys(policies)), args.batch,
              args.max_tokens, args.sequences)
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if not k.startswith("_")}))
    else:
        _print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
