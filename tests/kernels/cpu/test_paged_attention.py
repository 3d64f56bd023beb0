"""The C paged-attention kernel against a naive softmax attention written here."""
from __future__ import annotations

import pytest
import torch

from vllm.kernels.cpu.ops import paged_attention, write_kv_cache
from vllm.model_executor.forward_context import AttentionMetadata
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.torch_sdpa import TorchSdpaAttention

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


def _kernel(attn, q, md):
    """The kernel on a decode batch, as Attention.forward calls it (one query per sequence)."""
    return paged_attention(q, attn.kv_cache, md.block_tables, md.seq_lens, attn.scale,
                           attn.num_kv_heads, None, attn.prefix)


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
    got = _kernel(attn, q, md)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), _naive(cache, tables, lens, q, d ** -0.5), atol=tol,
                               rtol=tol)
    # The torch backend agrees too (it is the path used off CPU or without a compiler).
    torch_decode = TorchSdpaAttention(hq, d, hkv, d ** -0.5).decode(q, cache, md)
    torch.testing.assert_close(torch_decode.float(), got.float(), atol=tol, rtol=tol)


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
    torch.testing.assert_close(_kernel(attn, q, md), _naive(cache, tables, lens, q, d ** -0.5),
                               atol=1e-5, rtol=1e-5)


def test_decode_kernel_rejects_block_ids_outside_the_cache():
    cache, tables, md, q = _decode_case([5, 9], 4, 2, 16, torch.float32)
    md.block_tables[1, 2] = NB                                   # one past the last block
    attn = Attention(4, 16, 2, 0.25, prefix="layers.0.attn")
    attn.kv_cache = cache
    with pytest.raises(RuntimeError, match="layers.0.attn.*outside the block tables or the KV cache"):
        _kernel(attn, q, md)


def test_cache_write_lands_in_its_slots_and_rejects_foreign_slots():
    attn = Attention(4, 16, 2, 0.25, prefix="layers.1.attn")
    attn.kv_cache = torch.zeros(2, NB, BS, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, NB * BS - 1, 0])
    write_kv_cache(k, v, slots, attn.kv_cache, attn.prefix)
    assert torch.equal(attn.kv_cache[0].view(-1, 2, 16)[slots], k)
    assert torch.equal(attn.kv_cache[1].view(-1, 2, 16)[slots], v)
    assert attn.kv_cache[0].view(-1, 2, 16)[1].abs().sum() == 0          # nothing else written
    with pytest.raises(RuntimeError, match="layers.1.attn.*outside the cache"):
        write_kv_cache(k, v, torch.tensor([1, NB * BS, 2]), attn.kv_cache, attn.prefix)
    with pytest.raises(RuntimeError, match="layers.1.attn.*outside the cache"):
        write_kv_cache(k, v, torch.tensor([1, -2, 2]), attn.kv_cache, attn.prefix)


def test_cache_write_skips_padding_rows():
    """A row at PAD_SLOT_ID (a decode graph's padding) writes nothing; the others land."""
    from vllm.model_executor.forward_context import PAD_SLOT_ID
    attn = Attention(4, 16, 2, 0.25, prefix="layers.1.attn")
    attn.kv_cache = torch.zeros(2, NB, BS, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    write_kv_cache(k, v, torch.tensor([7, PAD_SLOT_ID, 3]), attn.kv_cache, attn.prefix)
    flat_k, flat_v = attn.kv_cache[0].view(-1, 2, 16), attn.kv_cache[1].view(-1, 2, 16)
    assert torch.equal(flat_k[[7, 3]], k[[0, 2]]) and torch.equal(flat_v[[7, 3]], v[[0, 2]])
    for flat in (flat_k, flat_v):                                        # nothing else written
        assert flat.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [3, 7]


def _prompt_case(lens, hq, hkv, d, dtype, seed, bs=BS):
    """Decode-style sequences whose every token is a query: (cache, tables, md, q [T], rows [T],
    ctx [T]) with token p of sequence s attending its first p + 1 tokens."""
    cache, tables, md, _ = _decode_case(lens, hq, hkv, d, dtype, seed=seed, bs=bs)
    rows = torch.tensor([s for s, L in enumerate(lens) for _ in range(L)])
    ctx = torch.tensor([p + 1 for L in lens for p in range(L)])
    q = torch.randn(len(rows), hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return cache, tables, md, q, rows, ctx


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (6, 2, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_prompt_tokens_attend_causally_through_rows(hq, hkv, d, dtype, tol):
    """Every token of several prompts in one call (rows name each token's sequence, lens its
    position + 1) equals the naive attention of each token over its own prefix."""
    lens = [1, 5, 17, 40]
    cache, tables, md, q, rows, ctx = _prompt_case(lens, hq, hkv, d, dtype, seed=d)
    got = paged_attention(q, cache, md.block_tables, ctx, d ** -0.5, hkv, rows)
    want = _naive(cache, [tables[r] for r in rows.tolist()], ctx.tolist(), q, d ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_a_query_does_not_depend_on_the_others_in_the_call():
    """The bits a chunked prefill relies on: each token alone equals it inside the whole call."""
    cache, tables, md, q, rows, ctx = _prompt_case([9, 33], 4, 2, 64, torch.bfloat16, seed=3)
    whole = paged_attention(q, cache, md.block_tables, ctx, 0.125, 2, rows)
    for t in (0, 8, 9, 20, 41):
        alone = paged_attention(q[t:t + 1], cache, md.block_tables, ctx[t:t + 1], 0.125, 2,
                                rows[t:t + 1])
        assert torch.equal(alone, whole[t:t + 1])


def test_rejects_a_row_outside_the_block_tables():
    cache, tables, md, q, rows, ctx = _prompt_case([3, 4], 4, 2, 16, torch.float32, seed=1)
    rows[2] = 2                                                   # only rows 0 and 1 exist
    with pytest.raises(RuntimeError, match="outside the block tables"):
        paged_attention(q, cache, md.block_tables, ctx, 0.25, 2, rows)
