"""Decode throughput of a random MoE checkpoint with and without the expert cache, in one run.

    python benchmarks/benchmark_decode.py --random-model probe-4.8g|dsv2-lite|tiny \
        --batch 1 32 --moe-expert-cache-size 0 64 32 16 --output-len 64 --json \
        [--dtype bf16] [--device cuda|cpu] [--out FILE] [--checkpoint DIR] [--dry-run]

Builds a random checkpoint of the preset's shape (``decode_models.PRESETS``) in the requested
dtype: config.json, safetensors written one decoder layer per shard (generated in place, so at
most one layer is in memory), and the default model's tokenizer (vocab 4096: the LM head is
small next to a real model's). ``--checkpoint DIR`` keeps it there and reuses it when DIR already
holds one; otherwise a temporary directory is removed at the end. ``--dry-run`` prints the
shape, bytes per expert and the checkpoint's size without building.

Presets: probe-4.8g, Qwen3-MoE (Qwen3-30B-A3B's attention and experts, 64 of them in 8 layers:
9.4 MB per bf16 expert, 4.8 GB of experts); dsv2-lite, DeepseekV2ForCausalLM in
DeepSeek-V2-Lite's shape (MLA, dense layer 0, 26 MoE layers of 64 experts top-6 + 2 shared,
moe_intermediate 1408: 17.3 MB per bf16 expert, 28.8 GB of experts; default rope, no yarn); tiny,
a small Qwen3-MoE that runs in seconds on a CPU (for the test).

For each cache size (0 = off; N >= the expert count is off too: every expert fits, the engine's
rule) one engine is built; for each batch, ``batch`` prompts of fixed random token ids
(--prompt-len) are decoded greedily for --output-len tokens (ignore_eos) after a warm-up of the
same batch. Decode = the steps after every prompt is prefilled: tok/s = tokens sampled in them /
their wall seconds; hit rate, bytes copied and copy GB/s (bytes / decode seconds) are the expert
cache's counters over the same steps. ``tokens_identical`` says, per batch, whether every cache size
produced the same greedy tokens. ``--profile-steps K`` adds a ``profile`` to each row: K more
decode steps under torch.profiler (``decode_profile.py``: kernel and graph launches, GPU kernels
and busy time, aten ops, per step; with a cache the bytes it copied in those steps and the miss
copies' own speed, ``gather_gbps``: bytes over the gather kernels' device time; ``gpu_gaps``:
the device's idle time per step and its longest gaps, each with the activity around it).
``--unrouted-experts K`` zeroes the router rows of the last K
experts (``decode_models.UNROUTED``): with N = E - K slots, filled by a warm-up of 32 prompts,
the cache then hits on every access, its pure cost. ``--attention-backend`` picks the engine's
(e.g. ``flashinfer_paged``, which only that option selects).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time

import torch
from bench_io import write_json
from decode_models import (DTYPES, PRESETS, build_checkpoint, check_reusable, make_config,
                           shape_summary)
from decode_profile import prefilled, profile_decode_steps

def make_prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab, (batch, prompt_len), generator=g).tolist()


def _cache_counts(llm) -> dict | None:
    s = llm.get_moe_cache_stats()
    # cpu_pairs: with CPU compute on; link_bytes_copied < bytes_copied with link compression
    keys = ("hits", "misses", "bytes_copied", "link_bytes_copied", "cpu_pairs")
    return None if s is None else {k: s[k] for k in keys if k in s}


def _cpu_cost(llm) -> dict:
    """{"cpu_cost": the cost model of moe_expert_cpu_compute 'auto'} (measured at load, shared by
    the layers), or {} where no cached layer has one."""
    for m in llm.llm_engine.runner.moe_layers:
        hc = getattr(m.expert_cache, "host_compute", None)
        if hc is not None and hc.cost is not None:
            return {"cpu_cost": dataclasses.asdict(hc.cost)}
    return {}


def decode(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Greedy decode of ``prompts``: steps until all are prefilled, then the timed decode steps.
    -> {"tokens": per prompt, "decode_tokens", "decode_seconds", "steps", cache counter deltas}."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [f"decode-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    done = {}
    while engine.has_unfinished_requests() and not prefilled(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    # With --async-scheduling the last prefill step launched the first decode step already:
    # its launch (host work, about a tenth of a step) falls before the clock starts, its
    # device time after (the first timed step waits for it).
    before, steps = _cache_counts(llm), 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    seconds = time.perf_counter() - start
    after = _cache_counts(llm)
    tokens = [list(done[r].outputs[0].token_ids) for r in ids]
    out = {"tokens": tokens, "decode_tokens": sum(map(len, tokens)) - len(prompts),
           "decode_seconds": seconds, "steps": steps}
    if after is not None:
        out.update({k: after[k] - before[k] for k in after})
    return out


def _row(n: int, batch: int, r: dict) -> dict:
    row = {"moe_expert_cache_size": n, "batch": batch, "cache_active": "hits" in r,
           "decode_tokens": r["decode_tokens"], "decode_seconds": r["decode_seconds"],
           "decode_steps": r["steps"],
           "tok_s": r["decode_tokens"] / max(r["decode_seconds"], 1e-9),
           "hit_rate": None, "hits": None, "misses": 0, "bytes_copied": 0, "copy_gbps": 0.0}
    if "hits" in r:
        lookups = r["hits"] + r["misses"]
        row.update(hits=r["hits"], misses=r["misses"], bytes_copied=r["bytes_copied"],
                   link_bytes_copied=r["link_bytes_copied"],
                   hit_rate=r["hits"] / lookups if lookups else None,
                   copy_gbps=r["bytes_copied"] / max(r["decode_seconds"], 1e-9) / 1e9,
                   link_gbps=r["link_bytes_copied"] / max(r["decode_seconds"], 1e-9) / 1e9)
        if "cpu_pairs" in r:
            row["cpu_pairs"] = r["cpu_pairs"]
    return row


def graphs_summary(llm, enforce_eager: bool) -> dict:
    """Whether the row's decode steps replayed graphs: the kind, the captured sizes and why not
    (a row silently eager beside graphed ones would not compare like for like)."""
    g = llm.llm_engine.runner.decode_graphs
    if g is None:
        return {"kind": None, "captured_sizes": [], "refused": "enforce_eager" if enforce_eager
                else "refused at load (the reason is in the log)"}
    return {"kind": type(g).__name__, "captured_sizes": list(getattr(g, "captured_sizes", [])),
            "refused": g.refused}


def run_sizes(args, path: str, dtype: torch.dtype, device: str, vocab: int,
              on_row=None) -> tuple[list, dict]:
    """One engine per cache size, every batch on it -> (rows, {batch: {size: tokens}});
    ``on_row(rows)`` after each row (a run cut short keeps what it measured)."""
    from vllm import LLM
    rows, tokens = [], {b: {} for b in args.batch}
    for n in args.moe_expert_cache_size:
        llm = LLM(model=path, dtype=str(dtype)[6:], device=device, moe_expert_cache_size=n,
                  max_num_seqs=max(args.batch), enforce_eager=args.enforce_eager,
                  attention_backend=args.attention_backend,
                  moe_expert_overlap=args.moe_expert_overlap,
                  moe_expert_cpu_compute=args.moe_expert_cpu_compute,
                  moe_expert_link_compression=args.moe_expert_link_compression,
                  async_scheduling=args.async_scheduling,
                  kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), seed=args.seed)
        if args.unrouted_experts:       # every routed expert loaded before the timed steps
            decode(llm, make_prompts(vocab, 32, 64, args.seed + 1), 1)
        for b in args.batch:
            prompts = make_prompts(vocab, b, args.prompt_len, args.seed)
            decode(llm, prompts, min(args.output_len, 4))                   # warm-up
            r = decode(llm, prompts, args.output_len)
            tokens[b][n] = r["tokens"]
            # In every row, so a run cut short (partial JSON) still says it.
            same = r["tokens"] == next(iter(tokens[b].values()))
            rows.append(dict(_row(n, b, r), graphs=graphs_summary(llm, args.enforce_eager),
                             tokens_match_first_size=same, **_cpu_cost(llm)))
            if args.profile_steps:
                trace = None if args.profile_trace_dir is None else \
                    os.path.join(args.profile_trace_dir, f"decode-n{n}-b{b}.json")
                rows[-1]["profile"] = profile_decode_steps(llm, prompts, args.profile_steps,
                                                           trace)
            if on_row is not None:
                on_row(rows)
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows, tokens


def run(args) -> dict:
    from vllm.platforms import platform_for, resolve_device
    dtype = DTYPES[args.dtype]
    config = make_config(args.random_model, dtype)
    result = {"preset": args.random_model, "shape": shape_summary(config, dtype)}
    E, k = result["shape"]["num_experts"], result["shape"]["top_k"]
    if args.unrouted_experts > E - k:
        raise ValueError(f"--unrouted-experts {args.unrouted_experts} is invalid for "
                         f"{args.random_model}: at most {E - k} (E={E} experts, top {k} routed)")
    if args.dry_run:
        return result
    device = resolve_device(args.device)
    tmp = None if args.checkpoint else tempfile.mkdtemp(prefix=f"decode-{args.random_model}-")
    path = args.checkpoint or tmp
    try:
        start = time.perf_counter()
        reused = os.path.exists(os.path.join(path, "config.json"))
        if reused:
            check_reusable(path, config, args.unrouted_experts)
        else:
            build_checkpoint(args.random_model, path, dtype, args.seed, args.unrouted_experts,
                             device)
        build_s = time.perf_counter() - start
        partial = dict(result, device=device, build_seconds=build_s, partial=True)
        rows, tokens = run_sizes(args, path, dtype, device, config.vocab_size,
                                 lambda rows: write_json(args.out, dict(partial, rows=rows)))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    identical = {str(b): all(t == next(iter(per.values())) for t in per.values())
                 for b, per in tokens.items()}
    result.update({
        "device": device, "device_name": platform_for(device).describe(torch.device(device)),
        "dtype": str(dtype)[6:], "prompt_len": args.prompt_len, "output_len": args.output_len,
        "batches": args.batch, "cache_sizes": args.moe_expert_cache_size,
        "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling,
        "moe_expert_overlap": args.moe_expert_overlap,
        "moe_expert_cpu_compute": args.moe_expert_cpu_compute,
        "moe_expert_link_compression": args.moe_expert_link_compression,
        "threads": torch.get_num_threads(),
        "checkpoint": args.checkpoint or "temporary", "checkpoint_reused": reused,
        "build_seconds": build_s, "rows": rows, "tokens_identical": identical,
        "all_tokens_identical": all(identical.values())})
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-model", required=True, help=f"preset: {sorted(PRESETS)}")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--moe-expert-cache-size", type=int, nargs="+", default=[0, 64, 32, 16],
                    metavar="N", help="expert slots per layer, one engine each (0 = off)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--enforce-eager", action="store_true", help="no CPU / CUDA graphs")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="launch each decode step before the last one's tokens are read")
    ap.add_argument("--attention-backend", default="auto",
                    help="the engine's attention_backend (e.g. flashinfer_paged)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also profile this many decode steps per row (launches per step)")
    ap.add_argument("--profile-trace-dir", default=None,
                    help="with --profile-steps: write each row's Chrome trace here "
                         "(decode-n{cache size}-b{batch}.json)")
    ap.add_argument("--moe-expert-overlap", action="store_true",
                    help="copy misses on a side stream while the hit experts compute (CUDA)")
    ap.add_argument("--moe-expert-cpu-compute", choices=["off", "auto", "always"], default="off",
                    help="compute missing experts on the CPU (eager steps; tokens may differ "
                         "by rounding off a CPU device)")
    ap.add_argument("--moe-expert-link-compression", choices=["off", "exp12"], default="off",
                    help="bf16 experts held and copied as exp12 (12 bits a weight, lossless)")
    ap.add_argument("--unrouted-experts", type=int, default=0, metavar="K",
                    help="zero the router rows of the last K experts (never routed: a cache of "
                         "E - K slots then hits on every access; see decode_models.UNROUTED)")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--checkpoint", default=None, help="build (or reuse) the checkpoint here")
    ap.add_argument("--dry-run", action="store_true", help="print the shape only; build nothing")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.random_model not in PRESETS:
        ap.error(f"--random-model {args.random_model!r} is invalid: must be one of "
                 f"{sorted(PRESETS)}")
    for flag, values, low in (("--batch", args.batch, 1),
                              ("--moe-expert-cache-size", args.moe_expert_cache_size, 0)):
        if any(v < low for v in values):
            ap.error(f"{flag} {values} is invalid: every value must be >= {low}")
    if args.profile_steps < 0:
        ap.error(f"--profile-steps {args.profile_steps} is invalid: must be >= 0")
    if args.unrouted_experts < 0:
        ap.error(f"--unrouted-experts {args.unrouted_experts} is invalid: must be >= 0")
    if args.profile_trace_dir is not None:
        if not args.profile_steps:
            ap.error("--profile-trace-dir needs --profile-steps K (K > 0)")
        os.makedirs(args.profile_trace_dir, exist_ok=True)
    for flag, value in (("--output-len", args.output_len), ("--prompt-len", args.prompt_len)):
        if value < 1:
            ap.error(f"{flag} {value} is invalid: must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads {args.threads} is invalid: must be >= 1")
    if args.kv_cache_gib <= 0:
        ap.error(f"--kv-cache-gib {args.kv_cache_gib} is invalid: must be > 0")
    return args


def _print_table(out: dict) -> None:
    sh = out["shape"]
    print(f"{out['preset']}: {sh['architecture']} H={sh['hidden']} I={sh['moe_intermediate']} "
          f"E={sh['num_experts']} k={sh['top_k']} x {sh['moe_layers']} MoE layers, "
          f"{sh['dtype']}: {sh['bytes_per_expert'] / 1e6:.2f} MB per expert, "
          f"{sh['expert_bytes'] / 1e9:.2f} GB of experts, checkpoint "
          f"{sh['checkpoint_bytes'] / 1e9:.2f} GB")
    if "rows" not in out:
        return
    print(f"on {out['device_name']}; tokens identical across cache sizes: "
          f"{out['tokens_identical']}")
    print("| cache N | batch | decode tok/s | hit rate | GB copied | copy GB/s |")
    print("|---|---|---|---|---|---|")
    for r in out["rows"]:
        hr = "off" if not r["cache_active"] else f"{r['hit_rate']:.3f}"
        print(f"| {r['moe_expert_cache_size']} | {r['batch']} | {r['tok_s']:.1f} | {hr} | "
              f"{r['bytes_copied'] / 1e9:.3f} | {r['copy_gbps']:.2f} |")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = run(args)
    write_json(args.out, out)
    print(json.dumps(out)) if args.json else _print_table(out)
    return out


if __name__ == "__main__":
    main()
