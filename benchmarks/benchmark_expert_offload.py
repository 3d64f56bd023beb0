"""Trace-driven expert offload: cache designs compared on one forced routing, in one run.

    python benchmarks/benchmark_expert_offload.py --trace T.npz --shape dsv2-lite|small|tiny
        [--capacity 8 16 32] [--batch 1 8] [--designs all | resident sync-lfru uva ours
        ours+overlap ours+prefetch ours+cpu] [--threads T] [--cpu-cost COPY CPU PER_TOKEN]
        [--policy auto] [--layers L] [--max-tokens N] [--sequences odd|even|all]
        [--dtype bfloat16] [--device cpu|cuda] [--repeat R] [--json] [--out FILE.json]

Random experts of the shape (``SHAPES``: hidden, moe_intermediate; E and top_k come from the
trace) in one host store shared by every layer (the bytes a miss moves are real, the memory is
one layer's). The router is replaced by the trace: at step s (``--batch`` sequences interleaved,
one token each, ``trace.interleave``) layer l's experts are the trace's, so hit rates are real.
Each layer: h = h + experts(h) with topk weights 1/k, the same input pool for every design.

Designs (``DESIGNS``):
  resident       all experts on the device: the compute floor.
  sync-lfru      the upstream proposal (``expert_cache/baseline.py``): Python bookkeeping, LFRU,
                 one synchronous copy per miss and tensor.
  uva            kernels read the host store directly, no slots (vLLM main's zero-copy offload).
                 On CPU that is the uncached path over the store (the same memory as resident
                 there); on CUDA the Triton MoE kernels read the pinned store in place over the
                 link on every use (run on an H100, 2026-11-26).
  ours           ``CachedWeightProvider`` with ``--policy``.
  ours+overlap   ours with ``moe_expert_overlap``: each wave's misses are copied on a side
                 stream while the wave's hit experts compute (``expert_cache/overlap.py``). A
                 CPU has no side stream: there it is ours.
  ours+prefetch  ours, and before layer l runs, layer l+1's predicted experts are prefetched
                 (``CachedWeightProvider.prefetch``). The trace has no hidden states, so the
                 engine's predictor (layer l+1's router on layer l's hidden state) cannot run
                 here; a cross-layer co-occurrence predictor stands in: counts of (expert at l,
                 expert at l+1) over the *other* sequences of the trace (the even half when
                 benchmarking the odd half; in-sample with ``--sequences all``); each token's
                 prediction is the top-k of the summed rows of its layer-l experts. Predictions
                 are made before timing (they stand in for one [E, H] router matmul).
  ours+cpu       ours, and a missing expert runs on the CPU instead of being copied while the
                 CPU has spent less than one copy's time on it, and on a GPU the least used
                 misses too while the CPU beside the copies shortens the step
                 (``moe_expert_cpu_compute`` "auto"; ``offload_designs.py``): fewer bytes over
                 the link, a host read per step and layer. ``--threads`` sets the CPU's
                 threads (default 1). ``--cpu-cost COPY CPU PER_TOKEN`` (milliseconds: one
                 expert's copy, the CPU's fixed and per-token time) gives its cost model
                 instead of measuring it, with the copies beside the CPU as on a GPU: on a
                 CPU machine the replay then shows what "auto" would choose on that GPU host
                 (hit rate, bytes, CPU pairs; not its speed), and the rows of ours and
                 ours+cpu get ``modelled_wait_seconds``: per layer and step, max(experts
                 copied x COPY, the CPU's time for the experts it computes), summed (ours:
                 misses x COPY); a model of the wait for misses, compute left out. Its
                 rows carry ``cpu_cost``, the cost model used (given or measured).
  ours+exp12     ours, and misses move as exp12 planes, decoded exactly into the slots
                 (``expert_cache/link_codec.py``, ``compressed_copy.py``): 12 bits per bf16
                 weight over the link instead of 16, the same outputs. Its link bytes (and so
                 its bound) count the planes; the header times its copy on a full plan
                 (``exp12_copy_gbps`` in slot bytes, ``exp12_link_gbps`` in the planes'). Needs
                 CUDA with triton (or the CUDA path rehearsed on CPU, in the tests); elsewhere
                 its rows say why not.
  ours+A+B       ours with several of the above, in ``FEATURES`` order; ``all`` adds
                 ours+prefetch+exp12 and ours+cpu+exp12 (the CPU reads the planes, as in the
                 engine; its cost model times the exp12 copy and the CPU on the planes).
Reported per (design, capacity, batch): tok/s (trace tokens / wall seconds of the whole cold
run; with ``--repeat R`` the median of R cold runs, interleaved across rows), hit rate, misses,
bytes copied and copy GB/s (bytes copied / wall seconds), link bytes and link GB/s, and the bound
max(compute, link bytes / bandwidth) with compute = the resident design's seconds and bandwidth
the measured DMA copy of expert rows (CPU: memcpy; CUDA: pinned host to device). Link bytes are
what crosses the host link: the bytes copied (misses and prefetch loads) for the cached designs,
0 for resident, and for uva the distinct experts of each (step, layer) x bytes per expert,
counted from the trace's ids on the host outside the timing. uva's is a LOWER BOUND: it assumes
each used expert is read over the link once per step and layer (a kernel that re-reads a row
per token block moves more). Beside the DMA bandwidth, ``copy_engine_gbps``: the provider's own
copy engine (``select_copy``: on CUDA a gather kernel reading the pinned store over UVA, on CPU
the C memcpy kernel) timed on a full plan (all E experts into E slots), and
``copy_engine_gbps_by_entries``: the same engine on plans whose first k = 1, 2, 4, 8 or E
entries are valid, padded to max(k, min(E, 8)) entries as a batch-1 top-8 decode plan is
(``entries_plans`` in offload_bounds.py), 0.1 s each: whether one miss per plan copies at the
link's speed (the DMA bandwidth above is the single-expert reference: one ``copy_`` per
expert). ``--out`` is rewritten after every measured row with ``"partial": true`` (a run cut
short keeps what it measured); the final write has no ``partial``. The routing ids of every
step are uploaded before the timing (the timed loop copies no routing host to device).
``--graphs``: each design's steps replay CUDA graphs where it allows, as the engine's decode
steps do (``offload_graphs.py``; sync-lfru and non-CUDA devices stay eager, the row says why);
without it every design runs eagerly, launching each layer's kernels from Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial

import numpy as np
import torch
from bench_io import with_threads, write_json
from offload_bounds import (DECODE_PLAN_LENGTH, device_sync, measure_bandwidth,
                            measure_copy_engine, measure_copy_engine_by_entries, settle_rows,
                            uva_link_bytes)
from offload_designs import (DESIGNS, FEATURES, cache_stats, cached, count_copies, design_arg,
                             design_refusal, exp12_copy_speed, features, make_providers,
                             model_wait_seconds, run_layers, upload_steps)
from offload_graphs import graph_fields, make_step_graphs

from vllm.model_executor.layers.fused_moe.expert_cache.host_compute import HostCostModel
from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.provider import resolve_policy_name
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
from vllm.model_executor.layers.fused_moe.expert_cache.trace import (RoutingTrace, interleave,
                                                                     load_trace)
from vllm.model_executor.layers.quantization.base import MoEShape
from vllm.model_executor.layers.quantization.unquantized import UnquantizedFusedMoEMethod
from vllm.platforms import platform_for

SHAPES = {"dsv2-lite": (2048, 1408), "small": (512, 352), "tiny": (32, 16)}
"""name -> (hidden, moe_intermediate). dsv2-lite: DeepSeek-V2-Lite's experts (64, top-6 in its
trace); small: a quarter of each dim, for CPU runs of minutes; tiny: for tests."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prepare_trace(path: str, sequences: str = "odd", max_tokens: int | None = None,
                  layers: int | None = None) -> tuple[RoutingTrace, RoutingTrace]:
    """(the benchmarked trace, the trace the prefetch predictor is fitted on): ``sequences``
    all/even/odd, the first ``max_tokens`` tokens, the first ``layers`` MoE layers; the fit
    trace is the other half (all sequences, in-sample, for "all")."""
    full = load_trace(path)
    if layers is not None:
        full = RoutingTrace(full.experts[:, :layers], full.offsets, dict(full.meta))
    halves = {"all": range(full.num_sequences), "even": range(0, full.num_sequences, 2),
              "odd": range(1, full.num_sequences, 2)}
    other = {"all": "all", "even": "odd", "odd": "even"}[sequences]
    bench, fit = full.subset(halves[sequences]), full.subset(halves[other])
    return (bench.truncated(max_tokens) if max_tokens else bench), fit


