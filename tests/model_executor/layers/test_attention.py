"""Paged Attention vs a naive per-sequence softmax attention written here in plain torch."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm.model_executor.layers.attention import Attention

HQ, HKV, D, BS, NB = 6, 2, 8, 4, 40


def naive(q, k, v, q_pos, scale):
    """q [Lq, HQ, D] at positions q_pos; k/v [ctx, HKV, D] -> [Lq, HQ, D] (explicit loops)."""
    out = torch.empty_like(q)
    for h in range(HQ):
        kh, vh = k[:, h // (HQ // HKV)], v[:, h // (HQ // HKV)]
        for i, p in enumerate(q_pos):
            w = torch.softmax((kh[:p + 1] @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ vh[:p + 1]
    return out


def test_no_metadata_is_causal_over_whole_input():
    torch.manual_seed(0)
    attn = Attention(HQ, D, HKV, 0.3)
    q, k, v = torch.randn(7, HQ * D), torch.randn(7, HKV * D), torch.randn(7, HKV * D)
    out = attn(q, k, v).view(7, HQ, D)
    ref = naive(q.view(7, HQ, D), k.view(7, HKV, D), v.view(7, HKV, D), range(7), 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernels", [True, False], ids=["c_kernel", "torch"])
def test_mixed_batch_reads_earlier_context_from_paged_cache(kernels, monkeypatch):
    """3 decodes of different lengths, a chunked prefill with history, and a fresh prefill:
    through the C kernel (every token in one call) and through the torch path."""
    if not kernels:
        monkeypatch.setattr(Attention, "_cache_on_kernels", lambda self: False)
    torch.manual_seed(0)
    scale = D ** -0.5
    attn = Attention(HQ, D, HKV, scale)
    attn.kv_cache = torch.zeros(2, NB, BS, HKV, D)
    seqs = [(9, 1), (3, 1), (14, 1), (10, 5), (6, 6)]     # (context len incl. new, new tokens)
    blocks = torch.randperm(NB - 1)[:sum(-(-c // BS) for c, _ in seqs)] + 1
    tables, q_all, k_new, v_new, slots, refs = [], [], [], [], [], []
    used = 0
    for ctx, n in seqs:
        nblk = -(-ctx // BS)
        table = blocks[used:used + nblk].tolist()
        used += nblk
        tables.append(table)
        k, v, q = torch.randn(ctx, HKV, D), torch.randn(ctx, HKV, D), torch.randn(n, HQ, D)
        # History (all but the new tokens) is already in the cache from earlier steps.
        for p in range(ctx):
            slot = table[p // BS] * BS + p % BS
            if p < ctx - n:
                attn.kv_cache[0].view(-1, HKV, D)[slot] = k[p]
                attn.kv_cache[1].view(-1, HKV, D)[slot] = v[p]
            else:
                slots.append(slot)
        q_all.append(q), k_new.append(k[ctx - n:]), v_new.append(v[ctx - n:])
        refs.append(naive(q, k, v, range(ctx - n, ctx), scale))
    width = max(map(len, tables))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor([c for c, _ in seqs]),
        query_start_loc=torch.tensor([0] + [n for _, n in seqs]).cumsum(0),
        seq_lens_cpu=[c for c, _ in seqs], query_lens_cpu=[n for _, n in seqs],
        num_decodes=3, block_size=BS)
    T = sum(n for _, n in seqs)
    with set_forward_context(md):
        out = attn(torch.cat(q_all).view(T, -1), torch.cat(k_new).view(T, -1),
                   torch.cat(v_new).view(T, -1))
    torch.testing.assert_close(out.view(T, HQ, D), torch.cat(refs), atol=1e-5, rtol=1e-5)
    # The new tokens' k/v were written to their slots.
    torch.testing.assert_close(attn.kv_cache[0].view(-1, HKV, D)[torch.tensor(slots)],
                               torch.cat(k_new))


def test_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        Attention(6, 8, 4, 1.0)
