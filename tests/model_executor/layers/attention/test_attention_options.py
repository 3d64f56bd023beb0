"""Attention's options (sliding window, sinks, shared K=V) on every path, against a reference
written here: the full score matrix in float64 with an explicit window mask and the sink as an
extra logit column. The sinks and the window are also checked against transformers' GPT-OSS
eager attention and its sliding-window mask definition."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context

from .test_attention import make_attention

OPTIONS = {
    "window3": dict(sliding_window=3),
    "window50": dict(sliding_window=50),          # wider than every context: no effect
    "sinks": dict(use_sinks=True),
    "window_sinks": dict(sliding_window=5, use_sinks=True),
    "shared": dict(kv_shared=True),
    "shared_window_sinks": dict(kv_shared=True, sliding_window=4, use_sinks=True),
}
BATCHES = {
    # (context len incl. new tokens, new tokens), decodes first; block size 4 divides few.
    "mixed": ([(9, 1), (3, 1), (14, 1), (10, 5), (6, 6)], 3),
    "decodes": ([(9, 1), (1, 1), (14, 1), (5, 1)], 4),
    "prompts": ([(7, 7), (1, 1), (13, 13)], 0),
    "chunks": ([(11, 3), (13, 8)], 0),
}


def reference(q, k, v, q_pos, scale, window=None, sinks=None):
    """q [Lq, Hq, D] at positions q_pos, k/v [ctx, Hkv, D] -> [Lq, Hq, D] float64."""
    Lq, Hq, _ = q.shape
    ctx, Hkv = k.shape[:2]
    heads = torch.arange(Hq) // (Hq // Hkv)
    kh = k.double()[:, heads].transpose(0, 1)                          # [Hq, ctx, D]
    vh = v.double()[:, heads].transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kh.transpose(1, 2) * scale   # [Hq, Lq, ctx]
    allowed = torch.zeros(Lq, ctx, dtype=torch.bool)
    for i, p in enumerate(q_pos):
        lo = 0 if window is None else max(0, p - window + 1)         # keys (p - W, p]
        allowed[i, lo:p + 1] = True
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(Hq, 1, 1).expand(Hq, Lq, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :ctx]
    return (probs @ vh).transpose(0, 1)


def make_layer(backend="auto", hq=6, hkv=2, d=8, seed=0, **options):
    attn = make_attention(backend, hq=hq, hkv=hkv, d=d, scale=d ** -0.5, **options)
    if attn.sinks is not None:
        g = torch.Generator().manual_seed(seed + 100)
        attn.sinks.copy_(torch.randn(hq, generator=g) * 2)
    return attn


def paged_case(attn, seqs, num_decodes, bs=4, dtype=torch.float32, seed=0, scale_q=1.0):
    """Binds a fresh cache to ``attn`` and lays ``seqs`` over shuffled blocks with their history
    written: (md, q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D] or None when shared, ref [T, Hq, D])."""
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    shared = attn.options.kv_shared
    nb = sum(-(-c // bs) for c, _ in seqs) + 1
    attn.kv_cache = torch.zeros(attn.kv_cache_shape(nb, bs), dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    blocks = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    planes = [attn.kv_cache[i].view(-1, hkv, d) for i in range(attn.kv_cache.shape[0])]
    tables, qs, ks, vs, slots, refs = [], [], [], [], [], []
    for ctx, n in seqs:
        nblk = -(-ctx // bs)
        table, blocks = blocks[:nblk], blocks[nblk:]
        tables.append(table)
        k = torch.randn(ctx, hkv, d, generator=g).to(dtype)
        v = k if shared else torch.randn(ctx, hkv, d, generator=g).to(dtype)
        q = (torch.randn(n, hq, d, generator=g) * scale_q).to(dtype)
        for p in range(ctx):
            slot = table[p // bs] * bs + p % bs
            if p < ctx - n:                          # history, written by earlier steps
                planes[0][slot] = k[p]
                if not shared:
                    planes[1][slot] = v[p]
            else:
                slots.append(slot)
        qs.append(q), ks.append(k[ctx - n:]), vs.append(v[ctx - n:])
        refs.append(reference(q, k, v, range(ctx - n, ctx), attn.scale,
                              attn.options.sliding_window, attn.sinks))
    width = max(map(len, tables))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor([c for c, _ in seqs]),
        query_start_loc=torch.tensor([0] + [n for _, n in seqs]).cumsum(0),
        seq_lens_cpu=[c for c, _ in seqs], query_lens_cpu=[n for _, n in seqs],
        num_decodes=num_decodes, block_size=bs)
    T = md.query_start_loc_cpu[-1]
    v_new = None if shared else torch.cat(vs).view(T, -1)
    return md, torch.cat(qs).view(T, -1), torch.cat(ks).view(T, -1), v_new, torch.cat(refs)


def run_paged(attn, md, q, k, v):
    with set_forward_context(md):
        return attn(q, k, v).view(q.shape[0], attn.num_heads, attn.head_dim)


@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa3", "mqa4"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
def test_backends_match_reference(backend, opts, batch, heads):
    attn = make_layer(backend, *heads, **OPTIONS[opts])
    md, q, k, v, ref = paged_case(attn, *BATCHES[batch])
    assert attn.impl.name == backend
    out = run_paged(attn, md, q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The new keys (and values) landed in their slots; a shared cache has one plane.
    flat = attn.kv_cache.view(attn.kv_cache.shape[0], -1, heads[1], 8)
    assert torch.equal(flat[0][md.slot_mapping], k.view(-1, heads[1], 8))
    if v is not None:
        assert torch.equal(flat[1][md.slot_mapping], v.view(-1, heads[1], 8))


@pytest.mark.parametrize("opts", list(OPTIONS))
def test_plain_forward_and_dummy_run_match_reference(opts):
    """No metadata: one causal sequence. Metadata without a cache: each sequence alone."""
    attn = make_layer(**OPTIONS[opts])
    shared = attn.options.kv_shared
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(13, 6, 8, generator=g), torch.randn(13, 2, 8, generator=g), \
        torch.randn(13, 2, 8, generator=g)
    v = k if shared else v
    window, sinks = attn.options.sliding_window, attn.sinks
    out = attn(q.view(13, -1), k.view(13, -1), None if shared else v.view(13, -1))
    torch.testing.assert_close(out.view(13, 6, 8).double(),
                               reference(q, k, v, range(13), attn.scale, window, sinks),
                               atol=1e-5, rtol=1e-5)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(13, dtype=torch.long), block_tables=torch.zeros(2, 2),
        seq_lens=torch.tensor([6, 7]), query_start_loc=torch.tensor([0, 6, 13]),
        seq_lens_cpu=[6, 7], query_lens_cpu=[6, 7], num_decodes=0, block_size=4)
    with set_forward_context(md):
        out = attn(q.view(13, -1), k.view(13, -1), None if shared else v.view(13, -1))
    ref = torch.cat([reference(q[:6], k[:6], v[:6], range(6), attn.scale, window, sinks),
                     reference(q[6:], k[6:], v[6:], range(7), attn.scale, window, sinks)])
    torch.testing.assert_close(out.view(13, 6, 8).double(), ref, atol=1e-5, rtol=1e-5)


LONG = [(70, 1), (33, 1), (100, 1), (17, 17), (90, 40)]
"""Many 16-token chunks; windows starting mid-block and mid-chunk."""


@pytest.mark.parametrize("window,bs", [(37, 16), (16, 16), (21, 32), (None, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
def test_long_contexts_kernel_shapes(backend, dtype, tol, window, bs):
    """G=2, D=64 (a shape the C kernel specialises; bf16 q . k by pairs), scores spread over
    tens of units so a wrong online-softmax rescale or sink seed shows (no sinks with W=16:
    bf16 SDPA with a window mask)."""
    attn = make_layer(backend, 4, 2, 64, sliding_window=window, use_sinks=window != 16)
    md, q, k, v, ref = paged_case(attn, LONG, 3, bs=bs, dtype=dtype, seed=bs, scale_q=3.0)
    out = run_paged(attn, md, q, k, v)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_c_kernel_chunked_prefill_equals_whole_prefill_bitwise():
    """A query's result depends only on its q, position and the cache, window and sinks too."""
    attn = make_layer("cpu_paged", 4, 2, 64, sliding_window=9, use_sinks=True)
    md, q, k, v, _ = paged_case(attn, [(30, 30)], 0, bs=8, dtype=torch.bfloat16)
    whole = run_paged(attn, md, q, k, v)
    table, slots = md.block_tables, md.slot_mapping
    for lo, hi in ((0, 11), (11, 12), (12, 30)):
        part = AttentionMetadata(
            slot_mapping=slots[lo:hi], block_tables=table, seq_lens=torch.tensor([hi]),
            query_start_loc=torch.tensor([0, hi - lo]), seq_lens_cpu=[hi],
            query_lens_cpu=[hi - lo], num_decodes=int(hi - lo == 1), block_size=8)
        assert torch.equal(run_paged(attn, part, q[lo:hi], k[lo:hi], v[lo:hi]), whole[lo:hi])