def fit_affinity(trace: RoutingTrace) -> np.ndarray:
    """[L-1, E, E] float32: A[l, e, f] = tokens routed to e at layer l and f at layer l+1."""
    E, ids = trace.num_experts, trace.experts.astype(np.int64)          # [T, L, K]
    out = np.zeros((trace.num_layers - 1, E, E), dtype=np.float32)
    for l in range(trace.num_layers - 1):
        pairs = ids[:, l, :, None] * E + ids[:, l + 1, None, :]           # [T, K, K]
        out[l] = np.bincount(pairs.ravel(), minlength=E * E).reshape(E, E)
    return out


def predict_next(trace: RoutingTrace, affinity: np.ndarray) -> torch.Tensor:
    """[T, L, K] int64: per token, layer l+1's predicted top-k from its layer-l experts (layer 0
    gets -1: nothing precedes it)."""
    ids = torch.from_numpy(trace.experts.astype(np.int64))
    A = torch.from_numpy(affinity)
    pred = torch.full_like(ids, -1)
    for l in range(trace.num_layers - 1):
        scores = A[l][ids[:, l]].sum(1)                                  # [T, E]
        pred[:, l + 1] = torch.topk(scores, trace.top_k, dim=-1).indices
    return pred


class Setup:
    """The experts, the kernel and the forced routing, shared by every design of one run."""

    def __init__(self, trace: RoutingTrace, shape: str, dtype: torch.dtype, device: str,
                 max_batch: int, seed: int = 0):
        self.trace, self.device, self.dtype = trace, torch.device(device), dtype
        self.hidden, inter = SHAPES[shape]
        E, K = trace.num_experts, trace.top_k
        self.qm = UnquantizedFusedMoEMethod("silu")
        self.qm.select_kernel(MoEShape(E, self.hidden, inter, dtype),
                              platform_for(self.device))
        g = torch.Generator().manual_seed(seed)
        w13 = torch.randn(E, 2 * inter, self.hidden, generator=g).mul_(self.hidden ** -0.5)
        w2 = torch.randn(E, self.hidden, inter, generator=g).mul_(inter ** -0.5)
        platform = platform_for(self.device)
        self.store = HostStore.from_experts(
            {"w13_weight": w13.to(dtype), "w2_weight": w2.to(dtype)}, self.qm.prepare_expert,
            partial(platform.empty_pinned, device=self.device)
            if platform.is_pin_memory_available() else None)
        del w13, w2
        self.ids = torch.from_numpy(trace.experts.astype(np.int64))      # [T, L, K]
        self.topk_weights = torch.full((K,), 1.0 / K, dtype=dtype, device=self.device)
        # A pool of step inputs [16, max_batch, H], cycled (every design sees the same).
        self.inputs = torch.randn(16, max_batch, self.hidden, generator=g).to(dtype).to(
            self.device)
        self.affinity_pred: torch.Tensor | None = None
        self.exp12 = None
        """ours+exp12's copy engine (its planes encoded once, shared by every layer)."""
        self.cpu_cost: HostCostModel | None = None
        """ours+cpu's cost model (``--cpu-cost``); None: measured on layer 0's provider."""

    def steps(self, batch: int) -> list[torch.Tensor]:
        """Per step, the trace tokens of its active lanes ([b] int64)."""
        return [torch.from_numpy(row[row >= 0]) for row in interleave(self.trace.offsets, batch)]


