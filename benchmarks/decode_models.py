"""benchmark_decode.py's models: the shape presets and the random checkpoints built from them
(config.json, safetensors one decoder layer per shard, the default model's tokenizer), and the
check that a checkpoint found on disk is the one asked for."""
from __future__ import annotations

import json
import math
import os
import shutil

import torch

PRESETS = {
    "probe-4.8g": ("Qwen3MoeForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=True)),
    "dsv2-lite": ("DeepseekV2ForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)),
    "tiny": ("Qwen3MoeForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True)),
    "tiny-e32": ("Qwen3MoeForCausalLM", dict(          # tiny, 32 experts: --unrouted-experts
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=16, num_experts=32,
        num_experts_per_tok=2, norm_topk_prob=True)),
}
"""name -> (architecture, config fields); every preset also gets ``_COMMON``."""
_COMMON = dict(vocab_size=4096, max_position_embeddings=4096, bos_token_id=0, eos_token_id=0,
               pad_token_id=0, tie_word_embeddings=False, initializer_range=0.02)
UNROUTED = """An expert whose router row is zero has logit 0, while the others' logits are
N(0, s^2), independent across experts, for any hidden state (random rows); it enters the top k
only when fewer than k of the other E - 1 logits are positive: P(Binomial(E - 1, 1/2) < k),
7e-11 per token and layer for top-8 of 63 (probe-4.8g), 1.5e-8 for top-2 of 31 (tiny-e32). So
the cache's all-hits cost can be measured at N = E - K with the cache on (N >= E turns it off)."""
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_config(preset: str, dtype: torch.dtype):
    import transformers
    if preset not in PRESETS:
        raise ValueError(f"--random-model {preset!r} is not a preset: must be one of "
                         f"{sorted(PRESETS)}")
    arch, fields = PRESETS[preset]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**_COMMON, **fields)
    config.architectures = [arch]
    config.dtype = dtype
    return config


def param_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, as transformers names them in memory (experts fused:
    ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]; the loader takes both)."""
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def shape_summary(config, dtype: torch.dtype) -> dict:
    E = getattr(config, "num_experts", None) or config.n_routed_experts
    H, inter = config.hidden_size, config.moe_intermediate_size
    moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    per_expert = 3 * H * inter * dtype.itemsize                      # gate, up [I, H]; down [H, I]
    total = sum(math.prod(s) for _, s in param_shapes(config)) * dtype.itemsize
    return {"architecture": config.architectures[0], "hidden": H, "moe_intermediate": inter,
            "num_experts": E, "top_k": config.num_experts_per_tok, "layers":
            config.num_hidden_layers, "moe_layers": moe_layers, "dtype": str(dtype)[6:],
            "bytes_per_expert": per_expert, "expert_bytes": per_expert * E * moe_layers,
            "checkpoint_bytes": total}


def _shard_of(name: str) -> str:
    parts = name.split(".")
    return parts[2] if parts[:2] == ["model", "layers"] else "rest"


def build_checkpoint(preset: str, path: str, dtype: torch.dtype, seed: int = 0,
                     unrouted: int = 0, device: str | torch.device = "cpu") -> None:
    """Random weights (norms 1, the rest N(0, 0.02)) written one decoder layer per shard; the
    router rows of the last ``unrouted`` experts zero (``UNROUTED``). Drawn on ``device`` by its
    generator (other values than the CPU's for one seed): the CPU's normal_ draws from one
    thread, about 30 M values a second, so probe-4.8g took 87 s of an H100 session's 545."""
    from safetensors.torch import save_file

    from vllm import DEFAULT_MODEL
    config = make_config(preset, dtype)
    config.bench_unrouted_experts = unrouted
    os.makedirs(path, exist_ok=True)
    shapes = param_shapes(config)
    shards: dict[str, list] = {}
    for name, shape in shapes:
        shards.setdefault(_shard_of(name), []).append((name, shape))
    g = torch.Generator(device=device).manual_seed(seed)
    weight_map, total = {}, 0
    for i, (key, params) in enumerate(shards.items()):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in params:
            t = torch.empty(shape, dtype=dtype, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, config.initializer_range, generator=g)
            if unrouted and name.endswith("mlp.gate.weight"):       # router [E, H]
                t[t.shape[0] - unrouted:] = 0
            t = tensors[name] = t.cpu()
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        del tensors                                         # one layer in memory at a time
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(DEFAULT_MODEL, name), path)
    config.save_pretrained(path)                            # config.json last: marks it complete


def check_reusable(path: str, config, unrouted: int = 0) -> None:
    """A checkpoint found at ``path`` must be the preset's shape and dtype, with as many
    unrouted experts."""
    with open(os.path.join(path, "config.json")) as f:
        found = json.load(f)
    found.setdefault("bench_unrouted_experts", 0)
    want = {k: getattr(config, k) for k in ("architectures", "hidden_size", "num_hidden_layers",
                                              "moe_intermediate_size")}
    want["dtype"] = str(config.dtype)[6:]
    want["bench_unrouted_experts"] = unrouted
    diff = {k: (found.get(k), v) for k, v in want.items() if found.get(k) != v}
    if diff:
        raise ValueError(f"--checkpoint {path!r} holds another model: (found, wanted) {diff}; "
                         "use another directory")
