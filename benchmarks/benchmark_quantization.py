"""Quantized experts on a model: bytes per expert, top-1 agreement with the float model under
teacher forcing on held-out text, and expert-cache hit rate / bytes copied per token at N = E/4.

    python benchmarks/benchmark_quantization.py                    # vllm.DEFAULT_MODEL if present
    python benchmarks/benchmark_quantization.py --model DIR --tokens 512 --json
    python benchmarks/benchmark_quantization.py --tiny             # random Qwen3-MoE, byte tokens
    python benchmarks/benchmark_quantization.py --speed            # decode tok/s per scheme

``--speed``: per scheme (bf16 beside fp8-tensor/channel/block, w4a16-gptq and nvfp4, all run in
bf16), load time, bytes per expert (what a cache miss copies) and greedy decode tokens/s of
``vllm.LLM`` at batch 1 and 32, without the expert cache and with N = E/4 slots, on a random
Qwen3-MoE of ``--speed-shape`` (default: E=32, top-4, hidden 512, expert intermediate 256, 4
layers: bf16 experts 100 MB, over a 32 MB L3), on the MoE backend ``--moe-backend`` picks (auto:
the C kernel on CPU). mxfp4 loads on GPT-OSS only, so it runs on a random GPT-OSS of the same
shape (expert biases, swigluoai), beside that model's bf16 row ("gpt-oss-bf16"); its experts
are rounded to MXFP4 here (e8m0 scale 2^ceil(log2(amax / 6)) per 32 inputs).
``--out FILE``: the JSON, rewritten after every engine load and every timed call with
``"partial": true`` (a run cut short by a timeout keeps what it measured), the last write
without it.

Teacher forcing: the held-out text (a stdlib module the default model never trained on) is fed
one token per step (batch 1, decode steps over a paged KV cache, like the engine's decode), and
each step's argmax is compared with the float model's at the same position. The quantized model
runs with the expert cache at N = E/4 slots per layer, so the same pass gives the cache counters
(the cache is exact: its outputs equal the uncached model's bitwise, tested in
tests/engine/test_quantized_e2e.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))          # sibling: bench_io

from bench_io import write_json  # noqa: E402

import vllm  # noqa: E402
from tools.quantize_checkpoint import main as quantize_main  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig,  # noqa: E402
                         MoECacheConfig, SchedulerConfig, VllmConfig)
from vllm.model_executor.forward_context import (AttentionMetadata,  # noqa: E402
                                                 set_forward_context)
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.fused_moe.layer import FusedMoE  # noqa: E402
from vllm.config.quantization import SCHEMES  # noqa: E402
from vllm.model_executor.model_loader import get_model  # noqa: E402

SPEED_SCHEMES = ("fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq", "nvfp4", "mxfp4")
"""The schemes ``--speed`` times (all run on the C expert kernel on CPU)."""
HELDOUT = "textwrap.py"   # first of tools/train_default_model.py's HELDOUT_MODULES
BLOCK = 16


def build_tiny(path: str) -> None:
    """A random Qwen3-MoE (E=16, top-4) without tokenizer: the text is fed as UTF-8 bytes."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
        initializer_range=0.05)
    transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(path)


def heldout_ids(model_dir: str, n: int) -> list[int]:
    text = open(os.path.join(sysconfig.get_paths()["stdlib"], HELDOUT)).read()
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"][:n]
    return list(text.encode())[:n]