def run_design(setup: Setup, design: str, capacity: int | None, batch: int, policy: str,
               keep_outputs: bool = False, count: bool = False,
               max_steps: int | None = None, use_graphs: bool = False) -> dict:
    """One cold run of the whole trace (its first ``max_steps`` steps: a warm-up). Returns the
    row (and "_outputs": the last layer's h per step when ``keep_outputs``). ``use_graphs``:
    steps replayed from graphs where the design allows (``offload_graphs.py``)."""
    s = setup
    refusal = design_refusal(s, design)
    if refusal is not None:
        return {"design": design, "capacity": None, "batch": batch, "status": refusal}
    providers = make_providers(s, design, capacity, policy)
    counted = count_copies(providers, s.store.bytes_per_expert) \
        if count and cached(design) else None
    modelled = model_wait_seconds(providers, s.cpu_cost) \
        if "cpu" in features(design) and s.cpu_cost is not None else None
    pred = s.affinity_pred if "prefetch" in features(design) else None
    steps = s.steps(batch)[:max_steps]
    step_ids, step_pred, host_ids = upload_steps(s, steps, pred)
    forward = partial(run_layers, providers, s.qm, s.topk_weights)
    graphs, graph_refusal = make_step_graphs(
        design, providers, forward, s.qm.kernel, (batch, s.trace.num_layers, s.trace.top_k),
        s.hidden, s.dtype, s.device, pred is not None, counted is not None) \
        if use_graphs else (None, None)
    step = graphs.step if graphs is not None else forward
    sync = device_sync(s.device)
    outputs = []
    sync()
    start = time.perf_counter()
    for i, (ids, p_ids) in enumerate(zip(step_ids, step_pred)):           # ids [b, L, K]
        h = step(ids, p_ids, s.inputs[i % s.inputs.shape[0], :ids.shape[0]])
        if keep_outputs:
            outputs.append(h.to("cpu", copy=True))      # a replay reuses its buffer
    sync()
    seconds = time.perf_counter() - start
    row = {"design": design, "capacity": capacity, "batch": batch, "status": "ok",
           "tokens": len(s.trace.experts), "seconds": seconds,
           "tok_s": len(s.trace.experts) / seconds}
    if use_graphs:
        row.update(graph_fields(graphs, graph_refusal))
    row.update(cache_stats(providers, design))
    if "cpu" in features(design):       # the cost model its choices rest on (given or measured)
        row["cpu_cost"] = dataclasses.asdict(providers[0].host_compute.cost)
    row["link_bytes"] = row["bytes_copied"] if design != "uva" else uva_link_bytes(
        host_ids, s.trace.num_experts, s.store.bytes_per_expert)
    if "exp12" in features(design):     # the planes' bytes per expert copied, not bf16's
        row["link_bytes"] = row["bytes_copied"] // s.store.bytes_per_expert * \
            s.exp12.bytes_per_expert
        row["exp12_ratio"] = s.exp12.bytes_per_expert / s.store.bytes_per_expert
    if count:
        row["bytes_copied_counted"] = counted[0] if counted is not None else 0
    if s.cpu_cost is not None and design in ("ours", "ours+cpu"):
        # --cpu-cost: the modelled wait for misses (ours: every miss copied).
        row["modelled_wait_seconds"] = modelled[0] if modelled is not None else \
            row["misses"] * s.cpu_cost.copy_seconds
    if keep_outputs:
        row["_outputs"] = outputs
    return row