def test_sinks_and_window_match_transformers_gpt_oss_eager():
    """transformers' GptOss ``eager_attention_forward`` (sink column, softmax, drop) with its
    sliding-window causal mask (masking_utils) on random tensors: our plain forward and both
    backends (a prompt prefilled in two chunks) give its output."""
    from transformers.masking_utils import and_masks, causal_mask_function, \
        sliding_window_overlay
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    L, W = 19, 6
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(L, 6, 8, generator=g), torch.randn(L, 2, 8, generator=g), \
        torch.randn(L, 2, 8, generator=g)
    sinks = torch.randn(6, generator=g) * 2
    keep = and_masks(causal_mask_function, sliding_window_overlay(W))
    zero = torch.tensor(0)
    mask = keep(zero, zero, torch.arange(L)[:, None], torch.arange(L)[None, :])   # [L, L]
    assert mask.shape == (L, L) and mask.sum(1).max() == W
    additive = torch.zeros(L, L).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.sinks = 3, sinks
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], additive[None, None], 8 ** -0.5)
    want = want[0]                                                     # [L, Hq, D]
    attn = make_layer(sliding_window=W, use_sinks=True)
    attn.sinks.copy_(sinks)
    got = attn(q.view(L, -1), k.view(L, -1), v.view(L, -1)).view(L, 6, 8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for backend in ("cpu_paged", "torch_sdpa"):
        layer = make_layer(backend, sliding_window=W, use_sinks=True)
        layer.sinks.copy_(sinks)
        layer.kv_cache = torch.zeros(layer.kv_cache_shape(8, 4))
        for lo, hi in ((0, 11), (11, L)):
            md = AttentionMetadata(
                slot_mapping=torch.arange(lo, hi), block_tables=torch.arange(5)[None],
                seq_lens=torch.tensor([hi]), query_start_loc=torch.tensor([0, hi - lo]),
                seq_lens_cpu=[hi], query_lens_cpu=[hi - lo], num_decodes=0, block_size=4)
            out = run_paged(layer, md, q[lo:hi].reshape(hi - lo, -1),
                            k[lo:hi].reshape(hi - lo, -1), v[lo:hi].reshape(hi - lo, -1))
            torch.testing.assert_close(out, want[lo:hi], atol=1e-5, rtol=1e-5)
