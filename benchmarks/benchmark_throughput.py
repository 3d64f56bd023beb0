"""Offline throughput: requests/s and output tokens/s, optionally against transformers' generate.

    python benchmarks/benchmark_throughput.py --model PATH --num-prompts 32 --input-len 64 \
        --output-len 64 --hf-baseline [--moe-expert-cache-size N ...engine flags]

Prompts are random token ids (fixed seed), every request generates exactly --output-len tokens
(ignore_eos), greedy. With --hf-baseline the same prompts run through
``AutoModelForCausalLM.generate`` in one padded batch, in the same process, and the ratio is printed.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from vllm.engine.arg_utils import EngineArgs


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the lowest ids (often special tokens) so prompts are ordinary text tokens.
    low = min(8, vocab_size - 1)
    return torch.randint(low, vocab_size, (num_prompts, input_len), generator=g).tolist()


def run_engine(args, prompts) -> tuple[float, int]:
    from vllm import LLM, SamplingParams
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(model_path: str, prompts, output_len: int, dtype: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM
    torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - ids.shape[1]) * ids.shape[0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-baseline", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for both engines (default: torch's choice)")
    EngineArgs.add_cli_args(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vllm import DEFAULT_MODEL
    args.model = args.model or DEFAULT_MODEL
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = make_prompts(vocab, args.num_prompts, args.input_len, args.seed)
    elapsed, n_out = run_engine(args, prompts)
    result = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "threads": torch.get_num_threads(),
              "moe_expert_cache_size": args.moe_expert_cache_size,
              "engine": {"seconds": elapsed, "requests_per_s": args.num_prompts / elapsed,
                         "output_tokens_per_s": n_out / elapsed}}
    if args.hf_baseline:
        hf_elapsed, hf_out = run_hf(args.model, prompts, args.output_len, args.dtype)
        result["hf"] = {"seconds": hf_elapsed, "requests_per_s": args.num_prompts / hf_elapsed,
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