def _header(args: argparse.Namespace, setup: Setup, bandwidth: float,
            engine: tuple[float, str], by_entries: dict[str, float]) -> dict:
    trace, cuda = setup.trace, setup.device.type == "cuda"
    return {"trace": args.trace, "sequences": args.sequences, "tokens": len(trace.experts),
            "layers": trace.num_layers, "device": str(setup.device),
            "shape": {"name": args.shape, "hidden": setup.hidden, "inter": SHAPES[args.shape][1],
                      "experts": trace.num_experts, "top_k": trace.top_k, "dtype": args.dtype,
                      "bytes_per_expert": setup.store.bytes_per_expert},
            "policy": resolve_policy_name(args.policy), "graphs_asked": args.graphs,
            "bandwidth_gbps": bandwidth / 1e9,
            "bandwidth_what": "pinned host-to-device DMA (copy_)" if cuda
            else "memcpy of expert rows (CPU)",
            "copy_engine_gbps": engine[0] / 1e9, "copy_engine": engine[1],
            "copy_engine_gbps_by_entries": {k: v / 1e9 for k, v in by_entries.items()},
            "prefetch_predictor": "cross-layer co-occurrence fitted on the "
            + ("same sequences (in-sample)" if args.sequences == "all" else "other half")}


def run(args: argparse.Namespace, keep_outputs: bool = False, count: bool = False) -> dict:
    """Every row, as the JSON reports it; ``--out`` rewritten after each measured row with
    ``"partial": true`` (rows so far, seconds the median of the rounds so far)."""
    trace, fit = prepare_trace(args.trace, args.sequences, args.max_tokens, args.layers)
    designs = list(DESIGNS) if "all" in args.designs else args.designs
    for c in args.capacity:
        if not 1 <= c <= trace.num_experts:
            raise ValueError(f"--capacity {c} is invalid: must be in [1, {trace.num_experts}]")
    setup = Setup(trace, args.shape, _DTYPES[args.dtype], args.device, max(args.batch))
    if any("prefetch" in features(d) for d in designs):
        setup.affinity_pred = predict_next(trace, fit_affinity(fit))
    if args.cpu_cost is not None:
        copy, fixed, per_token = (ms / 1e3 for ms in args.cpu_cost)
        setup.cpu_cost = HostCostModel(copy, fixed, per_token, concurrent=True)
    jobs = [(batch, design, c) for batch in args.batch for design in designs
            for c in (args.capacity if cached(design) else [None])]
    bandwidth = measure_bandwidth(setup.store, setup.device)
    head = _header(args, setup, bandwidth, measure_copy_engine(setup.store, setup.device),
                   measure_copy_engine_by_entries(setup.store, setup.device))
    if setup.cpu_cost is not None:
        head["cpu_cost_given"] = dataclasses.asdict(setup.cpu_cost)
    if any("exp12" in features(d) for d in designs) and \
            design_refusal(setup, "ours+exp12") is None:
        head.update(exp12_copy_speed(setup))
    rows: dict = {}
    # Rounds interleave the jobs, so a shared machine's slow spell hits every design alike;
    # every round is a cold run with the same counts, its seconds kept.
    for r in range(args.repeat):
        for batch, design, c in jobs:
            if r == 0:      # warm-up: the job's kernels compile outside its timing; just before
                # it, so a run cut short (a device session's limit) has written its first rows
                run_design(setup, design, c, batch, args.policy, max_steps=2,
                           use_graphs=args.graphs)
            row = run_design(setup, design, c, batch, args.policy, keep_outputs and not rows.get(
                (batch, design, c)), count, use_graphs=args.graphs)
            rows.setdefault((batch, design, c), row).setdefault("all_seconds", []).append(
                row.get("seconds"))
            if args.out:
                settle_rows(list(rows.values()), bandwidth)
                write_json(args.out, dict(head, partial=True, rows=[
                    {k: v for k, v in r.items() if not k.startswith("_")}
                    for r in rows.values()]))
    rows = list(rows.values())
    settle_rows(rows, bandwidth)
    return dict(head, rows=rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="routing trace .npz (shared trace format)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--capacity", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--designs", nargs="+", default=["all"], type=design_arg,
                    help=f"all (= {' '.join(DESIGNS)}), or any of those; ours may add any of "
                    f"{'+'.join(FEATURES)} in that order (ours+prefetch+cpu+exp12)")
    ap.add_argument("--policy", default="auto", help="ours' eviction policy")
    ap.add_argument("--layers", type=int, default=None, help="only the first L MoE layers")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--sequences", choices=("all", "even", "odd"), default="odd",
                    help="benchmarked half (the predictor is fitted on the other)")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=1,
                    help="cold runs per row, interleaved; seconds = the median")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (the CPU's share of ours+cpu; 1 for steady figures)")
    ap.add_argument("--cpu-cost", type=float, nargs=3, default=None,
                    metavar=("COPY_MS", "CPU_MS", "PER_TOKEN_MS"),
                    help="ours+cpu's cost model, given (copies beside the CPU, as on a GPU)")
    ap.add_argument("--graphs", action="store_true",
                    help="replay each design's steps from CUDA graphs where it allows "
                    "(offload_graphs.py; sync-lfru and CPU devices stay eager)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--out", default=None, help="also write the JSON here (rewritten "
                    "after every measured row with \"partial\": true)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat} is invalid: must be >= 1")
    if args.threads < 1:
        ap.error(f"--threads {args.threads} is invalid: must be >= 1")
    if args.cpu_cost is not None and (min(args.cpu_cost) < 0 or args.cpu_cost[0] <= 0):
        ap.error(f"--cpu-cost {args.cpu_cost} is invalid: the copy's milliseconds must be > 0 "
                 "and the CPU's >= 0")
    if any(b < 1 for b in args.batch):
        ap.error(f"--batch {args.batch} is invalid: every batch must be >= 1")
    get_policy(args.policy)
    return args


def _print_table(out: dict) -> None:
    sh = out["shape"]
    print(f"{out['trace']} ({out['sequences']}, {out['tokens']} tokens, {out['layers']} layers), "
          f"shape {sh['name']} H={sh['hidden']} I={sh['inter']} E={sh['experts']} "
          f"k={sh['top_k']} {sh['dtype']} on {out['device']}; bandwidth "
          f"{out['bandwidth_gbps']:.2f} GB/s ({out['bandwidth_what']}), copy engine "
          f"{out['copy_engine_gbps']:.2f} GB/s ({out['copy_engine']}, full plan)")
    by_entries = ", ".join(f"{k}: {v:.2f}" for k, v in out["copy_engine_gbps_by_entries"].items())
    print(f"copy engine GB/s by valid entries k (plans of max(k, min(E, {DECODE_PLAN_LENGTH})) "
          f"entries): {by_entries}")
    print("| design | C | batch | tok/s | hit rate | GB copied | copy GB/s | GB over link | "
          "link GB/s | bound tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        if r["status"] != "ok":
            print(f"| {r['design']} | | {r['batch']} | {r['status']} | | | | | | |")
            continue
        name = r["design"] + (" (graphs)" if r.get("graphs") else "")
        print(f"| {name} | {r['capacity'] or ''} | {r['batch']} | {r['tok_s']:.1f} | "
              f"{r['hit_rate']:.3f} | {r['bytes_copied'] / 1e9:.2f} | {r['copy_gbps']:.2f} | "
              f"{r['link_bytes'] / 1e9:.2f} | {r['link_gbps']:.2f} | "
              f"{r.get('bound_tok_s', float('nan')):.1f} |")
    for r in out["rows"]:
        if r.get("graph_refusal"):
            print(f"{r['design']} batch {r['batch']}: eager ({r['graph_refusal']})")
        if "cpu_cost" in r:
            c = r["cpu_cost"]
            print(f"{r['design']} C={r['capacity']} batch {r['batch']}: {r['cpu_expert_calls']} "
                  f"CPU calls; cost model: copy {c['copy_seconds'] * 1e3:.3f} ms, CPU "
                  f"{c['cpu_fixed'] * 1e3:.3f} + {c['cpu_per_token'] * 1e3:.3f} ms a token "
                  f"(concurrent {c['concurrent']})")
        if "modelled_wait_seconds" in r:
            print(f"{r['design']} C={r['capacity']} batch {r['batch']}: modelled wait for misses "
                  f"{r['modelled_wait_seconds']:.3f} s")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = with_threads(args.threads, run, args)
    write_json(args.out, out)
    print(json.dumps(out)) if args.json else _print_table(out)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
