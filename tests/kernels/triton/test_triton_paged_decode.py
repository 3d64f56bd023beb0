"""The split-context decode kernels (``vllm/kernels/triton/paged_decode.py``) against the float64
torch reference of test_triton_paged_attention.py (``Case``: shuffled cache blocks, history
written, then the step's KV write), under Triton's interpreter.

fp16 and fp32 carry the numerics (the interpreter's ``tl.dot`` is right for them); bf16 runs the
interpreter-only variant that widens the dot operands to f32 (the interpreter reads bf16 tiles as
uint16), so it checks the gather and the softmax but not the bf16 tensor-core dot. Small
``block_n`` (8: a 16-key tile half masked; 16) and ``min_chunk`` make contexts of tens of keys
cross several steps and several chunks; the batch-invariance tests compare bits.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]

from test_triton_paged_attention import DEVICE, TOL, Case                      # noqa: E402

from vllm.kernels.triton import paged_decode as pd                             # noqa: E402
from vllm.kernels.triton.paged_attention import paged_attention, write_kv_cache  # noqa: E402

SEQS = [(1, 1), (37, 1), (100, 1), (70, 1)]
"""(context incl. the new token, 1): a context of 1, and contexts over several chunks."""
DTYPES = {"f32": torch.float32, "f16": torch.float16}
OPTIONS = {"plain": {}, "window5": dict(window=5), "window40": dict(window=40),
           "sinks": dict(use_sinks=True), "window3_sinks": dict(window=3, use_sinks=True),
           "window1": dict(window=1), "shared_sinks": dict(shared=True, use_sinks=True),
           "shared_window9": dict(shared=True, window=9)}


def decode(case: Case, q=None, tables=None, lens=None, **kw) -> torch.Tensor:
    """Writes the step's KV, then ``paged_decode`` on the case (or the given rows)."""
    write_kv_cache(case.k, case.v, case.slots, case.cache)
    return pd.paged_decode(case.q if q is None else q, case.cache,
                           case.block_tables if tables is None else tables,
                           case.seq_lens if lens is None else lens, case.scale,
                           window=case.window, sinks=case.sinks, **kw)


def make(seqs=SEQS, **kw) -> Case:
    return Case(seqs, len(seqs), **kw).to(DEVICE)


@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gqa_groups_and_head_dims(dtype, group, d):
    """GROUP query heads per program (padded to 16 rows), D = 80 masked to BLOCK_D = 128; 16
    keys per step, 32 per chunk: 4 chunks of 2 steps over the longest context."""
    case = make(hq=2 * group, hkv=2, d=d, dtype=DTYPES[dtype], seed=group * d)
    assert pd.decode_chunks(case.block_tables.shape[1] * 4, 16, 32) == (4, 32)
    case.check(decode(case, block_n=16, min_chunk=32))


@pytest.mark.parametrize("heads", [1, 4, 6])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_query_heads_split_over_programs(dtype, heads):
    """A kv head's GROUP = 6 query heads over cdiv(6, heads) programs (4: the second program's
    rows past the group masked), with sinks and a window, 3 kv heads: the last kv head's
    padding rows must not read or write past Hq."""
    case = make(hq=18, hkv=3, d=32, dtype=DTYPES[dtype], seed=heads, window=40, use_sinks=True)
    case.check(decode(case, block_n=16, min_chunk=32, heads=heads))


def test_decode_heads_rule():
    """All of a group in one program unless its rows pass the target: DeepSeek-V2's 128 heads at
    D = 576 in 8 programs of 16; the shipped GQA shapes unsplit."""
    assert pd.decode_heads(128, 576, False) == 16 and pd.decode_heads(16, 576, False) == 16
    assert pd.decode_heads(8, 128, False) == 8 and pd.decode_heads(128, 128, False) == 128
    assert pd.decode_heads(100, 256, False) == 64 and pd.decode_heads(6, 576, True) == 6
    assert pd.decode_heads(64, 128, True) == 32
    with pytest.raises(ValueError, match=r"heads=7 per program must be in \[1, 6\]"):
        pd.partial_consts(6, 1, 64, 16, 16, f32_cache=False, has_window=False, heads=7)


@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_window_sinks_and_kv_shared(dtype, opts):
    """Windows starting mid-step and mid-chunk (leading chunks empty), sinks, one plane read as
    keys and values; 8 keys per step (a 16-key tile, half masked), 16 per chunk; GQA 6:2."""
    case = make(hq=6, hkv=2, d=24, dtype=DTYPES[dtype], seed=len(opts), **OPTIONS[opts])
    case.check(decode(case, block_n=8, min_chunk=16))