@torch.no_grad()
def teacher_forced_argmax(model_dir: str, ids: list[int], cache_size: int) -> tuple[list, list]:
    """-> (argmax per position, per-layer cache stats or [] when uncached)."""
    cfg = VllmConfig(ModelConfig(model_dir, dtype="float32", max_model_len=len(ids) + 1),
                     CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache_size),
                     DeviceConfig("cpu"))
    model = get_model(cfg)
    blocks = -(-len(ids) // BLOCK)
    for m in model.modules():
        if isinstance(m, Attention):
            m.kv_cache = torch.zeros(2, blocks + 1, BLOCK, m.num_kv_heads, m.head_dim)
    table = torch.arange(1, blocks + 1).unsqueeze(0)                     # block 0 unused
    out = []
    for pos, tok in enumerate(ids):
        md = AttentionMetadata(
            slot_mapping=torch.tensor([BLOCK + pos]), block_tables=table,
            seq_lens=torch.tensor([pos + 1]), query_start_loc=torch.tensor([0, 1]),
            seq_lens_cpu=[pos + 1], query_lens_cpu=[1], num_decodes=1, block_size=BLOCK)
        with set_forward_context(md):
            hidden = model(torch.tensor([tok]), torch.tensor([pos]))
        out.append(int(model.compute_logits(hidden)[0].argmax()))
    caches = [m.expert_cache for m in model.modules()
              if isinstance(m, FusedMoE) and m.expert_cache is not None]
    return out, [c.stats() | {"bytes_per_expert": c.store.bytes_per_expert} for c in caches]


def layer_expert_bytes(layer: FusedMoE) -> int:
    """Bytes of one expert of a loaded engine's layer, in the layout its MoE backend reads on
    the engine's device (what one cache miss copies)."""
    if layer.expert_cache is not None:
        return layer.expert_cache.store.bytes_per_expert
    return sum(getattr(layer, n)[0].numel() * getattr(layer, n).element_size()
               for n in layer.quant_method.expert_tensor_names())


def expert_bytes(model_dir: str) -> tuple[int, int, int]:
    """(bytes per expert, experts per layer, top_k) of the first MoE layer of the float32 model
    loaded on CPU (in the layout its MoE backend reads)."""
    cfg = VllmConfig(ModelConfig(model_dir, dtype="float32"), CacheConfig(), SchedulerConfig(),
                     MoECacheConfig(), DeviceConfig("cpu"))
    layer = next(m for m in get_model(cfg).modules() if isinstance(m, FusedMoE))
    return layer_expert_bytes(layer), layer.num_experts, layer.top_k


def build_speed_model(path: str, hidden: int, inter: int, experts: int, layers: int) -> None:
    """A random Qwen3-MoE (top-4) in bf16 with the shipped model's tokenizer and vocabulary."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=hidden // 8, intermediate_size=2 * inter,
        moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.05,
        torch_dtype="bfloat16")
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval().save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(vllm.DEFAULT_MODEL, f), path)


def build_gpt_oss_speed_model(path: str, hidden: int, inter: int, experts: int,
                              layers: int) -> None:
    """A random GPT-OSS (top-4, nonzero expert biases) in bf16 with the shipped tokenizer."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=hidden // 8, intermediate_size=inter,
        num_local_experts=experts, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=4096, initializer_range=0.05, torch_dtype="bfloat16")
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).eval().save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(vllm.DEFAULT_MODEL, f), path)


