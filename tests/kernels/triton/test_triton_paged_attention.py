"""The Triton paged-attention kernels (``vllm/kernels/triton/paged_attention.py``) against a dense
torch reference written here: per sequence, the full [Lq, ctx] score matrix in float64 with the
causal / sliding-window mask and the sink as an extra logit column.

Batches lay each sequence's context over random, non-contiguous cache blocks with its history
already written, then run the step as the backend does: the KV write (padding rows at
PAD_SLOT_ID untouched), then one attention launch over every query token. Without a GPU the
kernels run under Triton's interpreter (tests/conftest.py); ``block_n`` 8 makes a context cross
several loop steps (the online-softmax rescale) and windows start mid-step.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from vllm.kernels.triton import interpreting                                  # noqa: E402
from vllm.model_executor.forward_context import PAD_SLOT_ID                   # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreting():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1: the kernels cannot run here",
                allow_module_level=True)

from vllm.kernels.triton.paged_attention import paged_attention, write_kv_cache  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
MIXED = ([(17, 1), (5, 1), (33, 1), (40, 6), (9, 9)], 3)
"""(context incl. new tokens, new tokens), decodes first: a chunk whose history (34) is longer
than the chunk, and a whole prompt."""
DECODES = ([(17, 1), (1, 1), (33, 1), (8, 1)], 4)


def reference(q, k, v, first_pos, scale, window=None, sinks=None):
    """q [Lq, Hq, D] at positions first_pos.., k/v [ctx, Hkv, D] -> [Lq, Hq, D] float64."""
    Lq, Hq, _ = q.shape
    ctx, Hkv = k.shape[:2]
    heads = torch.arange(Hq) // (Hq // Hkv)
    kh, vh = k.double()[:, heads].transpose(0, 1), v.double()[:, heads].transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kh.transpose(1, 2) * scale      # [Hq, Lq, ctx]
    pos = torch.arange(first_pos, first_pos + Lq)[:, None]
    j = torch.arange(ctx)[None, :]
    keep = (j <= pos) & ((j > pos - window) if window is not None else True)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(Hq, 1, 1).expand(Hq, Lq, 1)], dim=-1)
    return (torch.softmax(scores, dim=-1)[..., :ctx] @ vh).transpose(0, 1)


class Case:
    """A step over a paged cache [P, nb, bs, Hkv, D] (history written, blocks shuffled): q, the
    new k/v rows, their slots, the metadata tensors and the reference output."""

    def __init__(self, seqs, num_decodes, hq=4, hkv=2, d=16, bs=4, dtype=torch.float32,
                 shared=False, window=None, use_sinks=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.window, self.scale, self.num_decodes = window, d ** -0.5, num_decodes
        self.sinks = torch.randn(hq, generator=g) * 2 if use_sinks else None
        nb = sum(-(-c // bs) for c, _ in seqs) + 3
        self.cache = torch.zeros(1 if shared else 2, nb, bs, hkv, d, dtype=dtype)
        blocks = torch.randperm(nb, generator=g).tolist()
        planes = [p.view(-1, hkv, d) for p in self.cache]
        tables, qs, ks, vs, slots, refs = [], [], [], [], [], []
        for ctx, n in seqs:
            nblk = -(-ctx // bs)
            table, blocks = blocks[:nblk], blocks[nblk:]
            k = torch.randn(ctx, hkv, d, generator=g).to(dtype)
            v = k if shared else torch.randn(ctx, hkv, d, generator=g).to(dtype)
            q = (torch.randn(n, hq, d, generator=g) * 2).to(dtype)
            pos_slots = [table[p // bs] * bs + p % bs for p in range(ctx)]
            for plane, x in zip(planes, (k, v)):
                plane[pos_slots[:ctx - n]] = x[:ctx - n]                  # earlier steps
            slots += pos_slots[ctx - n:]
            tables.append(table)
            qs.append(q), ks.append(k[ctx - n:]), vs.append(v[ctx - n:])
            refs.append(reference(q, k, v, ctx - n, self.scale, window, self.sinks))
        width = max(map(len, tables)) + 1                                 # padded with 0
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.seq_lens = torch.tensor([c for c, _ in seqs])
        self.query_start_loc = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
        self.q, self.k, self.v = torch.cat(qs), torch.cat(ks), None if shared else torch.cat(vs)
        self.slots, self.ref = torch.tensor(slots), torch.cat(refs)

    def to(self, device):
        for name, x in vars(self).items():
            if isinstance(x, torch.Tensor):
                setattr(self, name, x.to(device))
        return self

    def run(self, **kw):
        write_kv_cache(self.k, self.v, self.slots, self.cache)
        return paged_attention(self.q, self.cache, self.block_tables, self.seq_lens,
                               self.query_start_loc, self.scale,
                               decode_only=self.num_decodes == self.q.shape[0],
                               window=self.window, sinks=self.sinks, **kw)

    def check(self, out):
        tol = TOL[self.cache.dtype]
        assert out.dtype == self.q.dtype and out.shape == self.q.shape
        torch.testing.assert_close(out.double().cpu(), self.ref.cpu(), atol=tol, rtol=tol)
        for plane, x in zip(self.cache, (self.k, self.v)):
            if x is not None:
                assert torch.equal(plane.reshape(-1, *x.shape[1:])[self.slots], x)


OPTIONS = {"plain": {}, "window5": dict(window=5), "sinks": dict(use_sinks=True),
           "window3_sinks": dict(window=3, use_sinks=True), "window1": dict(window=1)}


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
"""bf16 too: the per-token kernel has no tl.dot, and the tiled prefill and decode kernels widen
bf16 tiles to f32 before theirs under the interpreter only (its tl.dot is wrong on bf16
inputs), so a GPU's bf16 dot is not what bf16 checks here."""


