"""Each CPU C kernel against the torch path it replaced, on the default model's shapes.

    python benchmarks/benchmark_cpu_kernels.py [--threads 1] [--iters 50] [--context 100]
        [--dtype float32|bfloat16]

Rows (medians of --iters calls, ms; weights, activations and KV in --dtype, logits f32):
  experts, 32 tokens, cold: one MoE layer (E=32, top-4, hidden 256, inter 64); 4 layers' weights
      rotate so each call reads weights that are not in cache (as in a real step).
  experts, 2048 tokens: a prefill's worth of pairs (compute-bound).
  decode attention: 32 sequences x --context tokens, 4 query / 2 kv heads of 64, paged in
      16-token blocks scattered over the cache; "cold" rotates over 16 block layouts.
  prompt attention: 32 prompts of 64 tokens, causal (torch: SDPA per prompt, as the torch path
      runs whole prompts; C: every token in one paged_attention call).
  lm_head: 32 x 256 -> 4096 (weights cold: 8 copies rotate).
  argmax: 32 x 4096 logits.
  router: softmax top-4 of 32 experts, renormalised, for 32 tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _median_ms(fn, iters: int, variants: int = 1) -> float:
    for i in range(3):
        fn(i % variants)
    times = []
    for i in range(iters):
        start = time.perf_counter()
        fn(i % variants)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _experts(T: int, layers: int, iters: int, dt: torch.dtype) -> tuple[float, float]:
    from vllm.kernels.cpu.ops import prepack
    from vllm.model_executor.layers.fused_moe.cpu_kernel import expert_pairs_cpu
    from vllm.model_executor.layers.fused_moe.grouped_mm import expert_pairs_grouped
    E, K, H, N = 32, 4, 256, 64
    g = torch.Generator().manual_seed(0)
    w13 = [(torch.randn(E, 2 * N, H, generator=g) * 0.1).to(dt) for _ in range(layers)]
    w2 = [(torch.randn(E, H, N, generator=g) * 0.1).to(dt) for _ in range(layers)]
    packed = [(prepack(a), prepack(b)) for a, b in zip(w13, w2)]
    x = torch.randn(T, H, generator=g).to(dt)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).to(dt)
    out = torch.zeros(T, K, H, dtype=dt)
    torch_ms = _median_ms(lambda i: expert_pairs_grouped(x, w13[i], w2[i], w, ids, out), iters,
                          layers)
    c_ms = _median_ms(lambda i: expert_pairs_cpu(x, *packed[i], w, ids, out), iters, layers)
    return torch_ms, c_ms


def _attention(layouts: int, iters: int, L: int, dt: torch.dtype) -> tuple[float, float]:
    from vllm.kernels.cpu.ops import paged_attention
    from vllm.model_executor.forward_context import AttentionMetadata
    from vllm.model_executor.layers.attention.torch_sdpa import TorchSdpaAttention
    B, HQ, HKV, D, BS = 32, 4, 2, 64, 16
    NB = max(4096, 32 * -(-L // BS))
    g = torch.Generator().manual_seed(1)
    attn = TorchSdpaAttention(HQ, D, HKV, D ** -0.5)
    cache = torch.randn(2, NB, BS, HKV, D, generator=g).to(dt)
    nblk = -(-L // BS)
    mds = [AttentionMetadata(
        slot_mapping=torch.zeros(B, dtype=torch.long),
        block_tables=torch.randperm(NB, generator=g)[:B * nblk].view(B, nblk),
        seq_lens=torch.full((B,), L), query_start_loc=torch.arange(B + 1),
        seq_lens_cpu=[L] * B, query_lens_cpu=[1] * B, num_decodes=B, block_size=BS)
        for _ in range(layouts)]
    q = torch.randn(B, HQ, D, generator=g).to(dt)
    return (_median_ms(lambda i: attn.decode(q, cache, mds[i]), iters, layouts),
            _median_ms(lambda i: paged_attention(q, cache, mds[i].block_tables,
                                                 mds[i].seq_lens, attn.scale, HKV), iters,
                       layouts))


def _prompt_attention(iters: int, dt: torch.dtype) -> tuple[float, float]:
    from vllm.kernels.cpu.ops import paged_attention
    from vllm.model_executor.layers.attention.torch_sdpa import causal
    B, L, HQ, HKV, D, BS = 32, 64, 4, 2, 64, 16
    scale = D ** -0.5
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 4096, BS, HKV, D, generator=g).to(dt)
    tables = torch.randperm(4096, generator=g)[:B * L // BS].view(B, L // BS)
    rows = torch.arange(B).repeat_interleave(L)
    lens = torch.arange(1, L + 1).repeat(B)
    q = torch.randn(B * L, HQ, D, generator=g).to(dt)
    k, v = (torch.randn(B * L, HKV, D, generator=g).to(dt) for _ in range(2))

    def per_prompt(_):
        for s in range(0, B * L, L):
            causal(q[s:s + L], k[s:s + L], v[s:s + L], scale)
    return (_median_ms(per_prompt, iters),
            _median_ms(lambda i: paged_attention(q, cache, tables, lens, scale, HKV, rows),
                       iters))


def _lm_head(iters: int, dt: torch.dtype) -> tuple[float, float]:
    from vllm.kernels.cpu.ops import dense_linear, prepack
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(4096, 256, generator=g).to(dt) for _ in range(8)]
    packed = [prepack(w) for w in ws]
    x = torch.randn(32, 256, generator=g).to(dt)
    return (_median_ms(lambda i: F.linear(x, ws[i]), iters, 8),
            _median_ms(lambda i: dense_linear(x, packed[i], 4096), iters, 8))


def _argmax(iters: int) -> tuple[float, float]:
    from vllm.kernels.cpu.ops import argmax_rows
    x = torch.randn(32, 4096, generator=torch.Generator().manual_seed(3))
    return (_median_ms(lambda i: x.argmax(dim=-1), iters),
            _median_ms(lambda i: argmax_rows(x), iters))


def _router(iters: int) -> tuple[float, float]:
    from vllm.model_executor.layers.fused_moe.router import (RouterConfig, select_experts,
                                                             select_experts_torch)
    cfg = RouterConfig(top_k=4, renormalize=True, num_experts=32)
    logits = torch.randn(32, 32, generator=torch.Generator().manual_seed(4))
    return (_median_ms(lambda i: select_experts_torch(logits, cfg), iters),
            _median_ms(lambda i: select_experts(logits, cfg), iters))


def main(argv=None) -> list[tuple[str, float, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--context", type=int, default=100,
                   help="tokens of context per sequence in the decode attention rows")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    dt = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    from vllm.kernels.cpu.build import load_cpu_kernels
    if load_cpu_kernels() is None:
        p.error("the CPU kernels are unavailable (VLLM_CPU_KERNELS=0 or no C compiler)")
    rows = [("experts, 32 tokens, cold (torch: grouped_mm)", *_experts(32, 4, args.iters, dt)),
            ("experts, 2048 tokens (torch: grouped_mm)",
             *_experts(2048, 1, max(3, args.iters // 10), dt)),
            (f"decode attention {args.context} tokens, hot (torch: gather + SDPA)",
             *_attention(1, args.iters, args.context, dt)),
            ("decode attention, cold", *_attention(16, args.iters, args.context, dt)),
            ("prompt attention 32 x 64 (torch: SDPA per prompt)",
             *_prompt_attention(max(3, args.iters // 10), dt)),
            ("lm_head 32x256 -> 4096, cold (torch: F.linear)", *_lm_head(args.iters, dt)),
            ("argmax 32 x 4096", *_argmax(args.iters)),
            ("router 32 x 32 experts, top-4", *_router(args.iters))]
    print(f"threads={args.threads}, dtype={args.dtype}, medians of {args.iters} calls (ms)")
    print(f"{'op':48s} {'torch':>8s} {'C':>8s} {'speedup':>8s}")
    for name, t, c in rows:
        print(f"{name:48s} {t:8.3f} {c:8.3f} {t / c:7.1f}x")
    return rows


if __name__ == "__main__":
    main()
