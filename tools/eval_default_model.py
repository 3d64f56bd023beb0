"""Figures for docs/default-model.md, measured on the shipped checkpoint.

    python tools/eval_default_model.py loss        # held-out loss/perplexity vs a unigram baseline
    python tools/eval_default_model.py generate    # greedy continuations of three prompts
    python tools/eval_default_model.py routing     # per-layer expert load and consecutive-token reuse
    python tools/eval_default_model.py quality     # five prompts: distinct-token ratio, repeated lines

Prints Markdown. The corpus split and held-out definition come from train_default_model.py.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_default_model as tdm  # noqa: E402

PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
QUALITY_PROMPTS = ("def fibonacci(n):\n", "import os\n", "class Stack:\n", "    for i in range(",
                   "# Read a file\n")


def distinct_ratio(ids: list[int]) -> float:
    """Distinct tokens / tokens of a continuation (1.0: no token repeats; degenerate loops -> 0)."""
    return len(set(ids)) / len(ids) if ids else 0.0


def longest_repeated_line_run(text: str) -> int:
    """Most consecutive identical non-blank lines (1 when no line repeats right after itself)."""
    best = run = 0
    prev = None
    for line in text.splitlines():
        if not line.strip():
            continue
        run = run + 1 if line == prev else 1
        best, prev = max(best, run), line
    return best


def load(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def heldout_stream(tok) -> torch.Tensor:
    root = tdm.stdlib_root()
    _, held = tdm.split_corpus(root)
    return tdm.encode_stream(tok.backend_tokenizer, tdm.read_texts(root, held), tok.eos_token_id)


def target_mask(n: int, seq_len: int) -> torch.Tensor:
    """[n] bool: positions the model is scored on (every token except the first of each window)."""
    mask = torch.ones(n, dtype=torch.bool)
    mask[::seq_len] = False
    return mask


def unigram_loss(tok, held: torch.Tensor, seq_len: int) -> float:
    """Cross-entropy of an add-one-smoothed unigram fit to the training token counts."""
    root = tdm.stdlib_root()
    train, _ = tdm.split_corpus(root)
    stream = tdm.encode_stream(tok.backend_tokenizer, tdm.read_texts(root, train), tok.eos_token_id)
    counts = torch.bincount(stream, minlength=len(tok)).double() + 1.0
    logp = (counts / counts.sum()).log()
    targets = held[target_mask(len(held), seq_len)]
    return float(-logp[targets].mean())


def cmd_loss(model, tok, seq_len: int) -> None:
    held = heldout_stream(tok)
    loss, n = tdm.eval_loss(model, held, seq_len)
    uni = unigram_loss(tok, held, seq_len)
    print(f"Held-out tokens scored: {n} (modules: {', '.join(tdm.HELDOUT_MODULES)})\n")
    print("| model | loss (nats/token) | perplexity |")
    print("| --- | --- | --- |")
    print(f"| unigram (train counts, add-one) | {uni:.3f} | {math.exp(uni):.1f} |")
    print(f"| default MoE model | {loss:.3f} | {math.exp(loss):.1f} |")


def cmd_generate(model, tok, new_tokens: int) -> None:
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        print(f"Prompt `{prompt!r}`:\n\n```python\n{tok.decode(out[0], skip_special_tokens=False)}\n```\n")


def cmd_quality(model, tok, new_tokens: int) -> None:
    """Greedy continuations of QUALITY_PROMPTS: each one's distinct-token ratio and longest
    repeated-line run, their means, and the outputs (Markdown)."""
    rows, outputs = [], []
    for prompt in QUALITY_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
        text = tok.decode(out, skip_special_tokens=False)
        rows.append((prompt, distinct_ratio(out.tolist()), longest_repeated_line_run(text)))
        outputs.append((prompt, text))
    print(f"Greedy, {new_tokens} new tokens.\n")
    print("| prompt | distinct-token ratio | longest repeated-line run |")
    print("| --- | --- | --- |")
    for prompt, ratio, run in rows:
        print(f"| `{prompt!r}` | {ratio:.2f} | {run} |")
    print(f"| mean | {sum(r for _, r, _ in rows) / len(rows):.2f} | "
          f"{max(r for _, _, r in rows)} (max) |\n")
    for prompt, text in outputs:
        print(f"`{prompt!r}` ->\n\n```python\n{prompt}{text}\n```\n")


@torch.no_grad()
def routing_topk(model, held: torch.Tensor, seq_len: int, windows: int) -> list[torch.Tensor]:
    """Per layer: [windows, seq_len, k] expert ids chosen by the router (the model's own top-k)."""
    n = min(windows, len(held) // seq_len)
    ids = held[: n * seq_len].view(n, seq_len)
    out = model(input_ids=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return [logits.view(n, seq_len, -1).topk(k, dim=-1).indices for logits in out.router_logits]


def cmd_routing(model, tok, seq_len: int, windows: int) -> None:
    held = heldout_stream(tok)
    num_e, k = model.config.num_experts, model.config.num_experts_per_tok
    per_layer = routing_topk(model, held, seq_len, windows)
    print(f"{per_layer[0].shape[0] * seq_len} held-out tokens, E={num_e}, k={k}. Uniform share = 1/E = "
          f"{1 / num_e:.4f}; random-routing expected shared experts between consecutive tokens = k^2/E = "
          f"{k * k / num_e:.3f} (fraction of k: k/E = {k / num_e:.3f}).\n")
    print("| layer | max share | min share | max/min | experts used | shared with prev token | fraction | "
          "x k^2/E | shuffled pairs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layer, topk in enumerate(per_layer):  # topk: [W, S, k]
        load = torch.bincount(topk.reshape(-1), minlength=num_e).double()
        share = load / load.sum()
        hit = torch.zeros(*topk.shape[:2], num_e, dtype=torch.bool).scatter_(-1, topk, True)  # [W, S, E]
        shared = (hit[:, 1:] & hit[:, :-1]).sum(-1).double().mean().item()
        # Baseline that keeps the measured (imbalanced) load but breaks token order: random pairs.
        flat = hit.reshape(-1, num_e)
        perm = torch.randperm(flat.shape[0], generator=torch.Generator().manual_seed(0))
        shuffled = (flat & flat[perm]).sum(-1).double().mean().item()
        ratio = f"{share.max() / share.min():.1f}" if share.min() > 0 else "inf"
        print(f"| {layer} | {share.max():.4f} | {share.min():.4f} | {ratio} | {int((load > 0).sum())}/{num_e} | "
              f"{shared:.3f} | {shared / k:.3f} | {shared / (k * k / num_e):.2f} | {shuffled:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=["loss", "generate", "routing", "quality"])
    ap.add_argument("--model", type=Path, default=tdm.DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--windows", type=int, default=32, help="routing: number of 256-token held-out windows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    seq_len = tdm.TrainArgs.seq_len
    if args.figure == "loss":
        cmd_loss(model, tok, seq_len)
    elif args.figure == "generate":
        cmd_generate(model, tok, args.new_tokens)
    elif args.figure == "quality":
        cmd_quality(model, tok, args.new_tokens)
    else:
        cmd_routing(model, tok, seq_len, args.windows)


if __name__ == "__main__":
    main()
