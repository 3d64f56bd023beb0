"""Train the small Qwen3-MoE model shipped as vllm/models/default.

Corpus: the running interpreter's standard library *.py files (see `split_corpus`), with a
FIXED list of held-out modules (`HELDOUT_MODULES`) that are never trained on; with
``--corpus stdlib+packages`` also the sources of installed permissively licensed packages
(`default_model_corpus.py`, each listed with its licence in training_metadata.json). Everything
is seeded, so the same interpreter, packages and torch build reproduce the same weights.

Training is resumable: a checkpoint (model, optimizer, sampling generator, tokenizer, step and
the record of every run so far) is written outside the repository every --checkpoint-every
seconds and at the end; --resume CKPT continues it exactly where it stopped (the same weights
as an uninterrupted run on the same device). --device cuda trains on a GPU with bf16 autocast.

    python tools/train_default_model.py                      # full run, writes vllm/models/default
    python tools/train_default_model.py --steps 20 --out /tmp/dm   # quick smoke run
    python tools/train_default_model.py --steps 20000 --device cuda --corpus stdlib+packages
    python tools/train_default_model.py --resume ~/.cache/vllm/default-model-train.pt --steps 30000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Re-exported: eval_default_model.py and the tests read the corpus split through this module.
from default_model_corpus import (HELDOUT_MODULES, SKIP_DIRS, build_corpus,  # noqa: E402,F401
                                  read_texts, split_corpus, stdlib_root)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "vllm" / "models" / "default"
DEFAULT_CHECKPOINT = Path.home() / ".cache" / "vllm" / "default-model-train.pt"
SEED = 1234

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The small slice used by tests to recompute the loss: the first SLICE_CHARS characters of SLICE_MODULE.
SLICE_MODULE = "textwrap.py"
SLICE_CHARS = 3000


@dataclass(frozen=True)
class TrainArgs:
    steps: int = 550
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    vocab_size: int = 4096
    log_every: int = 20
    corpus: str = "stdlib"
    """"stdlib" or "stdlib+packages"."""


def model_config(vocab_size: int, eos_id: int) -> Qwen3MoeConfig:
    """32 experts, top-4, 4 layers: enough experts per layer that a device-slot cache matters."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # dense MLP size; unused because every layer is sparse
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tok: Tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """Concatenate documents, each followed by EOS. Returns [N] int64."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, args: TrainArgs) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: Qwen3MoeForCausalLM, args: TrainArgs) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )


class Checkpointer:
    """Writes the training state to ``path`` (atomically: a temp file renamed over it) every
    ``every_s`` seconds and when forced."""

    def __init__(self, path: Path, every_s: float):
        self.path, self.every_s, self.last = path, every_s, time.time()

    def maybe_save(self, state: Callable[[], dict], force: bool = False) -> None:
        if not force and time.time() - self.last < self.every_s:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(state(), tmp)
        os.replace(tmp, self.path)
        self.last = time.time()


def train(model: Qwen3MoeForCausalLM, stream: torch.Tensor, args: TrainArgs, log, *,
          opt: torch.optim.Optimizer, gen: torch.Generator, start_step: int = 0,
          checkpoint=None, state=None, device: str = "cpu") -> dict:
    """Random windows of the training stream from ``start_step`` to ``args.steps``; loss = LM
    loss + router_aux_loss_coef * balance loss. ``checkpoint.maybe_save(state_fn)`` runs after
    every step (``state(step)`` builds the checkpoint dict for the next step to run)."""
    model.train()
    t0 = time.time()
    last = {}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else None
    for step in range(start_step, args.steps):
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq_len] for s in starts.tolist()]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        if autocast is not None:
            with autocast:
                out = model(input_ids=batch, labels=batch, output_router_logits=True)
        else:
            out = model(input_ids=batch, labels=batch, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            lm = out.loss.item() - model.config.router_aux_loss_coef * out.aux_loss.item()
            last = {"step": step, "lm_loss": lm, "aux_loss": out.aux_loss.item(), "elapsed_s": time.time() - t0}
            log(f"step {step:5d} lm_loss {lm:.4f} aux {out.aux_loss.item():.4f} "
                f"lr {lr_at(step, args):.2e} elapsed {time.time() - t0:.0f}s")
        if checkpoint is not None:
            checkpoint.maybe_save(lambda: state(step + 1, time.time() - t0),
                                  force=step == args.steps - 1)
    last["train_seconds"] = time.time() - t0
    return last


@torch.no_grad()
def eval_loss(model: Qwen3MoeForCausalLM, stream: torch.Tensor, seq_len: int, batch: int = 8) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping seq_len windows (last partial window included).

    Returns (mean nll in nats, number of predicted tokens)."""
    model.eval()
    total, count = 0.0, 0
    n_full = (len(stream) - 1) // seq_len
    full = stream[: n_full * seq_len].view(n_full, seq_len)  # [W, S]
    tail = stream[n_full * seq_len :]
    chunks = [full[i : i + batch] for i in range(0, n_full, batch)] + ([tail[None]] if len(tail) >= 2 else [])
    for ids in chunks:  # ids: [b, s]
        logits = model(input_ids=ids, output_router_logits=False).logits.float()  # [b, s, V]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += ids.shape[0] * (ids.shape[1] - 1)
    return total / count, count