@pytest.mark.parametrize("opts", ["plain", "window3_sinks", "shared_sinks"])
def test_bf16_with_widened_dot_operands(opts):
    """bf16 caches through the interpreter-only f32 dot (module docstring): the gather, masks and
    softmax at bf16 tolerance; the bf16 tensor-core dot itself is the compile test's and the
    GPU's to check."""
    case = make(hq=4, hkv=2, d=80, dtype=torch.bfloat16, seed=11, **OPTIONS[opts])
    case.check(decode(case, block_n=16, min_chunk=32))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_default_chunks_through_paged_attention(dtype):
    """``paged_attention(decode_only=True)`` at its defaults: 64 keys per step, 256 per chunk, a
    600-key context over 3 chunks, MQA 8:1 at D = 64, block size 16, window and sinks."""
    case = Case([(600, 1), (1, 1), (300, 1)], 3, hq=8, hkv=1, d=64, bs=16, window=500,
                use_sinks=True, dtype=DTYPES[dtype], seed=1).to(DEVICE)
    width = case.block_tables.shape[1]
    assert pd.decode_chunks(width * 16, pd.decode_block_n(64)) == (3, 256)
    case.check(case.run())


def test_padding_rows_and_an_empty_row():
    """Graph padding rows (length 1, block 0) give finite outputs; a length-0 row without a sink
    gives zeros; with a sink, exp(sink) alone in the denominator also gives zeros."""
    for sinks in (False, True):
        case = make(seed=2, use_sinks=sinks)
        want = decode(case, block_n=16, min_chunk=32)
        pad = torch.randn(3, *case.q.shape[1:], device=DEVICE)
        tables = torch.cat([case.block_tables, torch.zeros_like(case.block_tables[:3])])
        lens = torch.cat([case.seq_lens, torch.tensor([1, 1, 0], device=DEVICE)])
        out = decode(case, torch.cat([case.q, pad]), tables, lens, block_n=16, min_chunk=32)
        assert torch.equal(out[:-3], want) and torch.isfinite(out).all()
        assert not out[-1].any()


def assert_alone_is_the_same(case: Case, batch: torch.Tensor, **kw) -> None:
    """Each row of ``batch`` is the same bits as its sequence decoded alone."""
    for t in range(batch.shape[0]):
        alone = decode(case, case.q[t:t + 1], case.block_tables[t:t + 1],
                       case.seq_lens[t:t + 1], **kw)
        assert torch.equal(alone[0], batch[t])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_batch_invariance(dtype):
    """A sequence's output rows are the same bits alone, in a batch of 3, in the other order,
    with padding rows, and with a block table 8 times as wide (an eager step's tables are as wide
    as its longest sequence, a graph's as max_model_len): chunks follow each sequence's length."""
    case = make(SEQS[1:], hq=8, hkv=2, d=80, dtype=DTYPES[dtype], window=60, use_sinks=True,
                seed=4)
    kw = dict(block_n=16, min_chunk=32)
    batch = decode(case, **kw)
    case.check(batch)
    assert_alone_is_the_same(case, batch, **kw)
    flip = torch.arange(2, -1, -1, device=DEVICE)
    assert torch.equal(decode(case, case.q[flip], case.block_tables[flip], case.seq_lens[flip],
                              **kw), batch[flip])
    pad = torch.randn(5, *case.q.shape[1:], device=DEVICE).to(case.q.dtype)
    tables = torch.cat([case.block_tables, torch.zeros_like(case.block_tables[:1]).expand(5, -1)])
    lens = torch.cat([case.seq_lens, torch.ones(5, dtype=torch.long, device=DEVICE)])
    assert torch.equal(decode(case, torch.cat([case.q, pad]), tables, lens, **kw)[:3], batch)
    wide = torch.cat([case.block_tables] + [torch.zeros_like(case.block_tables)] * 7, dim=1)
    width = case.block_tables.shape[1] * 4
    assert pd.decode_chunks(width, 16, 32)[0] < pd.decode_chunks(8 * width, 16, 32)[0]
    assert torch.equal(decode(case, tables=wide, **kw), batch)


def test_long_sequences_take_longer_chunks():
    """Base 8 keys (block_n = min_chunk = 8): a 300-key sequence needs chunks of 32 (at most
    MAX_CHUNKS of them) while a 20-key one keeps chunks of 8, in the same launch; each matches
    the reference and is the same bits alone and beside the other."""
    case = make([(300, 1), (20, 1)], hq=4, hkv=2, d=64, dtype=torch.float32, seed=7)
    assert [pd.sequence_chunk(n, 8) for n in (300, 20)] == [32, 8]
    kw = dict(block_n=8, min_chunk=8)
    both = decode(case, **kw)
    case.check(both)
    assert_alone_is_the_same(case, both, **kw)


