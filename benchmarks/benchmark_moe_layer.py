"""Per-layer cost of the expert cache's bookkeeping: cached FusedMoE vs uncached, same run.

    python benchmarks/benchmark_moe_layer.py [--num-experts 8 --top-k 2 --hidden 32 --inter 16]
        [--slots N (default E-1)] [--tokens 1 32] [--iters 200] [--dtype float32]
        [--device cpu|cuda] [--graphs] [--profile-iters K] [--json] [--out FILE.json]

Two routings per token count:
  * "all-hits": the router never picks the last expert, so with N = E-1 slots every access after
    warm-up is a hit: cached - uncached = pure bookkeeping (needed mask, split_waves, plan, remap,
    masked copy of zero misses).
  * "random": softmax over random logits, so misses (and copies) happen too.
Both layers share weights and inputs; medians over ``--iters`` forwards after warm-up (on CUDA
each forward is timed to a device synchronisation). By default these are eager forwards: on CPU
the cached layer's residency step is one C call per wave, but Python still runs around it;
inside a decode graph (``benchmark_throughput.py --cache-sweep``) that Python is gone too.
``--graphs`` times what a decode step's CUDA graph runs instead: each layer is captured once per
token count (``worker/cuda_graphs.py``'s capturer; on CPU its eager stand-in) over static
inputs that each iteration rewrites, and each replay is timed alone (CUDA events around it), so
``overhead_ms`` is the cached layer's device cost per forward: its residency step, the copy
launch with its blocks that exit, the remap. ``--profile-iters K`` adds the kernels K more
forwards ran, by device time per forward (``decode_profile.top_kernels``). Times are for the
backend "auto" picks (or --moe-backend) and the residency step the platform has.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from typing import Callable

import torch
from decode_profile import summarize
from torch.profiler import ProfilerActivity, profile

from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig,
                         SchedulerConfig, VllmConfig, set_current_vllm_config)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import capture_warm_up
from vllm.model_executor.layers.fused_moe.registry import moe_backend_names
from vllm.worker.cuda_graphs import default_capturer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(args, cache_size: int, w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache_size),
                     DeviceConfig(args.device), kernel_config=KernelConfig(args.moe_backend))
    with set_current_vllm_config(cfg):
        layer = FusedMoE(args.num_experts, args.top_k, args.hidden, args.inter,
                         params_dtype=w13.dtype)
        layer.load_expert_weight("w13_weight", w13, None, None)
        layer.load_expert_weight("w2_weight", w2, None, None)
        layer.finish_loading(torch.device(args.device))
    return layer


def median_ms(layer: FusedMoE, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    sync = torch.cuda.synchronize if inputs[0][0].is_cuda else (lambda: None)
    times = []
    for x, logits in inputs:
        sync()
        t0 = time.perf_counter()
        layer(x, logits)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class GraphedLayer:
    """The layer captured over static copies of the first input, after a warm-up forward (as a
    decode graph's); each layer gets its own capturer and graph pool."""

    def __init__(self, layer: FusedMoE, inputs: list[tuple[torch.Tensor, torch.Tensor]]):
        x0, l0 = inputs[0]
        self.x, self.logits = x0.clone(), l0.clone()
        capturer = default_capturer(x0.device)
        with capture_warm_up(x0.shape[0]):
            capturer.warm_up(lambda: layer(self.x, self.logits))
        self.replay = capturer.capture(lambda: layer(self.x, self.logits))

    def set_inputs(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        self.x.copy_(x)
        self.logits.copy_(logits)


def replay_ms(g: GraphedLayer, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Median of each replay alone: CUDA events around it (the input copies before it are not
    timed), or the host clock on CPU."""
    on_cuda = inputs[0][0].is_cuda
    times = []
    for x, logits in inputs:
        g.set_inputs(x, logits)
        if on_cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            g.replay()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernels_per_forward(forward: Callable[[], None], iters: int, on_cuda: bool) -> list[dict]:
    """The device kernels of ``iters`` forwards, by time per forward (empty on CPU)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            forward()
        if on_cuda:
            torch.cuda.synchronize()
    return summarize(prof.key_averages(), iters, 1.0)["kernels"]


def make_inputs(args, T: int, routing: str, dtype: torch.dtype, g: torch.Generator):
    out = []
    for _ in range(args.iters):
        logits = torch.randn(T, args.num_experts, generator=g)
        if routing == "all-hits":
            logits[:, -1] = float("-inf")
        out.append((torch.randn(T, args.hidden, generator=g).to(dtype).to(args.device),
                    logits.to(args.device)))
    return out


def measure(args, ref: FusedMoE, cached: FusedMoE, T: int, routing: str,
            inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """One row: both layers' medians (eager or replayed), the cache's counters over the timed
    forwards, and with ``--profile-iters`` each layer's kernels."""
    median_ms(ref, inputs), median_ms(cached, inputs)  # warm-up: fills the slots
    x, logits = inputs[0]
    runs = {"uncached": ref, "cached": cached}         # what is timed: a layer or its graph
    time_ms = median_ms
    if args.graphs:
        runs = {k: GraphedLayer(layer, inputs) for k, layer in runs.items()}
        time_ms = replay_ms
        for g in runs.values():
            replay_ms(g, inputs[:3])
    forwards = {k: r.replay if args.graphs else partial(r, x, logits) for k, r in runs.items()}
    cached.expert_cache.reset_stats()
    t_ref, t_cached = time_ms(runs["uncached"], inputs), time_ms(runs["cached"], inputs)
    st = cached.expert_cache.stats()
    row = {"tokens": T, "routing": routing, "slots": cached.expert_cache.num_slots,
           "device": args.device, "graphs": args.graphs,
           "residency_step": cached.expert_cache.step.name,
           "uncached_ms": round(t_ref, 4), "cached_ms": round(t_cached, 4),
           "overhead_ms": round(t_cached - t_ref, 4), "hit_rate": round(st["hit_rate"], 4),
           "waves_per_forward": st["waves"] / args.iters}
    if args.profile_iters:
        on_cuda = args.device == "cuda"
        row["kernels"] = {k: kernels_per_forward(f, args.profile_iters, on_cuda)
                          for k, f in forwards.items()}
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--inter", type=int, default=16)
    p.add_argument("--slots", type=int, default=None, help="cache slots (default E-1)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--moe-backend", choices=["auto", *moe_backend_names()], default="auto")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--graphs", action="store_true",
                   help="time replays of each layer's captured graph (the decode step's view)")
    p.add_argument("--profile-iters", type=int, default=0,
                   help="also profile this many forwards per layer: kernels by device time")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write the rows (JSON) here")
    args = p.parse_args(argv)
    if args.iters < 3:
        p.error(f"--iters {args.iters}: at least 3 (the median of the timed forwards)")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    n = args.slots if args.slots is not None else args.num_experts - 1
    dtype = _DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    E, H, I = args.num_experts, args.hidden, args.inter
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    torch.set_num_threads(1)  # steadier numbers on a shared machine
    ref, cached = build(args, 0, w13, w2), build(args, n, w13, w2)
    rows = []
    with torch.inference_mode():
        for T in args.tokens:
            for routing in ("all-hits", "random"):
                inputs = make_inputs(args, T, routing, dtype, g)
                rows.append(measure(args, ref, cached, T, routing, inputs))
                if args.out:                    # after every row: a run cut short keeps them
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    if args.json:
        print(json.dumps(rows, indent=1))
        return rows
    print(f"E={E} top_k={args.top_k} H={H} I={I} N={n} dtype={args.dtype} iters={args.iters} "
          f"device={args.device} backend={ref.quant_method.backend_name} "
          f"residency step={cached.expert_cache.step.name} graphs={args.graphs}")
    print(f"{'T':>5} {'routing':>9} {'uncached ms':>12} {'cached ms':>10} {'overhead ms':>12} "
          f"{'hit rate':>9} {'waves':>6}")
    for r in rows:
        print(f"{r['tokens']:>5} {r['routing']:>9} {r['uncached_ms']:>12.4f} {r['cached_ms']:>10.4f} "
              f"{r['overhead_ms']:>12.4f} {r['hit_rate']:>9.3f} {r['waves_per_forward']:>6.2f}")
    return rows


if __name__ == "__main__":
    main()
