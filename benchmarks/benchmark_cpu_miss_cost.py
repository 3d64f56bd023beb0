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
        [--scheme bf16 fp8-tensor fp8-channel fp8-block w4a16-gptq w4a16-gptq-act nvfp4 mxfp4]
        [--dequantize-too]

``--scheme``: the experts' format in the host store (default bf16). Quantized experts are in the
layer layout (FP8 128 x 128 blocks, GPTQ group 128 with zero points, NVFP4, MXFP4: the silu
expert, not GPT-OSS's swigluoai, whose cost is the same products) and run through the CPU's
quantized matrix product on that layout (``kernels/cpu/qgemv.py``); ``--dequantize-too`` adds a
row per quantized scheme for the path without it (each expert dequantized, then the products).

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

from functools import partial

import torch
from bench_io import with_threads
from benchmark_decode import PRESETS

from vllm.model_executor.layers.fused_moe.expert_cache.host_compute import (HostCostModel,
                                                                         HostMissCompute,
                                                                         measure_cost_model)
from vllm.model_executor.layers.fused_moe.expert_cache.host_experts import HostExperts
from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import encode
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.quantization.base import MoEShape
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod

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


SCHEMES = ("bf16", "bf16-exp12", "fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq",
           "w4a16-gptq-act", "nvfp4", "mxfp4")
"""Expert formats of ``--scheme``: bf16; bf16 held as exp12 planes (``bf16-exp12``: link
compression's host store, read by ``gemv16_exp12``; its copy is a RAM copy of the planes); or the
layer layouts of FP8 (128 x 128 blocks), GPTQ INT4 (group 128, zero points; ``-act``: act
order, each projection's g_idx a random permutation of its groups), NVFP4 and MXFP4, as a GPU
backend that reads them keeps the host store."""


def measure(hidden: int, inter: int, threads: int, repeats: int, scheme: str = "bf16",
            path: str = "qgemv", experts: int = 8) -> dict:
    """One row at ``threads`` intra-op threads (the process's count is restored after)."""
    return with_threads(threads, _measure, hidden, inter, threads, repeats, scheme, path,
                        experts)


def quantized_store(method, hidden: int, inter: int, experts: int, g: torch.Generator
                    ) -> dict[str, torch.Tensor]:
    """Random experts in ``method``'s layer layout: codes and words of random bits (e4m3 NaN
    codes excluded), positive scales, zero points, contiguous g_idx groups; each expert goes
    through the method's ``process_expert`` as loading does."""
    store = {}
    for name, spec in method.layout(MoEShape(experts, hidden, inter, torch.bfloat16)).items():
        shape = (experts, *spec.shape)
        if spec.dtype == torch.float8_e4m3fn:
            t = torch.randint(0, 126, shape, generator=g, dtype=torch.uint8).view(spec.dtype)
        elif spec.dtype == torch.uint8:           # FP4 code pairs; MXFP4's e8m0 scales near 1
            lo, hi = (115, 136) if name.endswith("scales") else (0, 256)
            t = torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)
        elif name.endswith("g_idx"):
            width = spec.shape[1]
            t = (torch.arange(width) // method.group_width(width)).to(spec.dtype).expand(shape)
            if method.desc_act:
                t = t[..., torch.randperm(width, generator=g)]
        elif spec.dtype == torch.int32:
            t = torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32)
        else:
            t = (torch.rand(shape, generator=g) * 0.01 + 1e-3).to(spec.dtype)
        store[name] = t.contiguous()
    for e in range(experts):
        method.process_expert({n: t[e] for n, t in store.items()})
    return store