def slice_text(root: Path) -> str:
    return (root / SLICE_MODULE).read_text(encoding="utf-8")[:SLICE_CHARS]


def save_all(model, hf_tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        stale.unlink()
    model.config.output_router_logits = False  # inference default; training turns it on per call
    model.to(torch.bfloat16).save_pretrained(out)
    hf_tok.save_pretrained(out)
    im_end = hf_tok.convert_tokens_to_ids(IM_END)
    GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=[model.config.eos_token_id, im_end],
        pad_token_id=model.config.pad_token_id, do_sample=False, max_new_tokens=64,
    ).save_pretrained(out)
    write_compat_files(out)


def write_compat_files(out: Path) -> None:
    """Rewrite config/tokenizer_config in the field names real Qwen3-MoE checkpoints use.

    transformers 5 writes `num_local_experts` and a `TokenizersBackend` class; published
    checkpoints (and transformers 4.x) use `num_experts` and `PreTrainedTokenizerFast`."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        if (out / extra).exists():
            (out / extra).unlink()


def shipped_eval(out: Path, root: Path, heldout_texts: list[str], seq_len: int,
                 max_tokens: int | None = None) -> dict:
    """Held-out numbers measured on the saved (bf16) weights, loaded back in fp32, over the
    first ``max_tokens`` held-out tokens (None: all; ``heldout_tokens`` says how many)."""
    from transformers import AutoTokenizer

    model = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    eos_id = tok.convert_tokens_to_ids(EOS)
    held = encode_stream(tok.backend_tokenizer, heldout_texts, eos_id)[:max_tokens]
    loss, n = eval_loss(model, held, seq_len)
    text = slice_text(root)
    slice_ids = torch.tensor(tok(text).input_ids, dtype=torch.long)
    s_loss, s_n = eval_loss(model, slice_ids, seq_len)
    return {
        "heldout_loss": loss, "heldout_perplexity": math.exp(loss), "heldout_tokens": n,
        "slice": {
            "module": SLICE_MODULE, "chars": SLICE_CHARS, "text": text,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "loss": s_loss, "tokens": s_n,
        },
    }


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=TrainArgs.steps, help="total steps (a resumed run continues to this)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: train on the GPU with bf16 autocast (weights and optimizer in fp32)")
    ap.add_argument("--corpus", choices=["stdlib", "stdlib+packages"], default=TrainArgs.corpus)
    ap.add_argument("--batch-size", type=int, default=TrainArgs.batch_size)
    ap.add_argument("--seq-len", type=int, default=TrainArgs.seq_len)
    ap.add_argument("--lr", type=float, default=TrainArgs.lr)
    ap.add_argument("--max-files", type=int, default=None, help="train on the first N files only (smoke runs)")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                    help=f"training checkpoint written during training (default: {DEFAULT_CHECKPOINT})")
    ap.add_argument("--checkpoint-every", type=float, default=300.0, help="seconds between checkpoints")
    ap.add_argument("--resume", type=Path, default=None, help="continue from this training checkpoint")
    ap.add_argument("--heldout-tokens", type=int, default=None,
                    help="evaluate on the first N held-out tokens only (smoke runs; default all)")
    cli = ap.parse_args(argv)
    if cli.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {cli.steps}")
    if cli.heldout_tokens is not None and cli.heldout_tokens < 2:
        raise SystemExit(f"--heldout-tokens must be >= 2, got {cli.heldout_tokens}")
    if cli.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return cli


def main(argv=None) -> None:
    cli = parse_args(argv)
    torch.set_num_threads(cli.threads)
    torch.manual_seed(SEED)
    random.seed(SEED)
    wall0 = time.time()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    resume = torch.load(cli.resume, weights_only=False) if cli.resume else None
    args = TrainArgs(steps=cli.steps, batch_size=cli.batch_size, seq_len=cli.seq_len, lr=cli.lr,
                     corpus=cli.corpus)
    if resume is not None:   # the run's own hyperparameters; only the step count may grow
        args = replace(TrainArgs(**resume["train_args"]), steps=cli.steps)
    max_files = cli.max_files if resume is None else resume["max_files"]   # the run's own corpus
    corpus = build_corpus(args.corpus, max_files)
    tok = (Tokenizer.from_str(resume["tokenizer"]) if resume is not None
           else train_tokenizer(corpus["train"], args.vocab_size))
    eos_id = tok.token_to_id(EOS)
    stream = encode_stream(tok, corpus["train"], eos_id)
    log(f"corpus: {len(corpus['train'])} train files, {len(stream)} train tokens; tokenizer vocab "
        f"{tok.get_vocab_size()}")

    model = Qwen3MoeForCausalLM(model_config(tok.get_vocab_size(), eos_id))
    gen = torch.Generator().manual_seed(SEED)
    runs, start = [], 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        gen.set_state(resume["generator"])
        runs, start = resume["runs"], resume["step"]
    model.to(cli.device)
    opt = make_optimizer(model, args)
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
    log(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M; steps {start} -> {args.steps} "
        f"on {cli.device}")
    run = {"device": cli.device, "device_name": _device_name(cli.device), "threads": cli.threads,
           "from_step": start, "to_step": args.steps}

    def state(next_step: int, seconds: float) -> dict:
        return {"step": next_step, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict(), "generator": gen.get_state(), "tokenizer": tok.to_str(),
                "train_args": asdict(args), "max_files": max_files,
                "runs": runs + [{**run, "to_step": next_step, "seconds": seconds}]}
    stats = train(model, stream, args, log, opt=opt, gen=gen, start_step=start, device=cli.device,
                  checkpoint=Checkpointer(cli.checkpoint, cli.checkpoint_every), state=state)
    runs.append({**run, "seconds": stats["train_seconds"]})
    model.to("cpu")
    save_all(model, wrap_tokenizer(tok), cli.out)
    shipped = shipped_eval(cli.out, corpus["root"], corpus["held"], args.seq_len,
                           cli.heldout_tokens)
    meta = _metadata(args, cli, corpus, stream, stats, runs, wall0, shipped)
    (cli.out / "training_metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"held-out loss {shipped['heldout_loss']:.4f} ppl {shipped['heldout_perplexity']:.2f}; "
        f"slice loss {shipped['slice']['loss']:.4f}; wall {meta['total_wall_seconds']:.0f}s")


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform
    return platform.processor() or platform.machine()


def _metadata(args, cli, corpus, stream, stats, runs, wall0, shipped) -> dict:
    return {
        "seed": SEED, "train_args": asdict(args), "threads": cli.threads,
        "python": sysconfig.get_python_version(), "torch": torch.__version__,
        "train_files": len(corpus["train"]), "train_tokens": int(len(stream)),
        "stdlib_train_files": len(corpus["train_rels"]), "packages": corpus["packages"],
        "heldout_modules": list(corpus["held_rels"]), "skip_dirs": sorted(SKIP_DIRS),
        "heldout_definition": (
            "held-out modules concatenated in listed order, each followed by <|endoftext|>; "
            f"non-overlapping windows of {args.seq_len} tokens (last one partial); mean next-token NLL "
            "(nats) within each window; weights = shipped bf16 checkpoint loaded in fp32"
        ),
        "runs": runs, "train_seconds_total": sum(r["seconds"] for r in runs),
        "final_train": stats, "total_wall_seconds": time.time() - wall0, **shipped,
    }


if __name__ == "__main__":
    main()
