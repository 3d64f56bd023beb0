"""The C paged decode-attention kernel against a naive softmax attention written here."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.forward_context import AttentionMetadata
from vllm.model_executor.layers.attention import Attention

BS, NB = 4, 64


def _decode_case(lens, hq, hkv, d, dtype, seed=0, bs=BS, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NB, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(NB, generator=g).tolist()
    tables, used = [], 0
    for L in lens:
        nblk = -(-L // bs)
        tables.append(perm[used:used + nblk])
        used += nblk
    width = max(map(len, tables))
    md = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(lens), query_start_loc=torch.arange(len(lens) + 1),
        seq_lens_cpu=list(lens), query_lens_cpu=[1] * len(lens), num_decodes=len(lens),
        block_size=bs)
    q = (torch.randn(len(lens), hq, d, generator=g) * q_scale).to(dtype)
    return cache, tables, md, q


def _naive(cache, tables, lens, q, scale):
    """Explicit loops over sequences and heads, in f32."""
    B, hq, d = q.shape
    BS, hkv = cache.shape[2], cache.shape[3]
    out = torch.empty(B, hq, d)
    for b, L in enumerate(lens):
        rows = [tables[b][p // BS] * BS + p % BS for p in range(L)]
        k = cache[0].reshape(-1, hkv, d)[rows].float()
        v = cache[1].reshape(-1, hkv, d)[rows].float()
        for h in range(hq):
            kv_head = h // (hq // hkv)
            w = torch.softmax(k[:, kv_head] @ q[b, h].float() * scale, dim=0)
            out[b, h] = w @ v[:, kv_head]
    return out


@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 8), (4, 4, 64), (8, 2, 80)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_kernel_matches_naive(hq, hkv, d, dtype, tol):
    lens = [1, 4, 5, 17, 33, 8]                     # block boundaries on both sides
    cache, tables, md, q = _decode_case(lens, hq, hkv, d, dtype, seed=d)
    attn = Attention(hq, d, hkv, d ** -0.5)
    attn.kv_cache = cache
    got = attn._decode(q, md)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), _naive(cache, tables, lens, q, d ** -0.5), atol=tol,
                               rtol=tol)
    # The torch fallback agrees too (it is the path used off CPU or without a compiler).
    torch.testing.assert_close(attn._decode_torch(q, md).float(), got.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (8, 2, 128), (3, 1, 16)])
@pytest.mark.parametrize("bs", [16, 32])
def test_decode_kernel_long_contexts_and_full_chunks(hq, hkv, d, bs):
    """Many 16-token chunks per sequence (the kernel's online softmax rescales at each) and
    scores spread over tens of units, so a wrong rescale shows; (4, 2, 64) and (8, 2, 128) are
    the kernel's specialised shapes."""
    lens = [1, 15, 16, 17, 200, 31, 96]
    cache, tables, md, q = _decode_case(lens, hq, hkv, d, torch.float32, seed=bs + d, bs=bs,
                                        q_scale=4.0)
    attn = Attention(hq, d, hkv, d ** -0.5)
    attn.kv_cache = cache
    torch.testing.assert_close(attn._decode(q, md), _naive(cache, tables, lens, q, d ** -0.5),
                               atol=1e-5, rtol=1e-5)


def test_decode_kernel_rejects_block_ids_outside_the_cache():
    cache, tables, md, q = _decode_case([5, 9], 4, 2, 16, torch.float32)
    md.block_tables[1, 2] = NB                                   # one past the last block
    attn = Attention(4, 16, 2, 0.25, prefix="layers.0.attn")
    attn.kv_cache = cache
    with pytest.raises(RuntimeError, match="layers.0.attn.*outside the KV cache"):
        attn._decode(q, md)


def test_cache_write_lands_in_its_slots_and_rejects_foreign_slots():
    attn = Attention(4, 16, 2, 0.25, prefix="layers.1.attn")
    attn.kv_cache = torch.zeros(2, NB, BS, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, NB * BS - 1, 0])
    attn._write_cache(k, v, slots)
    assert torch.equal(attn.kv_cache[0].view(-1, 2, 16)[slots], k)
    assert torch.equal(attn.kv_cache[1].view(-1, 2, 16)[slots], v)
    assert attn.kv_cache[0].view(-1, 2, 16)[1].abs().sum() == 0          # nothing else written
    with pytest.raises(RuntimeError, match="layers.1.attn.*outside the cache"):
        attn._write_cache(k, v, torch.tensor([1, NB * BS, 2]))