def _store(scheme: str, hidden: int, inter: int, experts: int, path: str):
    """(host store, HostExperts, the path it takes: "gemv16" or "torch" for bf16, else
    "qgemv" or "dequantize") of ``experts`` random experts in ``scheme``; path "dequantize"
    asks for the path without the C kernel."""
    g = torch.Generator().manual_seed(0)
    act = MoEActivation.of("silu")
    if scheme == "bf16-exp12":               # the same experts as bf16's, as their planes
        store, host, _ = _store("bf16", hidden, inter, experts, "qgemv")
        return {n: encode(t) for n, t in store.items()}, host, "gemv16_exp12"
    if scheme == "bf16":
        store = {"w13_weight": (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02
                                ).to(torch.bfloat16),
                 "w2_weight": (torch.randn(experts, hidden, inter, generator=g) * 0.02
                               ).to(torch.bfloat16)}
        # "gemv16": the store's rows read in place (kernels/cpu/gemv16.c); "torch": torch.mv.
        return store, HostExperts(act, gemv=path != "dequantize"), \
            "gemv16" if path != "dequantize" else "torch"
    method = {"w4a16-gptq": lambda: GptqMoEMethod(128, False, False),
              "w4a16-gptq-act": lambda: GptqMoEMethod(128, False, True), "nvfp4": Nvfp4MoEMethod,
              "mxfp4": Mxfp4MoEMethod}.get(scheme, lambda: Fp8MoEMethod(
                  scheme[4:], (128, 128) if scheme == "fp8-block" else None))()
    store = quantized_store(method, hidden, inter, experts, g)
    if method.host_rows({n: t[0] for n, t in store.items()}) is None:
        path = "dequantize"                  # a layout qgemv does not read (e.g. split blocks)
    return store, HostExperts(act, method.dequantizer(),
                              method.host_rows if path == "qgemv" else None), path


def _measure(hidden: int, inter: int, threads: int, repeats: int, scheme: str, path: str,
             experts: int) -> dict:
    store, host, path = _store(scheme, hidden, inter, experts, path)
    if scheme == "bf16-exp12":
        slots = {n: torch.empty(2, t.bytes_per_expert, dtype=torch.uint8)
                 for n, t in store.items()}
        copy = partial(_copy_planes, store)
        expert_bytes = sum(t.bytes_per_expert for t in store.values())
    else:
        slots = {n: torch.empty_like(t[:2]) for n, t in store.items()}
        copy = None
        expert_bytes = sum(t[0].numel() * t.element_size() for t in store.values())
    runs = [measure_cost_model(store, slots, host, hidden, torch.bfloat16, copy=copy)
            for _ in range(repeats)]
    cpu_1 = statistics.median(r.cpu_fixed + r.cpu_per_token for r in runs)
    return {"hidden": hidden, "moe_intermediate": inter, "threads": threads,
            "scheme": scheme, "path": path,
            "expert_bytes": expert_bytes, "repeats": repeats,
            "cpu_1_token_ms": cpu_1 * 1e3,
            "cpu_per_token_ms": statistics.median(r.cpu_per_token for r in runs) * 1e3,
            "ram_copy_ms": statistics.median(r.copy_seconds for r in runs) * 1e3,
            "break_even_gbps": expert_bytes / cpu_1 / 1e9}


def _copy_planes(store: dict, slots: dict, plan) -> None:
    """bf16-exp12's "copy": an expert's planes into a byte row of its slot (RAM to RAM)."""
    e = int(plan.experts[0])
    for n, t in store.items():
        out, at = slots[n][0], 0
        for p in t.planes:
            row = p[e].view(torch.uint8)
            out[at:at + row.numel()].copy_(row)
            at += row.numel()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["probe-4.8g"], choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=5, help="cost models measured per row")
    ap.add_argument("--scheme", nargs="+", default=["bf16"], choices=SCHEMES,
                    help="expert formats (quantized: the CPU's qgemv on the scheme's layout)")
    ap.add_argument("--dequantize-too", action="store_true",
                    help="also time each scheme without its C kernel: quantized ones "
                         "dequantizing the expert first (no qgemv), bf16 through torch.mv (no "
                         "gemv16)")
    ap.add_argument("--json", action="store_true", help="print one JSON list")
    args = ap.parse_args(argv)
    if args.repeats < 1 or any(t < 1 for t in args.threads):
        ap.error(f"--repeats {args.repeats} and --threads {args.threads} must be >= 1")
    paths = ["qgemv", "dequantize"] if args.dequantize_too else ["qgemv"]
    rows = [{"shape": s, **measure(*SHAPES[s], t, args.repeats, scheme, path)}
            for s in args.shape for t in args.threads for scheme in args.scheme
            for path in (paths if scheme != "bf16-exp12" else ["qgemv"])]
    for s in args.shape:
        decision = {"decision_us": time_decision(*ROUTING[s], False),
                    "decision_balance_us": time_decision(*ROUTING[s], True)}
        for r in rows:
            if r["shape"] == s:
                r.update(decision)
    print(json.dumps(rows) if args.json else "\n".join(map(str, rows)))
    return rows


if __name__ == "__main__":
    main()
