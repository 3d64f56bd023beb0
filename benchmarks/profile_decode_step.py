"""Where one decode step's time goes: the C kernels (each timed around its ctypes call) against
everything else (Python, small torch ops, scheduling, output processing).

    python benchmarks/profile_decode_step.py [--model PATH] [--batch 32] [--threads 1]
        [--steps 40] [--dtype float32] [--moe-expert-cache-size N] [--enforce-eager]

Runs ``--batch`` requests of 64 random prompt tokens, skips the prefill and 20 warm-up steps,
then times ``--steps`` decode steps of the full batch. Decode steps replay a CPU graph as the
engine does by default, so the forward's kernels show as one ``run_graph``; ``--enforce-eager``
runs them one call at a time, each timed. Needs the CPU kernels (it reports what they
take, so it refuses to run without them).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch


class _Timed:
    def __init__(self, fn, totals: dict, name: str):
        self.fn, self.totals, self.name = fn, totals, name

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.totals[self.name] += time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--moe-expert-cache-size", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CPU graphs: every kernel call of the forward timed on its own")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from vllm.kernels.cpu.build import SIGNATURES, load_cpu_kernels
    lib = load_cpu_kernels()
    if lib is None:
        p.error("the CPU kernels are unavailable (VLLM_CPU_KERNELS=0 or no C compiler)")
    totals: dict[str, float] = collections.defaultdict(float)
    originals = {name: getattr(lib, name) for name in SIGNATURES}
    for name, fn in originals.items():
        setattr(lib, name, _Timed(fn, totals, name))
    try:
        step_ms = _time_steps(args, totals)
    finally:
        for name, fn in originals.items():      # the library object is shared process-wide
            setattr(lib, name, fn)
    kernels_ms = {k: v / args.steps * 1e3 for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    total_kernels = sum(kernels_ms.values())
    print(f"batch={args.batch} threads={args.threads} dtype={args.dtype} "
          f"cache={args.moe_expert_cache_size} eager={args.enforce_eager}: step {step_ms:.2f} ms = "
          f"C kernels {total_kernels:.2f} ms + rest {step_ms - total_kernels:.2f} ms")
    for name, ms in kernels_ms.items():
        print(f"  {name:24s} {ms:.3f} ms")
    return {"step_ms": step_ms, "kernels_ms": kernels_ms}


def _time_steps(args, totals: dict) -> float:
    """ms per decode step of the full batch, after the prefill and warm-up (``totals`` reset)."""
    from vllm import LLM, SamplingParams
    kwargs = dict(device="cpu", dtype=args.dtype, moe_expert_cache_size=args.moe_expert_cache_size,
                  enforce_eager=args.enforce_eager)
    llm = LLM(args.model, **kwargs) if args.model else LLM(**kwargs)
    engine = llm.llm_engine
    vocab = engine.runner.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    from vllm.worker.cpu_graphs import DecodeGraphs
    warmup = DecodeGraphs.CAPTURE_AFTER + 5            # prefill, graph capture, warm-up
    params = SamplingParams(max_tokens=args.steps + warmup + 3, ignore_eos=True, temperature=0)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": torch.randint(
            8, vocab, (64,), generator=g).tolist()}, params)
    for _ in range(warmup):
        engine.step()
    totals.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    return (time.perf_counter() - start) / args.steps * 1e3


if __name__ == "__main__":
    main()
