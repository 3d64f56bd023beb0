"""How much exp12 (``--moe-expert-link-compression exp12``) saves on a checkpoint's experts, and
how fast they encode at load.

    python benchmarks/benchmark_link_codec.py [--model DIR] [--threads 2] [--json] [--out F]

Reads the checkpoint's safetensors (the shipped default model without ``--model``), groups the
expert tensors the way the cache stores them (per-expert tensors ``...experts.J.NAME`` stacked
over J; tensors already stacked [E, ...] as they are), and encodes each bf16 group
(``expert_cache/link_codec.py``), one group in memory at a time. Reports the weights, the
planes' bits per weight (escapes and their padding included), the escaped fraction, and the
encoder's speed in GB/s of bf16 (the C encoder where the CPU kernels are built). Groups exp12
cannot hold (not bf16, not a multiple of 128 weights per expert) are listed with the reason.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import torch
from bench_io import with_threads, write_json
from safetensors import safe_open

from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import encode, refusal

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "vllm" / "models" / "default"
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(.+)$")


def expert_groups(files: list[Path]) -> dict[str, list[tuple[Path, str]]]:
    """group name -> the (file, tensor name) of its experts, in expert order (one entry for a
    tensor already stacked over the experts)."""
    found: dict[str, dict[int, tuple[Path, str]]] = collections.defaultdict(dict)
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                m = _PER_EXPERT.match(name)
                if m:
                    found[f"{m[1]}.*.{m[3]}"][int(m[2])] = (f, name)
                elif ".experts." in name and len(st.get_slice(name).get_shape()) >= 3:
                    found[name][0] = (f, name)
    return {g: [ids[j] for j in sorted(ids)] for g, ids in sorted(found.items())}


def _load(entries: list[tuple[Path, str]]) -> torch.Tensor:
    """The group's experts stacked (each file opened once, not once per expert)."""
    by_file: dict[Path, list[str]] = collections.defaultdict(list)
    for f, name in entries:
        by_file[f].append(name)
    tensors = {}
    for f, names in by_file.items():
        with safe_open(str(f), "pt") as st:
            tensors.update({(f, n): st.get_tensor(n) for n in names})
    parts = [tensors[e] for e in entries]
    return parts[0] if len(parts) == 1 else torch.stack(parts)


def run(args: argparse.Namespace) -> dict:
    model = Path(args.model)
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model {model}: no *.safetensors files there")
    encode(torch.zeros(1, 128, dtype=torch.bfloat16))     # the C library loaded, untimed
    totals = collections.Counter()
    groups, refused = [], {}
    for group, entries in expert_groups(files).items():
        t = _load(entries)
        why = refusal(t)
        if why is not None:
            refused[group] = why
            continue
        start = time.perf_counter()
        c = encode(t)
        seconds = time.perf_counter() - start
        E, n = t.shape[0], t[0].numel()
        escaped = int((c.esc_index >= 0).sum())
        groups.append({"group": group, "experts": E, "weights": E * n,
                       "bits_per_weight": c.bytes_per_expert * 8 / n,
                       "escaped_fraction": escaped / (E * n), "encode_seconds": seconds})
        totals.update(weights=E * n, bits=c.bytes_per_expert * 8 * E, escaped=escaped,
                      seconds=seconds)
    if not groups:
        raise ValueError(f"--model {model}: no bf16 expert tensor exp12 can hold "
                         f"({refused or 'no expert tensors found'})")
    w = totals["weights"]
    return {"model": str(model), "threads": torch.get_num_threads(), "weights": w,
            "bits_per_weight": totals["bits"] / w, "ratio_to_bf16": totals["bits"] / w / 16,
            "escaped_fraction": totals["escaped"] / w,
            "encode_gbps": w * 2 / max(totals["seconds"], 1e-9) / 1e9,
            "groups": groups if args.per_group else len(groups), "refused": refused}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-group", action="store_true", help="one entry per expert group")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads {args.threads} is invalid: must be >= 1")
    out = with_threads(args.threads, run, args)
    write_json(args.out, out)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['model']}: {out['weights']:,} expert weights, {out['bits_per_weight']:.3f} "
              f"bits per weight ({out['ratio_to_bf16']:.3f} of bf16), escaped "
              f"{out['escaped_fraction']:.2e}, encoded at {out['encode_gbps']:.2f} GB/s on "
              f"{out['threads']} threads; refused: {out['refused'] or 'none'}")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
