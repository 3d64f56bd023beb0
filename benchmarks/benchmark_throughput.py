"""Offline throughput: requests/s and output tokens/s, optionally against transformers' generate.

    python benchmarks/benchmark_throughput.py --model PATH --num-prompts 32 --input-len 64 \
        --output-len 64 --hf-baseline [--moe-expert-cache-size N ...engine flags]

Prompts are random token ids (fixed seed), greedy, ignore_eos. With --random-range-ratio R each
request's input and output lengths are drawn uniformly from [L*(1-R), L*(1+R)] (as vLLM's own
benchmark does); 0 gives every request exactly --input-len / --output-len tokens.
With --hf-baseline the same prompts run through ``AutoModelForCausalLM.generate`` in one
left-padded batch in the same process; it must run every row to the longest output length, and
only each request's own output tokens are counted for it (the same useful tokens as the engine).
Each side runs --repeat timed passes over the same prompts after a warm-up; the figures are the
median pass (all pass times are in the --json output), which keeps a shared machine's noise out.

With --cache-sweep N1 N2 ... the engine is built once per expert-cache size (0 = no cache) and
the timed passes alternate between them (size by size, --repeat rounds), so every size sees the
same machine; the JSON's "cache_sweep" gives each size's median, its throughput relative to the
uncached engine, and the hit rate and copies of its timed passes (e.g. ``--cache-sweep 0 31``:
cached at N = E - 1 against uncached for the default model, E = 32).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from vllm.engine.arg_utils import EngineArgs


def _lengths(g: torch.Generator, n: int, length: int, ratio: float) -> list[int]:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def make_requests(vocab_size: int, num_prompts: int, input_len: int, output_len: int,
                  ratio: float, seed: int) -> tuple[list[list[int]], list[int]]:
    """-> (prompts as token ids, output length of each request)."""
    g = torch.Generator().manual_seed(seed)
    in_lens = _lengths(g, num_prompts, input_len, ratio)
    out_lens = _lengths(g, num_prompts, output_len, ratio)
    low = min(8, vocab_size - 1)  # skip the lowest ids (often special tokens)
    prompts = [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in in_lens]
    return prompts, out_lens


def run_engine(args, prompts, out_lens, repeat: int) -> tuple[list[float], int, torch.dtype]:
    """-> (seconds of each timed pass, output tokens of a pass, the dtype the engine ran in)."""
    from vllm import LLM, SamplingParams
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return (times, sum(len(o.outputs[0].token_ids) for o in outs),
            llm.llm_engine.vllm_config.model_config.dtype)


def run_cache_sweep(args, prompts, out_lens, sizes: list[int], repeat: int) -> list[dict]:
    """One engine per cache size, timed passes interleaved across sizes -> one row per size."""
    from vllm import LLM, SamplingParams
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    llms = {}
    for n in sizes:
        args.moe_expert_cache_size = n
        llms[n] = LLM(**vars(EngineArgs.from_cli_args(args)))
        llms[n].generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    before = {n: llm.get_moe_cache_stats() for n, llm in llms.items()}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    n_out = 0
    for _ in range(repeat):
        for n, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[n].append(time.perf_counter() - start)
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    rows = []
    for n, llm in llms.items():
        row = {"moe_expert_cache_size": n, "seconds": _median(times[n]), "all_seconds": times[n],
               "output_tokens_per_s": n_out / _median(times[n])}
        row["relative_to_uncached"] = (_median(times[sizes[0]]) / row["seconds"]
                                       if sizes[0] == 0 else None)
        after = llm.get_moe_cache_stats()
        if after is not None:
            d = {k: after[k] - before[n][k] for k in ("hits", "misses", "bytes_copied")}
            row["hit_rate"] = d["hits"] / max(1, d["hits"] + d["misses"])
            row["misses_per_pass"] = d["misses"] / repeat
            row["bytes_copied_per_pass"] = d["bytes_copied"] / repeat
            row["copy_seconds_per_pass"] = row["misses_per_pass"] * copy_seconds_per_expert(llm)
            if "prefetch_loads" in after:          # --moe-expert-prefetch next-layer
                p = {k: after[k] - before[n][k] for k in ("prefetch_loads", "prefetch_used",
                                                          "prefetch_wasted", "prefetch_recalled",
                                                          "prefetch_needed")}
                row["prefetch_recall"] = p["prefetch_recalled"] / max(1, p["prefetch_needed"])
                row["prefetch_loads_per_pass"] = p["prefetch_loads"] / repeat
                row["prefetch_wasted_per_pass"] = p["prefetch_wasted"] / repeat
        rows.append(row)
    return rows


def copy_seconds_per_expert(llm) -> float:
    """Median seconds the cache's own copy engine takes per expert (all its tensors), copying
    every expert of the first cached layer's store in turn into its slots, N at a time."""
    provider = next(m.expert_cache for m in llm.llm_engine.runner.moe_layers
                    if m.expert_cache is not None)
    from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
    E, N = provider.num_experts, provider.num_slots
    saved = {k: v.clone() for k, v in provider.slots.items()}
    times = []
    for i in range(0, 20 * E, N):
        experts = torch.arange(i, i + N) % E
        plan = LoadPlan(torch.arange(N), experts, torch.ones(N, dtype=torch.bool))
        start = time.perf_counter()
        provider.copy(provider.slots, plan)
        times.append((time.perf_counter() - start) / N)
    for k, v in saved.items():          # the slots must hold what the residency says again
        provider.slots[k].copy_(v)
    return _median(times)


