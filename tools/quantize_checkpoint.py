"""Quantize the routed experts of a Hugging Face MoE checkpoint; everything else stays as it was.

    python tools/quantize_checkpoint.py --model IN --out OUT --scheme fp8-block
    python tools/quantize_checkpoint.py --model IN --out OUT --scheme w4a16-gptq \
        --group-size 64 --asym --desc-act

Schemes and the checkpoint format each writes (round to nearest, no calibration data):
  fp8-tensor, fp8-channel  compressed-tensors (llm-compressor style): weight e4m3, weight_scale
  fp8-block                Hugging Face "fp8": weight e4m3, weight_scale_inv per 128x128 block
  w4a16-gptq               GPTQ v1 (AutoGPTQ layout): qweight, qzeros, scales, g_idx
  nvfp4                    ModelOpt NVFP4: packed e2m1 weight, e4m3 weight_scale, weight_scale_2,
                           plus hf_quant_config.json. No input_scale: it needs activation
                           calibration, which this tool does not do (the CPU path is weight-only).
Every non-expert tensor (attention, router, dense and shared-expert MLPs, embeddings, lm_head)
is copied unchanged and listed in the config's ignore / modules_to_not_convert /
exclude_modules list. Tokenizer and other files are copied.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm.config.quantization import SCHEMES  # noqa: E402
from vllm.model_executor.layers.quantization.fp8 import quantize_fp8  # noqa: E402
from vllm.model_executor.layers.quantization.gptq import quantize_gptq  # noqa: E402
from vllm.model_executor.layers.quantization.nvfp4 import quantize_nvfp4  # noqa: E402
from vllm.model_executor.model_loader import (INDEX_FILE, find_safetensors_files,  # noqa: E402
                                              iterate_safetensors)

PER_EXPERT = re.compile(r"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|"
                        r"w1|w2|w3)\.weight$")
FUSED = re.compile(r"^(?P<mod>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
PRODUCER = "tools/quantize_checkpoint.py (round to nearest)"


def expert_weights(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]] | None:
    """(module name, [out, in] weight) for each expert projection in a tensor; None if not one."""
    m = PER_EXPERT.match(name)
    if m:
        return iter([(name[:-len(".weight")], t)])
    m = FUSED.match(name)
    if not m:
        return None
    mod = m["mod"]
    if m["proj"] == "down_proj":                                     # [E, H, N]
        return ((f"{mod}.{e}.down_proj", t[e]) for e in range(t.shape[0]))
    n = t.shape[1] // 2                                               # [E, 2N, H], gate rows first
    return ((f"{mod}.{e}.{p}", t[e][h * n:(h + 1) * n]) for e in range(t.shape[0])
            for h, p in enumerate(("gate_proj", "up_proj")))


def quantizer(args) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    if args.scheme.startswith("fp8"):
        return lambda w: quantize_fp8(w, args.scheme[4:], tuple(args.block_size))
    if args.scheme == "w4a16-gptq":
        return lambda w: quantize_gptq(w, args.group_size, not args.asym, args.desc_act)
    return quantize_nvfp4


def quantization_config(args, ignore: list[str]) -> dict:
    """The config.json ``quantization_config`` the public tools write for the scheme."""
    if args.scheme in ("fp8-tensor", "fp8-channel"):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": args.scheme[4:],
                   "dynamic": False, "group_size": None, "block_structure": None,
                   "actorder": None, "observer": "minmax", "observer_kwargs": {}}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "kv_cache_scheme": None,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None,
                                              "output_activations": None}},
                "ignore": ignore, "producer": PRODUCER}
    if args.scheme == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": list(args.block_size), "modules_to_not_convert": ignore}
    if args.scheme == "w4a16-gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": args.group_size,
                "sym": not args.asym, "desc_act": args.desc_act, "static_groups": False,
                "true_sequential": True, "checkpoint_format": "gptq",
                "modules_to_not_convert": ignore, "meta": {"quantizer": [PRODUCER]}}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "kv_cache_quant_algo": None, "exclude_modules": ignore, "producer": PRODUCER}


def quantize_tensors(files: list[str], quant) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """-> (output tensors, non-expert modules left unquantized, expert projections quantized)."""
    out: dict[str, torch.Tensor] = {}
    ignore: list[str] = []
    count = 0
    for name, t in iterate_safetensors(files):
        experts = expert_weights(name, t)
        if experts is None:
            out[name] = t
            if name.endswith(".weight") and t.dim() == 2:
                ignore.append(name[:-len(".weight")])
            continue
        for module, w in experts:
            for suffix, q in quant(w).items():
                out[f"{module}.{suffix}"] = q.contiguous()
            count += 1
    return out, sorted(ignore), count


def copy_side_files(src: str, dst: str) -> None:
    """Tokenizer, generation config, chat template...: everything but weights and config.json."""
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if (os.path.isfile(path) and not entry.endswith(".safetensors")
                and entry not in ("config.json", INDEX_FILE)):
            shutil.copy2(path, os.path.join(dst, entry))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="input Hugging Face model directory")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"),
                   help="fp8-block scale block (default: 128 128)")
    p.add_argument("--group-size", type=int, default=128,
                   help="w4a16-gptq group size: 32, 64, 128 or -1 (per channel) (default: 128)")
    p.add_argument("--asym", action="store_true", help="w4a16-gptq: asymmetric (zero points)")
    p.add_argument("--desc-act", action="store_true",
                   help="w4a16-gptq: act-order groups (g_idx permutation; order by column norm)")
    args = p.parse_args(argv)
    if os.path.abspath(args.model) == os.path.abspath(args.out):
        p.error("--out must differ from --model")
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        p.error(f"{args.model} is already quantized ({config['quantization_config'].get('quant_method')})")
    tensors, ignore, count = quantize_tensors(find_safetensors_files(args.model), quantizer(args))
    if not count:
        p.error(f"{args.model}: no expert weights found (...experts.<e>.<proj>.weight or fused "
                "experts.gate_up_proj/down_proj)")
    os.makedirs(args.out, exist_ok=True)
    copy_side_files(args.model, args.out)
    qc = quantization_config(args, ignore)
    config["quantization_config"] = qc
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if args.scheme == "nvfp4":
        hf_quant = {"producer": {"name": PRODUCER, "version": "1"},
                    "quantization": {k: qc[k] for k in ("quant_algo", "group_size",
                                                        "kv_cache_quant_algo", "exclude_modules")}}
        with open(os.path.join(args.out, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant, f, indent=2)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    summary = {"scheme": args.scheme, "out": args.out, "expert_projections_quantized": count,
               "modules_not_converted": len(ignore), "quant_method": qc["quant_method"]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
