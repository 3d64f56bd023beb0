"""Tune the Triton fused-MoE block sizes on this GPU and write its table (vLLM's benchmark_moe
--tune, for ``vllm/kernels/triton/configs``).

    python tools/tune_fused_moe.py --hidden 2048 --intermediate 768 --experts 64 --top-k 8 \\
        --dtype bf16 --tokens 1 2 4 8 16 32 64 128 256 --write

For each token count T it times every candidate block configuration (``--search quick``: 24,
``full``: 288) on random routing (CUDA events, median of ``--iters`` calls after a warm-up),
drops those that fail to launch (e.g. out of shared memory) or whose output is not the default
configuration's within the dtype's rounding, and keeps the fastest. The entries become the
``"N=<intermediate>"`` list of the device's table (``max_m`` = each T, the last null), merged into
``configs/<device name>.json`` with ``--write`` (or written to ``--out``); other keys of that
file are kept. Tables are keyed by the intermediate size only (never the expert count:
``fused_moe_config``). Timing needs a GPU; ``--device cpu`` runs Triton's interpreter, for
tests only (its times mean nothing). Prints one JSON object with every measurement.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
"""rtol = atol of a candidate's output against the default configuration's (f32 sums in
another order, rounded to the dtype)."""
SEARCH = {
    "quick": dict(BLOCK_M=[16, 32, 64], BLOCK_N=[64, 128], BLOCK_K=[64, 128], GROUP_M=[8],
                  num_warps=[4], num_stages=[3, 4]),
    "full": dict(BLOCK_M=[16, 32, 64, 128], BLOCK_N=[32, 64, 128], BLOCK_K=[64, 128, 256],
                 GROUP_M=[1, 8], num_warps=[4, 8], num_stages=[3, 4]),
    "test": dict(BLOCK_M=[16, 32], BLOCK_N=[32], BLOCK_K=[32], GROUP_M=[1], num_warps=[4],
                 num_stages=[2]),
}


def candidates(search: str) -> list[dict[str, int]]:
    space = SEARCH[search]
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def make_inputs(T: int, args, device: str):
    g = torch.Generator().manual_seed(T)
    dt, H, N, E, K = DTYPES[args.dtype], args.hidden, args.intermediate, args.experts, args.top_k
    x = torch.randn(T, H, generator=g).to(dt)
    w13 = (torch.randn(E, 2 * N, H, generator=g) / H ** 0.5).to(dt)
    w2 = (torch.randn(E, H, N, generator=g) / N ** 0.5).to(dt)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).to(dt)
    return [t.to(device) for t in (x, w13, w2, w, ids)]


def time_call(fn, iters: int, device: str) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tune_tokens(T: int, args, device: str, device_name: str) -> dict:
    """Every candidate at T tokens -> {"tokens", "best", "best_ms", "tried": [...]}."""
    from vllm.kernels.triton.fused_moe import fused_moe
    x, w13, w2, w, ids = make_inputs(T, args, device)
    want = fused_moe(x, w13, w2, w, ids, device_name=device_name).float()
    tol = TOL[x.dtype]
    tried, best = [], None
    for cfg in candidates(args.search):
        def call(cfg=cfg):
            return fused_moe(x, w13, w2, w, ids, config=cfg, device_name=device_name)
        row = {"config": cfg}
        try:
            got = call().float()
            if not torch.allclose(got, want, rtol=tol, atol=tol):
                row["status"] = f"wrong: max |diff| {(got - want).abs().max().item():.3g}"
            else:
                row.update(status="ok", ms=time_call(call, args.iters, device))
        except Exception as e:                 # noqa: BLE001 - a config that cannot launch
            row["status"] = f"{type(e).__name__}: {str(e)[:200]}"
        tried.append(row)
        if row["status"] == "ok" and (best is None or row["ms"] < best["ms"]):
            best = row
    if best is None:
        raise SystemExit(f"tune_fused_moe: no candidate ran correctly at {T} tokens: {tried}")
    return {"tokens": T, "best": best["config"], "best_ms": best["ms"], "tried": tried}


def table_entries(results: list[dict]) -> list[dict]:
    """Fastest config per token count -> table entries: max_m = T, the last max_m null."""
    rows = sorted(results, key=lambda r: r["tokens"])
    entries = [{"max_m": r["tokens"], **r["best"]} for r in rows]
    entries[-1]["max_m"] = None
    return entries


def merged_table(path: str, device_name: str, key: str, entries: list[dict],
                 comment: str) -> dict:
    """The table at ``path``, else the device's shipped table, else the default table's
    "default" list, with ``key`` set to ``entries`` and a comment saying how they were made."""
    from vllm.kernels.triton.fused_moe_config import CONFIG_DIR, DEFAULT_TABLE, table_file_name
    shipped = os.path.join(CONFIG_DIR, table_file_name(device_name)) if device_name else ""
    if os.path.isfile(path) or os.path.isfile(shipped):
        with open(path if os.path.isfile(path) else shipped) as f:
            table = json.load(f)
    else:
        with open(os.path.join(CONFIG_DIR, DEFAULT_TABLE)) as f:
            table = {"default": json.load(f)["default"]}
    table[key] = entries
    table[f"_tuned_{key}"] = comment
    return table


def run(args) -> dict:
    from vllm.kernels.triton.fused_moe_config import CONFIG_DIR, table_file_name
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else ""
    results = [tune_tokens(T, args, device, device_name) for T in args.tokens]
    key = f"N={args.intermediate}"
    entries = table_entries(results)
    out = {"device": device, "device_name": device_name or "cpu (interpreter: times mean "
           "nothing)", "key": key, "entries": entries, "results": results}
    path = args.out or (os.path.join(CONFIG_DIR, table_file_name(device_name))
                        if args.write else None)
    if path:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        comment = (f"tuned on {out['device_name']} at {when}: python tools/tune_fused_moe.py "
                   + shlex.join(args.argv))
        table = merged_table(path, device_name, key, entries, comment)   # read, then write
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        out["written"] = path
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--intermediate", type=int, required=True, help="moe_intermediate_size")
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--search", choices=sorted(SEARCH), default="quick")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    ap.add_argument("--write", action="store_true", help="merge into this GPU's table file")
    ap.add_argument("--out", default=None, help="write the merged table here instead")
    args = ap.parse_args(argv)
    for flag, value in (("--hidden", args.hidden), ("--intermediate", args.intermediate),
                        ("--experts", args.experts), ("--iters", args.iters)):
        if value < 1:
            ap.error(f"{flag} {value} is invalid: must be >= 1")
    if not 1 <= args.top_k <= args.experts:
        ap.error(f"--top-k {args.top_k} is invalid: must be in [1, --experts {args.experts}]")
    if min(args.tokens) < 1:
        ap.error(f"--tokens {args.tokens} is invalid: every value must be >= 1")
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: list[str] | None = None) -> dict:
    out = run(parse_args(argv))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
