"""Per-layer cost of the expert cache's bookkeeping: cached FusedMoE vs uncached, same run.

    python benchmarks/benchmark_moe_layer.py [--num-experts 8 --top-k 2 --hidden 32 --inter 16]
        [--slots N [N ...] (default E-1)] [--tokens 1 32] [--iters 200] [--dtype float32]
        [--device cpu|cuda] [--graphs] [--profile-iters K] [--json] [--out FILE.json]

One cached layer per slot count N of ``--slots`` (each in [1, E-1]) beside one uncached layer;
a row per (N, token count, routing), two routings:
  * "all-hits": the router picks only among the first N experts (logits[:, N:] = -inf), so
    every access after warm-up is a hit at any N: cached - uncached = pure bookkeeping (needed
    mask, split_waves, plan, remap, the copy launch with zero misses). Comparing N (e.g. 16 and
    63 of 64) says whether that cost depends on the slot count. Needs top_k <= N: below that
    the all-hits row is skipped (a note on stderr).
  * "random": softmax over random logits over all E experts, so misses (and copies) happen too.
Every N sees the same inputs per (token count, routing) (the all-hits logits masked per N).
Both layers share weights and inputs; medians over ``--iters`` forwards after warm-up (on CUDA
each forward is timed to a device synchronisation). By default these are eager forwards: on CPU
the cached layer's residency step is one C call per step, but Python still runs around it;
inside a decode graph (``benchmark_throughput.py --cache-sweep``) that Python is gone too.
``--graphs`` times what a decode step's CUDA graph runs instead: each layer is captured once per
token count (``worker/graph_capture.py``'s capturer; on CPU its eager stand-in) over static
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
import sys
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
from vllm.worker.graph_capture import default_capturer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(args, cache_size: int, w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache_size),
                     DeviceConfig(args.device), kernel_config=KernelConfig(args.moe_backend))
    # Built on the device, as get_model builds a model: the uncached layer's provider keeps
    # the loaded tensors where they are (on the H100 the layer was built on the CPU and its
    # kernel refused CPU weights for CUDA inputs).
    with set_current_vllm_config(cfg), torch.device(args.device):
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


ROUTINGS = ("all-hits", "random")


def make_inputs(args, T: int, routing: str, slots: int,
                dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``--iters`` (x [T, H], logits [T, E]) on the device, the same for every slot count at
    one (T, routing) (a generator seeded by them); "all-hits" routes among the first ``slots``
    experts only (logits[:, slots:] = -inf)."""
    g = torch.Generator().manual_seed(2 * T + ROUTINGS.index(routing))
    out = []
    for _ in range(args.iters):
        logits = torch.randn(T, args.num_experts, generator=g)
        if routing == "all-hits":
            logits[:, slots:] = float("-inf")
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
    p.add_argument("--slots", type=int, nargs="+", default=None,
                   help="cache slots, one cached layer per count, each in [1, E-1] (default E-1)")
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
    E = args.num_experts
    args.slots = list(dict.fromkeys(args.slots or [E - 1]))        # in order, once each
    for n in args.slots:
        if not 1 <= n <= E - 1:
            p.error(f"--slots {n} is invalid: each slot count must be in [1, {E - 1}] "
                    f"(a cached layer holds fewer slots than its {E} experts)")
    return args


def run_rows(args, ref: FusedMoE, cached: dict[int, FusedMoE],
             dtype: torch.dtype) -> list[dict]:
    """The rows, per (slot count, token count, routing); ``--out`` rewritten after each."""
    rows = []
    with torch.inference_mode():
        for n, layer in cached.items():
            routings = ROUTINGS
            if args.top_k > n:
                routings = tuple(r for r in ROUTINGS if r != "all-hits")
                print(f"all-hits skipped at --slots {n}: top_k={args.top_k} > {n} slots (each "
                      "token routes to top_k distinct experts, so some always miss)",
                      file=sys.stderr)
            for T in args.tokens:
                for routing in routings:
                    inputs = make_inputs(args, T, routing, n, dtype)
                    rows.append(measure(args, ref, layer, T, routing, inputs))
                    if args.out:                # after every row: a run cut short keeps them
                        with open(args.out, "w") as f:
                            json.dump(rows, f, indent=1)
    return rows


def print_rows(args, ref: FusedMoE, cached: dict[int, FusedMoE], rows: list[dict]) -> None:
    step = next(iter(cached.values())).expert_cache.step.name
    print(f"E={args.num_experts} top_k={args.top_k} H={args.hidden} I={args.inter} "
          f"N={','.join(map(str, cached))} dtype={args.dtype} iters={args.iters} "
          f"device={args.device} backend={ref.quant_method.backend_name} "
          f"residency step={step} graphs={args.graphs}")
    print(f"{'N':>4} {'T':>5} {'routing':>9} {'uncached ms':>12} {'cached ms':>10} "
          f"{'overhead ms':>12} {'hit rate':>9} {'waves':>6}")
    for r in rows:
        print(f"{r['slots']:>4} {r['tokens']:>5} {r['routing']:>9} {r['uncached_ms']:>12.4f} "
              f"{r['cached_ms']:>10.4f} {r['overhead_ms']:>12.4f} {r['hit_rate']:>9.3f} "
              f"{r['waves_per_forward']:>6.2f}")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    dtype = _DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    E, H, I = args.num_experts, args.hidden, args.inter
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    torch.set_num_threads(1)  # steadier numbers on a shared machine
    ref = build(args, 0, w13, w2)
    cached = {n: build(args, n, w13, w2) for n in args.slots}
    rows = run_rows(args, ref, cached, dtype)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_rows(args, ref, cached, rows)
    return rows


if __name__ == "__main__":
    main()