def mxfp4_gpt_oss(src: str, dst: str) -> None:
    """``src``'s GPT-OSS with its experts rounded to nearest MXFP4 in the published layout
    (rows = outputs, 16 bytes per 32 inputs, code 2j in the low nibble; e8m0 scales)."""
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.quantization.utils import float_to_e2m1
    shutil.copytree(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = [], []
        for w in state.pop(name).float().transpose(1, 2):               # [out, in] per expert
            b = w.reshape(w.shape[0], -1, 32)
            exp = torch.ceil(torch.log2(b.abs().amax(-1).clamp(min=2.0 ** -60) / 6))
            codes = float_to_e2m1(b / 2.0 ** exp[..., None])
            blocks.append(codes[..., 0::2] | (codes[..., 1::2] << 4))
            scales.append((exp + 127).to(torch.uint8))
        state[name + "_blocks"], state[name + "_scales"] = torch.stack(blocks), torch.stack(scales)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def speed_checkpoint(scheme: str, work: str, shape: list[int]) -> str:
    """The checkpoint directory of one ``--speed`` row: ``work/HxIxExL/scheme``, built on first
    use and reused after (``--work``: across runs; a finished one holds ``.done``)."""
    path = os.path.join(work, "x".join(map(str, shape)), scheme)
    if os.path.exists(os.path.join(path, ".done")):
        return path
    shutil.rmtree(path, ignore_errors=True)              # a build cut short
    if scheme in ("bf16", "gpt-oss-bf16"):
        build = build_speed_model if scheme == "bf16" else build_gpt_oss_speed_model
        build(path, *shape)
    elif scheme == "mxfp4":
        mxfp4_gpt_oss(speed_checkpoint("gpt-oss-bf16", work, shape), path)
    else:
        with contextlib.redirect_stdout(sys.stderr):
            quantize_main(["--model", speed_checkpoint("bf16", work, shape), "--out", path,
                           "--scheme", scheme])
    open(os.path.join(path, ".done"), "w").close()
    return path


def _prompts(b: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 2000 + 3 for j in range(8)]} for i in range(b)]