@pytest.mark.triton
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_mixed_batch_with_chunked_prefill(dtype, opts):
    """3 decodes, a chunk with longer history, a whole prompt; GQA 4:2; 8 keys per step."""
    case = Case(*MIXED, dtype=dtype, seed=len(opts), **OPTIONS[opts]).to(DEVICE)
    case.check(case.run(block_n=8))


@pytest.mark.triton
@pytest.mark.parametrize("opts", ["plain", "window5", "window3_sinks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_decode_only(dtype, opts):
    """Decode-only (row = token, lengths from seq_lens), MQA 3:1, a length-1 sequence."""
    case = Case(*DECODES, hq=3, hkv=1, dtype=dtype, seed=3, **OPTIONS[opts]).to(DEVICE)
    case.check(case.run(block_n=8))


@pytest.mark.triton
@pytest.mark.parametrize("d,bs", [(72, 4), (80, 16), (64, 8)])
def test_kv_shared_and_head_dims(d, bs):
    """One plane read as keys and values (MLA-like, MQA 4:1) at non-power-of-two head dims
    (padded lanes masked), block sizes around the loop step, default keys per step."""
    case = Case(*MIXED, hq=4, hkv=1, d=d, bs=bs, shared=d == 72, window=7 if d != 64 else None,
                use_sinks=True, seed=d).to(DEVICE)
    case.check(case.run())


@pytest.mark.triton
@pytest.mark.parametrize("d", [96, 192, 576])
def test_split_head_dims_at_defaults(d):
    """Head dims held in two column tiles (paged_tiles.py: 64 + 32, 128 + 64, MLA's one plane
    of 512 + 64) through ``paged_attention`` at its defaults, decode-only and mixed (decodes on
    the decode kernels, the rest on the tiled one), with a window and sinks; and the split rule
    (powers of two, D = 24 and D = 80 keep one tile)."""
    from vllm.kernels.triton.paged_tiles import head_split, tile_width
    assert [head_split(x) for x in (576, 192, 96, 80, 128, 24, 8)] == [
        (512, 64), (128, 64), (64, 32), (128, 0), (128, 0), (32, 0), (16, 0)]
    assert tile_width(576) == 576 and tile_width(80) == 128
    for seqs in (([(9, 1), (3, 1)], 2), ([(9, 1), (12, 5)], 1)):
        case = Case(*seqs, hq=2, hkv=1, d=d, shared=d == 576, window=6, use_sinks=True,
                    seed=d).to(DEVICE)
        case.check(case.run(num_decodes=0 if case.num_decodes == 2 else 1))


@pytest.mark.triton
def test_mixed_batch_with_padded_metadata_buffers():
    """Buffers wider than the step (as a graph's static buffers): block-table rows past the
    sequences, seq_lens past B, query_start_loc past B + 1 filled with T."""
    case = Case(*MIXED, seed=5, window=4, use_sinks=True).to(DEVICE)
    T, B = case.q.shape[0], case.seq_lens.shape[0]
    case.block_tables = torch.cat([case.block_tables, torch.zeros_like(case.block_tables)])
    case.seq_lens = torch.cat([case.seq_lens, torch.ones(B, dtype=torch.long, device=DEVICE)])
    case.query_start_loc = torch.cat([case.query_start_loc,
                                      torch.full((B,), T, dtype=torch.long, device=DEVICE)])
    case.check(case.run(block_n=8))


@pytest.mark.triton
def test_decode_graph_padding_rows():
    """A decode batch padded as a graph replays it: padding rows (PAD_SLOT_ID, length 1, block
    0) write nothing and leave the real rows' results bit for bit; a length-0 row gives zeros."""
    case = Case(*DECODES, seed=7, use_sinks=True).to(DEVICE)
    before = case.cache.clone()
    want = case.run()
    written = case.cache.clone()
    case.cache.copy_(before)
    pad, dev = 3, DEVICE
    q = torch.cat([case.q, torch.randn(pad, *case.q.shape[1:], device=dev)])
    k = torch.cat([case.k, torch.randn(pad, *case.k.shape[1:], device=dev)])
    v = torch.cat([case.v, torch.randn(pad, *case.v.shape[1:], device=dev)])
    write_kv_cache(k, v, torch.cat([case.slots, torch.full((pad,), PAD_SLOT_ID, device=dev)]),
                   case.cache)
    assert torch.equal(case.cache, written)
    tables = torch.cat([case.block_tables, torch.zeros_like(case.block_tables[:pad])])
    lens = torch.cat([case.seq_lens, torch.tensor([1, 1, 0], device=dev)])
    out = paged_attention(q, case.cache, tables, lens, torch.arange(q.shape[0] + 1, device=dev),
                          case.scale, decode_only=True, sinks=case.sinks)
    assert torch.equal(out[:-pad], want) and torch.isfinite(out).all()
    assert not out[-1].any()


@pytest.mark.triton
def test_decode_reads_lengths_and_tables_from_device_tensors():
    """The same call (same tensors, same host arguments) after the step's lengths and block
    tables changed in place, as a replayed graph sees them: the new lengths are attended."""
    case = Case(*DECODES, seed=9).to(DEVICE)
    case.check(case.run(block_n=8))
    other = Case([(30, 1), (2, 1), (12, 1), (20, 1)], 4, seed=10).to(DEVICE)
    case.cache.copy_(other.cache)
    case.block_tables[:, :other.block_tables.shape[1]].copy_(other.block_tables)
    case.seq_lens.copy_(other.seq_lens)
    case.q.copy_(other.q), case.k.copy_(other.k), case.v.copy_(other.v)
    case.slots.copy_(other.slots)
    case.ref = other.ref
    case.check(case.run(block_n=8))


def test_rejects_bad_inputs_naming_them():
    case = Case(*MIXED).to(DEVICE)
    args = (case.cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    with pytest.raises(ValueError, match=r"block_tables must be an int64 2-d tensor.*int32"):
        paged_attention(case.q, case.cache, case.block_tables.int(), *args[2:],
                        decode_only=False)
    with pytest.raises(ValueError, match=r"q must be a \[T, H, 16\] float tensor"):
        paged_attention(case.q[..., :8], *args, decode_only=False)
    with pytest.raises(ValueError, match=r"q has 3 heads, not a multiple of the cache's 2"):
        paged_attention(case.q[:, :3], *args, decode_only=False)
    with pytest.raises(ValueError, match=r"window=0 must be >= 1"):
        paged_attention(case.q, *args, decode_only=False, window=0)
    with pytest.raises(ValueError, match=r"sinks must be a float32 \[4\] tensor"):
        paged_attention(case.q, *args, decode_only=False, sinks=torch.zeros(4, dtype=torch.half))
    with pytest.raises(ValueError, match=r"block_n=12 must be a power of two"):
        paged_attention(case.q, *args, decode_only=False, block_n=12)
    with pytest.raises(ValueError, match=r"kv_cache must be a contiguous"):
        write_kv_cache(case.k, case.v, case.slots, case.cache[:, 1:])
    with pytest.raises(ValueError, match=r"v must be None for a one-plane cache"):
        write_kv_cache(case.k, case.v, case.slots, case.cache[:1])
    with pytest.raises(ValueError, match=r"slot_mapping \(3,\) do not match"):
        write_kv_cache(case.k, case.v, case.slots[:3], case.cache)


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("opts", list(OPTIONS))
def test_on_cuda_at_model_shapes(dtype, opts):
    """The compiled kernels on the GPU: GQA 8:1 at D=128, block 16, long contexts; MLA-like 576."""
    seqs = ([(1000, 1), (3, 1), (517, 1), (700, 300), (257, 257)], 3)
    for shape in (dict(hq=8, hkv=1, d=128), dict(hq=16, hkv=1, d=576, shared=True)):
        case = Case(*seqs, bs=16, dtype=dtype, **shape, **OPTIONS[opts]).to("cuda")
        case.check(case.run())


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("opts", list(OPTIONS))
def test_decode_kernels_on_cuda_at_model_shapes(dtype, opts):
    """Decode-only steps take paged_decode.py's split-context kernels (tl.dot over the GQA
    group): GQA 4:1 and 8:1 at D=128, block 16; contexts of 1 key to past 16 chunks of 256 (a
    5000-key sequence gets chunks of 512); a sequence alone gives the batch's bits."""
    seqs = ([(5000, 1), (1, 1), (1000, 1), (257, 1)], 4)
    for shape in (dict(hq=16, hkv=4, d=128), dict(hq=8, hkv=1, d=128)):
        case = Case(*seqs, bs=16, dtype=dtype, **shape, **OPTIONS[opts]).to("cuda")
        out = case.run()
        case.check(out)
        alone = paged_attention(case.q[:1], case.cache, case.block_tables[:1],
                                case.seq_lens[:1], case.query_start_loc[:2], case.scale,
                                decode_only=True, window=case.window, sinks=case.sinks)
        assert torch.equal(alone[0], out[0])