def run_hf(model_path: str, prompts, out_lens, dtype: torch.dtype,
           repeat: int) -> tuple[list[float], int]:
    """transformers in ``dtype``: the engine's resolved dtype, so ``--dtype auto`` compares the
    checkpoint's dtype on both sides."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])          # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    steps = max(out_lens)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)  # warm-up
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=steps,
                                 min_new_tokens=steps, do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - start)
    assert out.shape[1] - width == steps
    return times, sum(out_lens)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="spread of input/output lengths around --input-len/--output-len, in [0, 1)")
    p.add_argument("--hf-baseline", action="store_true")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per side (median reported)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for both engines (default: torch's choice)")
    p.add_argument("--cache-sweep", type=int, nargs="+", default=None, metavar="N",
                   help="expert-cache sizes to compare in one run, passes interleaved (0 = off; "
                        "put 0 first for ratios to the uncached engine)")
    EngineArgs.add_cli_args(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vllm import DEFAULT_MODEL
    args.model = args.model or DEFAULT_MODEL
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts, out_lens = make_requests(vocab, args.num_prompts, args.input_len, args.output_len,
                                      args.random_range_ratio, args.seed)
    if args.repeat < 1:
        p.error(f"--repeat={args.repeat} is invalid: must be >= 1")
    if args.cache_sweep:
        if any(n < 0 for n in args.cache_sweep):
            p.error(f"--cache-sweep={args.cache_sweep} is invalid: sizes must be >= 0")
        rows = run_cache_sweep(args, prompts, out_lens, args.cache_sweep, args.repeat)
        result = {"model": args.model, "num_prompts": args.num_prompts,
                  "input_len": args.input_len, "output_len": args.output_len,
                  "threads": torch.get_num_threads(), "dtype": args.dtype,
                  "device": args.device, "enforce_eager": args.enforce_eager,
                  "repeat": args.repeat, "cache_sweep": rows}
        print(json.dumps(result) if args.json else "\n".join(
            f"cache {r['moe_expert_cache_size']:>3}: {r['output_tokens_per_s']:.1f} output tok/s"
            + (f", {r['relative_to_uncached']:.3f}x uncached" if r["relative_to_uncached"] else "")
            + (f", hit rate {r['hit_rate']:.3f}" if "hit_rate" in r else "") for r in rows))
        return result
    times, n_out, dtype = run_engine(args, prompts, out_lens, args.repeat)
    elapsed = _median(times)
    result = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
              "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
              "moe_expert_cache_size": args.moe_expert_cache_size,
              "repeat": args.repeat,
              "engine": {"seconds": elapsed, "all_seconds": times, "requests_per_s": args.num_prompts / elapsed,
                         "output_tokens_per_s": n_out / elapsed}}
    if args.hf_baseline:
        hf_times, hf_out = run_hf(args.model, prompts, out_lens, dtype, args.repeat)
        hf_elapsed = _median(hf_times)
        result["hf"] = {"seconds": hf_elapsed, "all_seconds": hf_times, "requests_per_s": args.num_prompts / hf_elapsed,
                        "output_tokens_per_s": hf_out / hf_elapsed}
        result["speedup_vs_hf"] = hf_elapsed / elapsed * (n_out / max(hf_out, 1))
    if args.json:
        print(json.dumps(result))
    else:
        e = result["engine"]
        print(f"engine: {e['requests_per_s']:.2f} req/s, {e['output_tokens_per_s']:.1f} output tok/s "
              f"({e['seconds']:.2f} s)")
        if "hf" in result:
            h = result["hf"]
            print(f"transformers: {h['requests_per_s']:.2f} req/s, {h['output_tokens_per_s']:.1f} "
                  f"output tok/s ({h['seconds']:.2f} s)")
            print(f"speedup (output tok/s): {result['speedup_vs_hf']:.2f}x")
    return result


if __name__ == "__main__":
    main()
