"""Record a routing trace (the shared .npz format) from our engine on held-out text.

    python benchmarks/record_routing_trace.py --out /tmp/default-trace.npz [--model DIR]
        [--chunk 512] [--max-sequences 40]
    python benchmarks/benchmark_expert_cache.py --trace /tmp/default-trace.npz --capacity 8

Each sequence is a teacher-forced chunk of a held-out stdlib module (never trained on by the
default model), so the trace is the model's own routing, prefill-only, like the shared
DeepSeek-V2-Lite trace. The engine's recorder (``moe_routing_trace_path``) writes it.
"""
from __future__ import annotations

import argparse
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.train_default_model import HELDOUT_MODULES  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def heldout_chunks(tokenizer, chunk: int, limit: int) -> list[list[int]]:
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[list[int]] = []
    for module in HELDOUT_MODULES:
        with open(os.path.join(root, module), encoding="utf-8") as f:
            ids = tokenizer.encode(f.read())
        chunks += [ids[i:i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)]
    return chunks[:limit]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: the shipped default model)")
    p.add_argument("--out", required=True, help="trace .npz to write")
    p.add_argument("--chunk", type=int, default=512, help="tokens per sequence")
    p.add_argument("--max-sequences", type=int, default=40)
    p.add_argument("--scores", action="store_true",
                   help="also record each router's softmax over all experts (float16 [T, L, E])")
    args = p.parse_args(argv)
    llm = LLM(args.model, dtype="float32", moe_routing_trace_path=args.out,
              moe_routing_trace_scores=args.scores)
    max_len = llm.llm_engine.vllm_config.model_config.max_model_len
    if args.chunk >= max_len:
        p.error(f"--chunk {args.chunk} is invalid: the model's max_model_len={max_len} allows "
                f"at most {max_len - 1} prompt tokens")
    prompts = heldout_chunks(llm.get_tokenizer(), args.chunk, args.max_sequences)
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    llm.llm_engine.shutdown()  # writes the trace
    print(f"wrote {args.out}: {len(prompts)} sequences x {args.chunk} tokens")


if __name__ == "__main__":
    main()
