"""Paged Attention vs a naive per-sequence softmax attention written here in plain torch."""
from __future__ import annotations

import pytest
import torch

from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig,
                         SchedulerConfig, VllmConfig, set_current_vllm_config)
from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm.model_executor.layers.attention import Attention

HQ, HKV, D, BS, NB = 6, 2, 8, 4, 40
SEQS = [(9, 1), (3, 1), (14, 1), (10, 5), (6, 6)]
"""(context len incl. new, new tokens): 3 decodes of different lengths, a chunked prefill with
history, and a fresh prefill."""


def make_attention(backend: str = "auto", scale: float = D ** -0.5, prefix: str = "",
                   hq: int = HQ, d: int = D, hkv: int = HKV, **options) -> Attention:
    """An Attention layer built under a config asking for ``backend`` (``options``: the
    layer's keyword options)."""
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(), DeviceConfig("cpu"),
                     kernel_config=KernelConfig(attention_backend=backend))
    with set_current_vllm_config(cfg):
        return Attention(hq, d, hkv, scale, prefix, **options)


def naive(q, k, v, q_pos, scale):
    """q [Lq, HQ, D] at positions q_pos; k/v [ctx, HKV, D] -> [Lq, HQ, D] (explicit loops)."""
    out = torch.empty_like(q)
    for h in range(HQ):
        kh, vh = k[:, h // (HQ // HKV)], v[:, h // (HQ // HKV)]
        for i, p in enumerate(q_pos):
            w = torch.softmax((kh[:p + 1] @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ vh[:p + 1]
    return out


def mixed_batch(attn: Attention, seed: int = 0):
    """``SEQS`` laid out over ``attn.kv_cache`` (bound, zeroed) with each sequence's history
    already written: (md, q [T, HQ*D], k/v [T, HKV*D], ref [T, HQ, D] from ``naive``, slots [T])."""
    torch.manual_seed(seed)
    blocks = torch.randperm(NB - 1)[:sum(-(-c // BS) for c, _ in SEQS)] + 1
    tables, q_all, k_new, v_new, slots, refs = [], [], [], [], [], []
    used = 0
    flat_k, flat_v = attn.kv_cache[0].view(-1, HKV, D), attn.kv_cache[1].view(-1, HKV, D)
    for ctx, n in SEQS:
        nblk = -(-ctx // BS)
        table = blocks[used:used + nblk].tolist()
        used += nblk
        tables.append(table)
        k, v, q = torch.randn(ctx, HKV, D), torch.randn(ctx, HKV, D), torch.randn(n, HQ, D)
        # History (all but the new tokens) is already in the cache from earlier steps.
        for p in range(ctx):
            slot = table[p // BS] * BS + p % BS
            if p < ctx - n:
                flat_k[slot], flat_v[slot] = k[p], v[p]
            else:
                slots.append(slot)
        q_all.append(q), k_new.append(k[ctx - n:]), v_new.append(v[ctx - n:])
        refs.append(naive(q, k, v, range(ctx - n, ctx), attn.scale))
    width = max(map(len, tables))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor([c for c, _ in SEQS]),
        query_start_loc=torch.tensor([0] + [n for _, n in SEQS]).cumsum(0),
        seq_lens_cpu=[c for c, _ in SEQS], query_lens_cpu=[n for _, n in SEQS],
        num_decodes=3, block_size=BS)
    T = sum(n for _, n in SEQS)
    return (md, torch.cat(q_all).view(T, -1), torch.cat(k_new).view(T, -1),
            torch.cat(v_new).view(T, -1), torch.cat(refs), torch.tensor(slots))


def run_mixed_batch(backend: str, seed: int = 0):
    """The mixed batch through a layer forced to ``backend``: (layer, out [T, HQ, D], ref,
    new k [T, HKV, D], slots)."""
    attn = make_attention(backend)
    attn.kv_cache = torch.zeros(2, NB, BS, HKV, D)
    assert attn.impl.name == backend
    md, q, k, v, ref, slots = mixed_batch(attn, seed)
    with set_forward_context(md):
        out = attn(q, k, v)
    return attn, out.view(-1, HQ, D), ref, k.view(-1, HKV, D), slots


def test_no_metadata_is_causal_over_whole_input():
    torch.manual_seed(0)
    attn = Attention(HQ, D, HKV, 0.3)
    q, k, v = torch.randn(7, HQ * D), torch.randn(7, HKV * D), torch.randn(7, HKV * D)
    out = attn(q, k, v).view(7, HQ, D)
    ref = naive(q.view(7, HQ, D), k.view(7, HKV, D), v.view(7, HKV, D), range(7), 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_metadata_without_cache_is_causal_per_sequence():
    """A dummy run (no KV cache bound): each sequence attends only its own new tokens."""
    torch.manual_seed(0)
    attn = Attention(HQ, D, HKV, 0.3)
    lens = [3, 5]
    q, k, v = torch.randn(8, HQ, D), torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(8, dtype=torch.long), block_tables=torch.zeros(2, 2),
        seq_lens=torch.tensor(lens), query_start_loc=torch.tensor([0, 3, 8]),
        seq_lens_cpu=lens, query_lens_cpu=lens, num_decodes=0, block_size=BS)
    with set_forward_context(md):
        out = attn(q.view(8, -1), k.view(8, -1), v.view(8, -1)).view(8, HQ, D)
    ref = torch.cat([naive(q[:3], k[:3], v[:3], range(3), 0.3),
                     naive(q[3:], k[3:], v[3:], range(5), 0.3)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"], ids=["c_kernel", "torch"])
def test_mixed_batch_reads_earlier_context_from_paged_cache(backend):
    """3 decodes of different lengths, a chunked prefill with history, and a fresh prefill:
    through the C kernel (every token in one call) and through the torch backend."""
    attn, out, ref, k_new, slots = run_mixed_batch(backend)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # The new tokens' k/v were written to their slots.
    torch.testing.assert_close(attn.kv_cache[0].view(-1, HKV, D)[slots], k_new)


def test_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        Attention(6, 8, 4, 1.0)


def test_rejects_a_cache_of_the_wrong_shape():
    attn = Attention(HQ, D, HKV, 1.0, prefix="layers.2.attn")
    with pytest.raises(ValueError, match=r"layers.2.attn: kv_cache \(2, 4, 4, 3, 8\) is invalid: "
                                         r"must be \[2, num_blocks, block_size, 2, 8\]"):
        attn.kv_cache = torch.zeros(2, 4, 4, 3, D)
    assert attn.kv_cache is None and attn.impl is None


def test_metadata_must_cover_the_input():
    attn = Attention(HQ, D, HKV, 1.0, prefix="layers.3.attn")
    md = AttentionMetadata(
        slot_mapping=torch.zeros(2, dtype=torch.long), block_tables=torch.zeros(1, 1),
        seq_lens=torch.tensor([2]), query_start_loc=torch.tensor([0, 2]), seq_lens_cpu=[2],
        query_lens_cpu=[2], num_decodes=0, block_size=BS)
    with set_forward_context(md), \
            pytest.raises(ValueError, match="layers.3.attn: metadata covers 2 tokens, input has 3"):
        attn(torch.zeros(3, HQ * D), torch.zeros(3, HKV * D), torch.zeros(3, HKV * D))