def load_engine(model_dir: str, cache: int, backend: str, batches: list[int],
                weight_only: bool = False):
    """-> (LLM, load seconds), warmed up at each batch size (which captures the CPU graphs).
    ``weight_only``: FP8 experts on the triton backend keep bf16 activations even where the
    checkpoint declares FP8 ones and the device multiplies e4m3 (W8A16, not W8A8)."""
    import time
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype="bfloat16", moe_expert_cache_size=cache, moe_backend=backend,
              max_model_len=64, seed=0, kv_cache_memory_bytes=64 << 20)
    load_s = time.perf_counter() - t0
    if weight_only:
        for m in llm.llm_engine.runner.moe_layers:
            if hasattr(m.quant_method.kernel, "quantize_inputs"):
                m.quant_method.kernel.quantize_inputs = False
    for b in batches:
        llm.generate(_prompts(b), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return llm, load_s


def decode_rate(llm, b: int, tokens: int) -> float:
    """Greedy tokens/s of one generate call: b 8-token prompts, ``tokens`` new tokens each."""
    import time
    from vllm import SamplingParams
    t0 = time.perf_counter()
    llm.generate(_prompts(b), SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return b * tokens / (time.perf_counter() - t0)


def _device_name() -> str:
    """Where the engines ran (the platform's default device)."""
    from vllm.platforms import platform_for, resolve_device
    return platform_for(resolve_device("auto")).device_name()


def backend_for(spec: list[str], scheme: str) -> str:
    """``--moe-backend``: one name for every scheme, or SCHEME=NAME pairs (others: auto)."""
    if len(spec) == 1 and "=" not in spec[0]:
        return spec[0]
    pairs = dict(s.split("=", 1) for s in spec if "=" in s)
    if len(pairs) != len(spec):
        raise SystemExit(f"--moe-backend {' '.join(spec)}: give one name, or SCHEME=NAME pairs")
    return pairs.get(scheme, "auto")


def _layer_row(runner) -> dict:
    """One engine's row fields from its first MoE layer (after the warm-up's forwards):
    ``inputs`` "fp8" where the backend quantized activations (W8A8), else the model dtype's."""
    layer = runner.moe_layers[0]
    kernel = layer.quant_method.kernel
    w8a8 = getattr(kernel, "quantizes_inputs", lambda d: False)(runner.device)
    return {"bytes_per_expert": layer_expert_bytes(layer), "inputs": "fp8" if w8a8 else "bf16",
            "backend": layer.quant_method.backend_name}


def _speed_result(args, rows: list[dict], rates: list[dict], device: str,
                  partial: bool) -> dict:
    """The ``--speed`` JSON: per row the median tok/s of the rounds timed so far (a row not yet
    timed has none); ``"partial": true`` while rows are still being measured."""
    H, I, E, L = args.speed_shape
    out_rows = [row | {f"tok_s_b{b}": sorted(v)[len(v) // 2] for b, v in r.items() if v}
                for row, r in zip(rows, rates)]
    result = {"shape": dict(hidden=H, moe_intermediate=I, experts=E, layers=L),
              "device": device, "threads": torch.get_num_threads(), "rows": out_rows}
    return (result | {"partial": True}) if partial else result


def speed(args, work: str) -> None:
    """Every (scheme, cache) engine is loaded first, then timed round-robin, ``speed_reps``
    rounds, each row's median reported: on a shared machine the load drifts, and interleaving
    gives every row the same drift. ``--out`` is rewritten after every load and every timed
    call with ``"partial": true`` (a run cut short keeps what it measured)."""
    E = args.speed_shape[2]
    rows, rates, engines, batches, device = [], [], [], [1, 32], _device_name()
    schemes = ["bf16", *(s for s in args.schemes if s != "mxfp4")]
    schemes += ["gpt-oss-bf16", "mxfp4"] if "mxfp4" in args.schemes else []
    runs = [(s, False) for s in schemes]
    runs += [(s, True) for s in schemes if args.fp8_weight_only_too and s.startswith("fp8")]
    for scheme, weight_only in runs:
        qdir = speed_checkpoint(scheme, work, args.speed_shape)
        backend = backend_for(args.moe_backend, scheme)
        for cache in (0, E // 4):
            llm, load_s = load_engine(qdir, cache, backend, batches, weight_only)
            engines.append(llm)
            rows.append({"scheme": scheme, "cache": cache, "load_s": load_s,
                         **_layer_row(llm.llm_engine.runner)})
            rates.append({b: [] for b in batches})
            write_json(args.out, _speed_result(args, rows, rates, device, partial=True))
    for _ in range(args.speed_reps):
        for llm, r in zip(engines, rates):
            for b in batches:
                r[b].append(decode_rate(llm, b, args.speed_tokens))
            write_json(args.out, _speed_result(args, rows, rates, device, partial=True))
    result = _speed_result(args, rows, rates, device, partial=False)
    write_json(args.out, result)
    if args.json:
        print(json.dumps(result))
        return
    _print_speed(args, result["rows"])


def _print_speed(args, rows: list[dict]) -> None:
    H, I, E, L = args.speed_shape
    print(f"Qwen3-MoE random (GPT-OSS for gpt-oss-bf16, mxfp4), bf16: hidden {H}, expert "
          f"intermediate {I}, E={E}, top-4, {L} layers; {torch.get_num_threads()} thread(s); "
          f"{args.speed_tokens} new tokens/seq, median of {args.speed_reps} interleaved rounds")
    print(f"{'scheme':<12} {'backend':<10} {'inputs':<6} {'cache N':>7} {'B/expert':>9} "
          f"{'load s':>7} {'tok/s b1':>9} {'tok/s b32':>10}")
    for r in rows:
        print(f"{r['scheme']:<12} {r['backend']:<10} {r['inputs']:<6} {r['cache']:>7} "
              f"{r['bytes_per_expert']:>9} "
              f"{r['load_s']:>7.2f} {r['tok_s_b1']:>9.1f} {r['tok_s_b32']:>10.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="float model dir (default: vllm.DEFAULT_MODEL)")
    p.add_argument("--tiny", action="store_true", help="use a random tiny Qwen3-MoE instead")
    p.add_argument("--tokens", type=int, default=256, help="held-out tokens (teacher forced)")
    p.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--json", action="store_true")
    p.add_argument("--speed", action="store_true", help="decode tok/s per scheme (see above)")
    p.add_argument("--speed-shape", type=int, nargs=4, default=[512, 256, 32, 4],
                   metavar=("HIDDEN", "INTER", "EXPERTS", "LAYERS"))
    p.add_argument("--speed-tokens", type=int, default=32, help="new tokens per sequence")
    p.add_argument("--speed-reps", type=int, default=5, help="timed calls per row (median)")
    p.add_argument("--moe-backend", nargs="+", default=["auto"], metavar="NAME|SCHEME=NAME",
                   help="--speed: the MoE backend of every run (a name), or of some schemes "
                        "(SCHEME=NAME, the others auto), e.g. w4a16-gptq=cutlass_w4a16")
    p.add_argument("--fp8-weight-only-too", action="store_true",
                   help="--speed: also time each fp8 scheme with bf16 activations (W8A16) "
                        "where its checkpoint declares FP8 ones and the backend would run W8A8")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on CPU, torch's choice on a GPU, "
                        "where they only build and quantize the checkpoints)")
    p.add_argument("--work", default=None,
                   help="keep the built and quantized checkpoints here and reuse them")
    p.add_argument("--out", default=None,
                   help="--speed: also write the JSON here (rewritten after every load and "
                        "timed call with \"partial\": true)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from vllm.platforms import resolve_device
    args = parse_args(argv)
    threads = args.threads or (1 if resolve_device("auto") == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    work = args.work or tempfile.mkdtemp(prefix="bench-quant-")
    os.makedirs(work, exist_ok=True)
    if args.speed:
        args.schemes = [s for s in args.schemes if s in SPEED_SCHEMES]
        return speed(args, work)
    # tools/quantize_checkpoint.py writes no MXFP4 (a GPT-OSS-only format): the teacher-forced
    # Qwen3-MoE rows cover the other schemes.
    args.schemes = [s for s in args.schemes if s != "mxfp4"]
    model = args.model or vllm.DEFAULT_MODEL
    if args.tiny or not os.path.isdir(model):
        model = os.path.join(work, "tiny")
        build_tiny(model)
    ids = heldout_ids(model, args.tokens)
    float_bytes, E, top_k = expert_bytes(model)
    N = max(1, E // 4)
    ref, _ = teacher_forced_argmax(model, ids, 0)
    rows = [{"scheme": "float32", "bytes_per_expert": float_bytes, "top1_agreement": 1.0}]
    for scheme in args.schemes:
        qdir = os.path.join(work, scheme)
        with contextlib.redirect_stdout(sys.stderr):        # the tool's summary line
            quantize_main(["--model", model, "--out", qdir, "--scheme", scheme])
        got, stats = teacher_forced_argmax(qdir, ids, N)
        hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
        rows.append({"scheme": scheme, "bytes_per_expert": stats[0]["bytes_per_expert"],
                     "top1_agreement": sum(a == b for a, b in zip(got, ref)) / len(ref),
                     "cache_hit_rate": hits / max(1, hits + misses),
                     "bytes_copied_per_token": sum(s["bytes_copied"] for s in stats) / len(ids)})
    built = model == os.path.join(work, "tiny")
    result = {"model": "tiny random Qwen3-MoE (E=16, top-4, 4 layers)" if built else model,
              "tokens": len(ids), "heldout": HELDOUT, "experts": E, "top_k": top_k,
              "cache_slots": N, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"model: {result['model']}  held-out: {HELDOUT} ({len(ids)} tokens, teacher forced)  "
          f"E={E} top_k={top_k} cache N={N}")
    print(f"{'scheme':<12} {'bytes/expert':>12} {'top1 agree':>10} {'hit rate':>9} "
          f"{'copied B/token':>15}")
    for r in rows:
        print(f"{r['scheme']:<12} {r['bytes_per_expert']:>12} {r['top1_agreement']:>10.4f} "
              f"{r.get('cache_hit_rate', float('nan')):>9.4f} "
              f"{r.get('bytes_copied_per_token', float('nan')):>15.1f}")


if __name__ == "__main__":
    main()
