"""The engine's host work per decode step: everything a step does besides running the model.

    python benchmarks/benchmark_host_step.py [--batch 1 32] [--steps 200] [--repeat 5] [--json]
        [--out FILE.json]

On a GPU a decode step is one graph replay plus this host work (scheduling, the step's inputs,
sampling, detokenizing and stop checks, the outputs), which the GPU waits through: at batch 1
it is most of what stands between the replay and the next one. Measured on the CPU, where the
model's part can be separated exactly: a decode step there replays CPU graphs
(``kernels/cpu/graph.py``), and their replays are timed inside the step; host = step - replays.
The model is the tiny Qwen3-MoE preset of ``benchmark_decode.py`` (float32, one thread), so the
replays are short and the host's share is what the engine itself costs. Per batch: ``batch``
greedy requests of 5 prompt tokens (ignore_eos, FINAL_ONLY as ``LLM.generate``) decode
``--steps`` tokens; the best of ``--repeat`` runs of the mean step is reported.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from bench_io import write_json
from decode_models import build_checkpoint
from decode_profile import prefilled


class ReplayClock:
    """Seconds spent in ``CpuGraph.replay`` while installed (a wrapper on the class)."""

    def __init__(self):
        from vllm.kernels.cpu import graph
        self.cls, self.orig, self.seconds = graph.CpuGraph, graph.CpuGraph.replay, 0.0
        clock = self

        def replay(graph_self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return clock.orig(graph_self, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
        self.cls.replay = replay

    def close(self) -> None:
        self.cls.replay = self.orig


def decode_steps(engine, batch: int, steps: int, clock: ReplayClock) -> tuple[float, float, int]:
    """``batch`` requests prefilled, then their decode steps -> (seconds, replay seconds, steps)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    for i in range(batch):
        engine.add_request(f"host-{time.monotonic_ns()}-{i}", prompt, sp)
    while engine.has_unfinished_requests() and not prefilled(engine):
        engine.step()
    clock.seconds, n = 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    return time.perf_counter() - start, clock.seconds, n


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clock = ReplayClock()
    try:
        with tempfile.TemporaryDirectory() as path:
            build_checkpoint("tiny", path, torch.float32)
            llm = LLM(model=path, dtype="float32", device="cpu", max_num_seqs=max(args.batch),
                      seed=0)
            rows = []
            for b in args.batch:
                decode_steps(llm.llm_engine, b, 20, clock)                      # warm-up
                runs = [decode_steps(llm.llm_engine, b, args.steps, clock)
                        for _ in range(args.repeat)]
                secs, replay, n = min(runs, key=lambda r: r[0] / r[2])
                step_ms, replay_ms = secs / n * 1e3, replay / n * 1e3
                rows.append({"batch": b, "steps": n, "step_ms": step_ms, "replay_ms": replay_ms,
                             "host_ms": step_ms - replay_ms,
                             "host_ms_per_request": (step_ms - replay_ms) / b})
            llm.llm_engine.shutdown()
    finally:
        clock.close()
        torch.set_num_threads(threads)
    return {"model": "tiny (benchmark_decode preset), float32, 1 thread", "device": "cpu",
            "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    for flag, values in (("--batch", args.batch), ("--steps", [args.steps]),
                         ("--repeat", [args.repeat])):
        if any(v < 1 for v in values):
            ap.error(f"{flag} {values} is invalid: every value must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = run(args)
    write_json(args.out, out)
    if args.json:
        print(json.dumps(out))
    else:
        for r in out["rows"]:
            print(f"batch {r['batch']:>3}: step {r['step_ms']:.3f} ms = replays "
                  f"{r['replay_ms']:.3f} + host {r['host_ms']:.3f} ms "
                  f"({r['host_ms_per_request'] * 1e3:.1f} us per request)")
    return out


if __name__ == "__main__":
    main()