def test_launch_depends_on_shapes_only(monkeypatch):
    """Two steps with the same shapes and different lengths and tables launch the same grids
    with the same host arguments (what a captured graph replays)."""
    launches = []

    class Spy:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((self.fn.__name__, grid, [a for a in args
                                                          if not isinstance(a, torch.Tensor)],
                                 kw))
                return self.fn[grid](*args, **kw)
            return launch

    for name in ("_decode_partial_kernel", "_decode_reduce_kernel"):
        monkeypatch.setattr(pd, name, Spy(getattr(pd, name)))
    seen = []
    for seed, seqs in ((5, [(30, 1), (2, 1), (12, 1)]), (6, [(3, 1), (29, 1), (1, 1)])):
        launches.clear()
        case = make(seqs, seed=seed)
        case.check(decode(case, block_n=8, min_chunk=16))
        seen.append(list(launches))
    assert seen[0] == seen[1] and len(seen[0]) == 2
    num_chunks, base = pd.decode_chunks(case.block_tables.shape[1] * 4, 8, 16)
    assert num_chunks > 1 and base in seen[0][0][2]
    assert seen[0][0][1] == (3, 2, num_chunks) and seen[0][1][1] == (3, 4)


def test_decode_chunks_rule():
    """The grid's chunks come from the table's width (at most MAX_CHUNKS); a sequence's chunk
    size from its own length: base = max(min_chunk, block_n) up to MAX_CHUNKS of them, then
    doubling. Every length up to the width fits the grid's chunks, in multiples of block_n."""
    assert (pd.MIN_CHUNK, pd.MAX_CHUNKS) == (256, 16)
    assert pd.decode_chunks(0, 64) == (1, 256) == pd.decode_chunks(1, 64)
    assert pd.decode_chunks(4096, 64) == (16, 256) == pd.decode_chunks(1 << 20, 64)
    assert pd.decode_chunks(600, 64) == (3, 256)
    assert pd.decode_chunks(100, 512) == (1, 512)
    assert pd.decode_chunks(100, 8, 16) == (7, 16)
    assert [pd.sequence_chunk(n, 256) for n in (1, 4096, 4097, 131072)] == [256, 256, 512, 8192]
    for max_ctx in (1, 17, 999, 4096, 5000, 70000, 1 << 20):
        for block_n in (8, 16, 64):
            num_chunks, base = pd.decode_chunks(max_ctx, block_n)
            assert 1 <= num_chunks <= pd.MAX_CHUNKS and base % block_n == 0
            for n in (1, max_ctx // 3, max_ctx):
                chunk = pd.sequence_chunk(n, base)
                assert chunk % block_n == 0 and -(-n // chunk) <= num_chunks
    with pytest.raises(ValueError, match=r"block_n=12 must be a power of two"):
        pd.decode_chunks(100, 12)
    with pytest.raises(ValueError, match=r"min_chunk=0 must be a power of two"):
        pd.decode_chunks(100, 16, 0)


def test_decode_only_dispatch(monkeypatch):
    """``paged_attention`` sends decode-only steps (and only those) to ``paged_decode``."""
    import vllm.kernels.triton.paged_attention as pa
    calls = []
    monkeypatch.setattr(pa, "paged_decode",
                        lambda *a, **kw: calls.append(kw) or pd.paged_decode(*a, **kw))
    case = make(seed=8)
    case.check(case.run(block_n=16))
    assert calls == [dict(window=None, sinks=None, block_n=16)]
    mixed = Case([(9, 1), (12, 4)], 1, seed=8).to(DEVICE)
    mixed.check(mixed.run(block_n=8))
    assert len(calls) == 1


def test_writes_into_a_given_output():
    """``out``: the result lands there (the bits of a fresh output) and is returned; a buffer of
    another shape, dtype or layout is refused."""
    case = make(hq=4, hkv=2, d=16, seed=2)
    want = decode(case)
    out = torch.full_like(want, float("nan"))
    assert decode(case, out=out) is out and torch.equal(out, want)
    for bad in (out[:-1], out.double(), out.transpose(0, 1).contiguous().transpose(0, 1)):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            decode(case, out=bad)


@pytest.mark.parametrize("d,opts", [(80, "window5"), (96, "sinks"), (192, "window3_sinks"),
                                    (576, "shared_sinks")])
def test_head_dims_split_in_two_tiles(d, opts):
    """Head dims that are not powers of two: 96 = 64 + 32 and 192 = 128 + 64 column tiles, MLA's
    one plane of 576 = 512 + 64 (values = keys), and 80 padded to 128 (``head_split``); fp32,
    GQA 2:1, 16 keys per step over 2 chunks."""
    case = make([(37, 1), (5, 1)], hq=2, hkv=1, d=d, seed=d, **OPTIONS[opts])
    case.check(decode(case, block_n=16, min_chunk=32))
