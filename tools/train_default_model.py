"""Train the small Qwen3-MoE model shipped as vllm/models/default.

Corpus: the running interpreter's standard library *.py files (see `split_corpus`), with a
FIXED list of held-out modules (`HELDOUT_MODULES`) that are never trained on. Everything is
seeded, so the same interpreter + torch build reproduces the same weights.

    python tools/train_default_model.py                      # full run, writes vllm/models/default
    python tools/train_default_model.py --steps 20 --out /tmp/dm   # quick smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "vllm" / "models" / "default"
SEED = 1234

# Held-out modules, relative to the stdlib root; never trained on and never seen by the tokenizer trainer.
HELDOUT_MODULES = (
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "shlex.py",
    "fractions.py",
    "queue.py",
    "graphlib.py",
    "json/encoder.py",
    "json/decoder.py",
    "email/quoprimime.py",
)
# Directories skipped entirely: tests, third-party packages, and generated tables (codec maps,
# pydoc topic dumps) whose text is not representative Python.
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__", "__phello__"}
SKIP_PREFIXES = ("_sysconfigdata", "config-")

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


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_corpus(root: Path) -> tuple[list[str], list[str]]:
    """Return (train, heldout) relative paths, sorted; heldout is HELDOUT_MODULES in listed order."""
    train = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or rel.parts[0].startswith(SKIP_PREFIXES):
            continue
        if rel.name.startswith(SKIP_PREFIXES) or rel.as_posix() in HELDOUT_MODULES:
            continue
        train.append(rel.as_posix())
    missing = [m for m in HELDOUT_MODULES if not (root / m).is_file()]
    if missing:
        raise FileNotFoundError(f"held-out modules {missing} not found under stdlib root {root}")
    return sorted(train), list(HELDOUT_MODULES)


def read_texts(root: Path, rels: list[str]) -> list[str]:
    return [(root / r).read_text(encoding="utf-8", errors="replace") for r in rels]


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


def train(model: Qwen3MoeForCausalLM, stream: torch.Tensor, args: TrainArgs, log) -> dict:
    """Random windows of the training stream; loss = LM loss + router_aux_loss_coef * balance loss."""
    gen = torch.Generator().manual_seed(SEED)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    model.train()
    t0 = time.time()
    last = {}
    for step in range(args.steps):
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq_len] for s in starts.tolist()])  # [B, S]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
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


def shipped_eval(out: Path, root: Path, heldout_texts: list[str], seq_len: int) -> dict:
    """Held-out numbers measured on the saved (bf16) weights, loaded back in fp32."""
    from transformers import AutoTokenizer

    model = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    eos_id = tok.convert_tokens_to_ids(EOS)
    held = encode_stream(tok.backend_tokenizer, heldout_texts, eos_id)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=TrainArgs.steps)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    cli = ap.parse_args()
    if cli.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {cli.steps}")
    args = TrainArgs(steps=cli.steps)
    torch.set_num_threads(cli.threads)
    torch.manual_seed(SEED)
    random.seed(SEED)
    wall0 = time.time()
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    root = stdlib_root()
    train_rels, held_rels = split_corpus(root)
    train_texts, held_texts = read_texts(root, train_rels), read_texts(root, held_rels)
    tok = train_tokenizer(train_texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    stream = encode_stream(tok, train_texts, eos_id)
    log(f"corpus: {len(train_rels)} train files, {len(stream)} train tokens; tokenizer vocab {tok.get_vocab_size()}")

    config = model_config(tok.get_vocab_size(), eos_id)
    model = Qwen3MoeForCausalLM(config)
    log(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M; experts impl "
        f"{model.config._experts_implementation}")
    stats = train(model, stream, args, log)
    save_all(model, wrap_tokenizer(tok), cli.out)
    shipped = shipped_eval(cli.out, root, held_texts, args.seq_len)
    meta = {
        "seed": SEED, "train_args": asdict(args), "threads": cli.threads,
        "python": sysconfig.get_python_version(), "torch": torch.__version__,
        "train_files": len(train_rels), "train_tokens": int(len(stream)),
        "heldout_modules": list(held_rels), "skip_dirs": sorted(SKIP_DIRS),
        "heldout_definition": (
            "held-out modules concatenated in listed order, each followed by <|endoftext|>; "
            f"non-overlapping windows of {args.seq_len} tokens (last one partial); mean next-token NLL "
            "(nats) within each window; weights = shipped bf16 checkpoint loaded in fp32"
        ),
        "final_train": stats, "total_wall_seconds": time.time() - wall0, **shipped,
    }
    (cli.out / "training_metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"held-out loss {shipped['heldout_loss']:.4f} ppl {shipped['heldout_perplexity']:.2f}; "
        f"slice loss {shipped['slice']['loss']:.4f}; wall {meta['total_wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
