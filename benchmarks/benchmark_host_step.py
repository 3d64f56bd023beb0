"""The engine's host work per decode step: everything a step does besides running the model.

    python benchmarks/benchmark_host_step.py [--batch 1 32] [--steps 200] [--repeat 5] [--json]
        [--async-scheduling] [--cuda-graph-path] [--out FILE.json]

On a GPU a decode step is one graph replay plus this host work (scheduling, the step's inputs,
sampling, detokenizing and stop checks, the outputs), which the GPU waits through: at batch 1
it is most of what stands between the replay and the next one. Measured on the CPU, where the
model's part can be separated exactly: a decode step there replays CPU graphs
(``kernels/cpu/graph.py``), and their replays are timed inside the step; host = step - replays.
``inputs_ms``: the part of it in ``ModelRunner._prepare_inputs`` (the step's input tensors).
The model is the tiny Qwen3-MoE preset of ``benchmark_decode.py`` (float32, one thread), so the
replays are short and the host's share is what the engine itself costs. Per batch: ``batch``
greedy requests of 5 prompt tokens (ignore_eos, FINAL_ONLY as ``LLM.generate``) decode
``--steps`` tokens; the best of ``--repeat`` runs of the mean step is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time

import torch
from bench_io import write_json
from decode_models import build_checkpoint
from decode_profile import prefilled, summarize


class MethodClock:
    """Seconds spent in ``cls.name`` while installed (a wrapper on the class)."""

    def __init__(self, cls, name: str):
        self.cls, self.name, self.orig, self.seconds = cls, name, getattr(cls, name), 0.0
        clock = self

        def timed(obj, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return clock.orig(obj, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
        setattr(cls, name, timed)

    def close(self) -> None:
        setattr(self.cls, self.name, self.orig)


def decode_steps(engine, batch: int, steps: int, clocks: list[MethodClock]
                 ) -> tuple[float, list[float], int]:
    """``batch`` requests prefilled, then their decode steps -> (seconds, each clock's seconds in
    them, steps)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    for i in range(batch):
        engine.add_request(f"host-{time.monotonic_ns()}-{i}", prompt, sp)
    while engine.has_unfinished_requests() and not prefilled(engine):
        engine.step()
    for c in clocks:
        c.seconds = 0.0
    n, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    return time.perf_counter() - start, [c.seconds for c in clocks], n


def aten_ops_per_step(engine, batch: int, steps: int) -> float:
    """torch ops the host dispatches per decode step, counted as ``decode_profile.summarize``
    counts them on a GPU (torch.profiler's aten:: events, nested ones included)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds, _, n = decode_steps(engine, batch, steps, [])
    return summarize(prof.key_averages(), max(n, 1), seconds)["torch_ops_per_step"]


@contextlib.contextmanager
def cuda_graph_path():
    """Decode steps through ``CudaDecodeGraphs`` on CPU (the CUDA path's staging, its copy, the
    sampling of its logits), each replay returning the output its capture computed: a step
    then costs the engine's host work alone, ``replay_ms`` is 0."""
    from vllm.worker import cuda_graphs
    from vllm.worker.graph_capture import GraphCapturer

    class Captured(GraphCapturer):
        def capture(self, fn):
            out = fn()
            return lambda: out
    saved = cuda_graphs.uses_cuda_graphs, cuda_graphs.default_capturer
    cuda_graphs.uses_cuda_graphs = lambda device: True
    cuda_graphs.default_capturer = lambda device: Captured()
    try:
        yield
    finally:
        cuda_graphs.uses_cuda_graphs, cuda_graphs.default_capturer = saved


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM
    from vllm.kernels.cpu.graph import CpuGraph
    from vllm.worker.model_runner import ModelRunner
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clocks = [MethodClock(CpuGraph, "replay"), MethodClock(ModelRunner, "_prepare_inputs")]
    path_ctx = cuda_graph_path() if args.cuda_graph_path else contextlib.nullcontext()
    try:
        with tempfile.TemporaryDirectory() as path, path_ctx:
            build_checkpoint("tiny", path, torch.float32)
            llm = LLM(model=path, dtype="float32", device="cpu", max_num_seqs=max(args.batch),
                      seed=0, async_scheduling=args.async_scheduling)
            rows = []
            for b in args.batch:
                decode_steps(llm.llm_engine, b, 20, clocks)                     # warm-up
                runs = [decode_steps(llm.llm_engine, b, args.steps, clocks)
                        for _ in range(args.repeat)]
                secs, (replay, inputs), n = min(runs, key=lambda r: r[0] / r[2])
                step_ms, replay_ms = secs / n * 1e3, replay / n * 1e3
                rows.append({"batch": b, "steps": n, "step_ms": step_ms, "replay_ms": replay_ms,
                             "host_ms": step_ms - replay_ms,
                             "host_ms_per_request": (step_ms - replay_ms) / b,
                             "inputs_ms": inputs / n * 1e3,
                             "aten_ops_per_step": aten_ops_per_step(llm.llm_engine, b, 40)})
            llm.llm_engine.shutdown()
    finally:
        for c in clocks:
            c.close()
        torch.set_num_threads(threads)
    return {"model": "tiny (benchmark_decode preset), float32, 1 thread", "device": "cpu",
            "async_scheduling": args.async_scheduling, "cuda_graph_path": args.cuda_graph_path,
            "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the engine schedules each decode step ahead (its host work is the "
                         "same; on a GPU it overlaps the device's)")
    ap.add_argument("--cuda-graph-path", action="store_true",
                    help="decode steps through the CUDA graphs' code on CPU, each replay "
                         "returning its capture's output (the CUDA path's host work alone)")
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
                  f"({r['host_ms_per_request'] * 1e3:.1f} us per request; the step's inputs "
                  f"{r['inputs_ms'] * 1e3:.1f} us; {r['aten_ops_per_step']:.0f} torch ops)")
    return out


if __name__ == "__main__":
    main()
