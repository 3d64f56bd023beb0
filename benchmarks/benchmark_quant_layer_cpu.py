"""One MoE layer of quantized experts on the C expert kernel, alone: best microseconds per
``apply_pairs`` call (no engine, no routing, no cache), for comparing kernel chains.

    python benchmarks/benchmark_quant_layer_cpu.py [--schemes gptq-g128-asym gptq-g128-asym-descact]
        [--experts 8 --top-k 4 --hidden 2048 --inter 768] [--tokens 1 32] [--threads 1] [--json]

Schemes: fp8-{tensor,channel,block}, gptq-g{32,64,128}-{sym,asym}[-descact] (RTN weights from
the methods' own quantizers; ``-descact`` permutes the group order as act order does). Each
(scheme, dtype, T) row is the best of ``--reps`` calls (default 200 at T = 1, 30 above) after
one warm-up call; the minimum, because a shared machine's load only ever adds time.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.fused_moe.registry import CpuKernelExperts
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod, quantize_fp8
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod, quantize_gptq
from vllm.model_executor.layers.quantization.moe_ref import stack_experts


def scheme_parts(name: str):
    """'fp8-block' / 'gptq-g128-asym-descact' -> (method, quantize one weight [out, in])."""
    if name.startswith("fp8-"):
        strategy = name[4:]
        method = Fp8MoEMethod(strategy, (128, 128)) if strategy == "block" else \
            Fp8MoEMethod(strategy)
        return method, lambda w: quantize_fp8(w, strategy)
    parts = name.split("-")
    if parts[0] != "gptq" or len(parts) not in (3, 4) or parts[2] not in ("sym", "asym"):
        raise SystemExit(f"unknown scheme {name!r}: fp8-tensor|channel|block, "
                         "gptq-g<size>-sym|asym[-descact]")
    group, sym, act = int(parts[1][1:]), parts[2] == "sym", len(parts) == 4
    return GptqMoEMethod(group, sym, act), lambda w: quantize_gptq(w, group, sym, act)


def packed_layer(name: str, E: int, H: int, N: int):
    """E random experts (gate, up [N, H], down [H, N]) in ``name`` -> (kernel, packed)."""
    method, quant = scheme_parts(name)
    g = torch.Generator().manual_seed(0)
    per_expert = []
    for _ in range(E):
        cks = [quant(torch.randn(*shape, generator=g) * 0.2) for shape in ((N, H), (N, H), (H, N))]
        per_expert.append(method.expert_from_checkpoint(*cks))
    stacked = stack_experts(per_expert)
    kernel = CpuKernelExperts(MoEActivation.of("silu"))
    kernel.bind_scheme(method)
    return kernel, kernel.pack(stacked)


def best_us(kernel, packed, T: int, E: int, K: int, H: int, dtype, reps: int) -> float:
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(dtype)
    out = torch.zeros(T, K, H, dtype=dtype)
    kernel.apply_pairs(packed, x, wts, ids, out)            # warm-up (first-call setup)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel.apply_pairs(packed, x, wts, ids, out)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemes", nargs="+", default=["gptq-g128-asym", "gptq-g128-asym-descact"])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None, help="calls per row (default 200 / 30)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.schemes:
        kernel, packed = packed_layer(name, args.experts, args.hidden, args.inter)
        for dtype in (torch.float32, torch.bfloat16):
            for T in args.tokens:
                reps = args.reps or (200 if T == 1 else 30)
                us = best_us(kernel, packed, T, args.experts, args.top_k, args.hidden, dtype, reps)
                rows.append({"scheme": name, "dtype": str(dtype).replace("torch.", ""),
                             "tokens": T, "best_us": round(us, 1)})
                if not args.json:
                    print(f"{name:24s} {rows[-1]['dtype']:9s} T={T:<4d} {us:10.1f} us", flush=True)
    if args.json:
        print(json.dumps({"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                          "inter": args.inter, "threads": args.threads, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
