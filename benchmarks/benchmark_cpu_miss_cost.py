"""What a missing expert costs on this CPU: the inputs of ``moe_expert_cpu_compute='auto'``.

``measure_cost_model`` (``expert_cache/host_compute.py``) on random bf16 experts of a shape:
the CPU's time for an expert's 1 and 8 tokens from host memory (``HostExperts``, as on a GPU
machine), and its copy into a host "slot" (a RAM-to-RAM copy here: the link's time on a GPU
machine is what the engine measures there). The break-even link bandwidth is the expert's bytes
over the CPU's 1-token time: on links slower than that, ``auto`` rents a 1-token miss at first
(ski rental: until the CPU has spent one copy's time on the expert); on faster ones, where the
copies run beside the CPU (a GPU), it still gives the CPU the least used misses while that
shortens the step (``balance``).

    python benchmarks/benchmark_cpu_miss_cost.py --shape probe-4.8g dsv2-lite --threads 1 2 --json

Each row also times the host's decision per cached layer and step that "auto" adds
(``HostMissCompute.host_pairs`` on host ids: the read of the routing excluded), at the shape's
E and top_k with E/4 experts resident, one token per step, random routing: ``decision_us``
(ski rental alone: a CPU device, or a CPU slower than the copy) and ``decision_balance_us``
(with ``balance``, as on a GPU; its cost model makes the CPU a little slower than a copy, so
``balance`` runs on every step with a miss). Best of 3 runs of 2,000 steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from benchmark_decode import PRESETS

from vllm.model_executor.layers.fused_moe.expert_cache.host_compute import (HostCostModel,
                                                                         HostMissCompute,
                                                                         measure_cost_model)
from vllm.model_executor.layers.fused_moe.expert_cache.host_experts import HostExperts
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation

SHAPES = {name: (cfg["hidden_size"], cfg["moe_intermediate_size"])
          for name, (_, cfg) in PRESETS.items()}
"""name -> (hidden, moe_intermediate) of benchmark_decode's presets."""
ROUTING = {name: (cfg.get("num_experts") or cfg["n_routed_experts"], cfg["num_experts_per_tok"])
           for name, (_, cfg) in PRESETS.items()}
"""name -> (experts, top_k)."""


def time_decision(experts: int, top_k: int, concurrent: bool, steps: int = 2000) -> float:
    """Microseconds per ``host_pairs`` call of mode "auto" (see the module docstring)."""
    cost = HostCostModel(copy_seconds=1.0, cpu_fixed=1.1, cpu_per_token=0.0,
                         concurrent=concurrent)
    resident = torch.full((experts,), -1)
    resident[:experts // 4] = torch.arange(experts // 4)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randperm(experts, generator=g)[:top_k].view(1, top_k) for _ in range(steps)]
    best = float("inf")
    for _ in range(3):
        hc = HostMissCompute("auto", None, {}, cost)
        start = time.perf_counter()
        for step in ids:
            hc.host_pairs(step, resident)
        best = min(best, time.perf_counter() - start)
    return best / steps * 1e6


def measure(hidden: int, inter: int, threads: int, repeats: int, experts: int = 8) -> dict:
    """One row at ``threads`` intra-op threads (the process's count is restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(hidden, inter, threads, repeats, experts)
    finally:
        torch.set_num_threads(before)


def _measure(hidden: int, inter: int, threads: int, repeats: int, experts: int) -> dict:
    g = torch.Generator().manual_seed(0)
    store = {"w13_weight": (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02
                            ).to(torch.bfloat16),
             "w2_weight": (torch.randn(experts, hidden, inter, generator=g) * 0.02
                           ).to(torch.bfloat16)}
    slots = {n: torch.empty_like(t[:2]) for n, t in store.items()}
    runs = [measure_cost_model(store, slots, HostExperts(MoEActivation.of("silu")), hidden,
                               torch.bfloat16) for _ in range(repeats)]
    expert_bytes = 3 * hidden * inter * 2
    cpu_1 = statistics.median(r.cpu_fixed + r.cpu_per_token for r in runs)
    return {"hidden": hidden, "moe_intermediate": inter, "threads": threads,
            "expert_bytes": expert_bytes, "repeats": repeats,
            "cpu_1_token_ms": cpu_1 * 1e3,
            "cpu_per_token_ms": statistics.median(r.cpu_per_token for r in runs) * 1e3,
            "ram_copy_ms": statistics.median(r.copy_seconds for r in runs) * 1e3,
            "break_even_gbps": expert_bytes / cpu_1 / 1e9}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["probe-4.8g"], choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=5, help="cost models measured per row")
    ap.add_argument("--json", action="store_true", help="print one JSON list")
    args = ap.parse_args(argv)
    if args.repeats < 1 or any(t < 1 for t in args.threads):
        ap.error(f"--repeats {args.repeats} and --threads {args.threads} must be >= 1")
    rows = [{"shape": s, **measure(*SHAPES[s], t, args.repeats),
             "decision_us": time_decision(*ROUTING[s], False),
             "decision_balance_us": time_decision(*ROUTING[s], True)}
            for s in args.shape for t in args.threads]
    print(json.dumps(rows) if args.json else "\n".join(map(str, rows)))
    return rows


if __name__ == "__main__":
    main()
