"""The query-tiled prefill kernel (``vllm/kernels/triton/paged_prefill.py``) against the float64
torch reference of test_triton_paged_attention.py (``Case``: per sequence the dense [Lq, ctx]
score matrix with the causal / window mask and the sink column; shuffled cache blocks, history
written, then the step's KV write): under Triton's interpreter on CPU, compiled where a GPU is.

fp16 and fp32 only: the interpreter's ``tl.dot`` is wrong on bf16 tiles (the kernel widens them
there; test_triton_paged_attention.py's bf16 cases run that path). Small ``block_m`` (tokens per
tile) and ``block_n`` (keys per step; 8 = a 16-key tile half masked) make short sequences span
several tiles and contexts cross several key steps; block size 4 or 16 spreads them over many
shuffled blocks.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton
# No interpreter fixture: on a GPU machine (DEVICE "cuda") these run the compiled kernel.

from test_triton_paged_attention import DEVICE, Case                           # noqa: E402

from vllm.kernels.triton import paged_prefill as pp                           # noqa: E402
from vllm.kernels.triton.paged_attention import write_kv_cache               # noqa: E402
from vllm.model_executor.forward_context import AttentionMetadata             # noqa: E402

MIXED = ([(20, 1), (5, 1), (3, 3), (17, 17), (90, 70), (40, 17)], 2)
"""(context incl. new tokens, new tokens), decodes first: prompts of 3 and 17 tokens, a chunk of
70 whose history (20) precedes it, a chunk of 17 starting at position 23."""
SMALL = ([(12, 1), (3, 3), (30, 13)], 1)
"""A decode, a 3-token prompt, a 13-token chunk at position 17."""
DTYPES = {"f32": torch.float32, "f16": torch.float16}
HEADS = {"gqa1": (2, 2), "gqa4": (8, 2), "gqa8": (8, 1)}
OPTIONS = {"window5": dict(window=5), "window15": dict(window=15), "sinks": dict(use_sinks=True),
           "window3_sinks": dict(window=3, use_sinks=True), "window1": dict(window=1),
           "shared_sinks": dict(shared=True, use_sinks=True),
           "shared_window9": dict(shared=True, window=9)}


def make(seqs=MIXED, **kw) -> Case:
    return Case(*seqs, **kw).to(DEVICE)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mixed_step_gqa(dtype, heads):
    """Decodes then prefills at D = 64; 16 tokens per tile (the 70-token chunk in 5 tiles, the
    last one partial) and 16 keys per step (90 keys in 6 steps)."""
    hq, hkv = HEADS[heads]
    case = make(hq=hq, hkv=hkv, d=64, dtype=DTYPES[dtype], seed=hq + hkv)
    case.check(case.run(block_m=16, block_n=16))


@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_window_sinks_and_kv_shared(dtype, opts):
    """Windows narrower than a tile and wider (the tile's key loop starts at its first token's
    lo), sinks, one plane read as keys and values; GQA 6:2 (rows padded), D = 24 (masked to 32);
    5 tokens per tile (a tile of 15 rows in 16), 8 keys per step."""
    case = make(SMALL, hq=6, hkv=2, d=24, dtype=DTYPES[dtype], seed=len(opts), **OPTIONS[opts])
    case.check(case.run(block_m=5, block_n=8))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_window_shorter_than_the_tile(dtype):
    """A 16-token tile with a window of 2 and 8 keys per step, no sinks: the tile's later rows
    see no key in its first steps (their running max stays -inf there) and must not turn NaN."""
    case = make(SMALL, hq=4, hkv=2, d=16, dtype=DTYPES[dtype], window=2, seed=9)
    out = case.run(block_m=16, block_n=8)
    assert torch.isfinite(out).all()
    case.check(out)


@pytest.mark.parametrize("d", [80, 64])
def test_default_tiles_block_size_16_and_head_dims(d):
    """The defaults (``prefill_config``) at block size 16: contexts of 13 and 17 blocks, a 150-
    token chunk over several default tiles (fp32 GQA 4:1 at D = 64: 8 tokens per tile), D = 80
    padded to 128 (masked lanes) with a window and sinks."""
    case = make(([(7, 1), (200, 150), (260, 9)], 1), hq=4, hkv=1, d=d, bs=16,
                window=None if d == 64 else 50, use_sinks=d == 80, seed=d)
    assert pp.prefill_tile_m(64, 4, torch.float32) == 8
    case.check(case.run())


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_query_heads_split_over_programs(dtype, heads):
    """GROUP = 6 query heads over cdiv(6, heads) programs (4: rows past the group masked), 3
    tokens per tile (rows = tokens x heads), with sinks and a window, 2 kv heads: the last kv
    head's padding rows must not read or write past Hq."""
    case = make(SMALL, hq=12, hkv=2, d=16, dtype=DTYPES[dtype], window=9, use_sinks=True,
                seed=heads)
    write_kv_cache(case.k, case.v, case.slots, case.cache)
    case.check(pp.paged_prefill(case.q, case.cache, case.block_tables, case.seq_lens,
                                case.query_start_loc, case.scale, window=case.window,
                                sinks=case.sinks, block_m=3, block_n=8, heads=heads))


def test_prefill_config_splits_only_groups_over_the_rows_target():
    """DeepSeek-V2's 128 heads of one kv head at D = 576: one token per tile and 16 heads per
    program, on SM90 and SM120; the GQA shapes keep their whole group."""
    for sm in (90, 120):
        c = pp.prefill_config(576, 128, False, sm)
        assert (c["TILE_M"], c["HEADS"], c["ROWS"]) == (1, 16, 16)
    c = pp.prefill_config(128, 8, False, 90)
    assert (c["TILE_M"], c["HEADS"], c["ROWS"]) == (16, 8, 128)


@pytest.mark.parametrize("block_m", [1, 3, 64])
def test_tiled_equals_per_token_kernel(block_m):
    """The tiled kernel and the per-token kernel (``tiled=False``) within fp32 tolerance, for one
    token per tile, a non-power-of-two tile and a tile longer than every sequence."""
    case = make(SMALL, hq=4, hkv=2, d=16, window=20, use_sinks=True, seed=block_m)
    tiled = case.run(block_m=block_m, block_n=16)
    per_token = case.run(tiled=False, block_n=8)
    case.check(tiled)
    case.check(per_token)
    torch.testing.assert_close(tiled, per_token, atol=1e-5, rtol=1e-5)


def test_work_list_from_host_lists_and_from_the_device():
    """Tiles of up to tile_m tokens of one sequence (written out here by hand); a sequence with
    no query token gets none; building from query_start_loc (padded with T) gives the same."""
    tiles = pp.query_tiles([1, 0, 5, 3], 2, DEVICE)
    assert tiles.seq.tolist() == [0, 2, 2, 2, 3, 3]
    assert tiles.start.tolist() == [0, 1, 3, 5, 6, 8]
    assert tiles.seq.dtype == tiles.start.dtype == torch.int64 and tiles.tile_m == 2
    qsl = torch.tensor([0, 1, 1, 6, 9, 9, 9], device=DEVICE)
    again = pp.query_tiles_from_device(qsl, 9, 2)
    assert torch.equal(again.seq, tiles.seq) and torch.equal(again.start, tiles.start)
    assert pp.query_tiles([], 4, DEVICE).seq.numel() == 0
    skipped = pp.query_tiles([1, 0, 5, 3], 2, DEVICE, skip=1)     # sequence 0 runs elsewhere
    assert skipped.seq.tolist() == [2, 2, 2, 3, 3] and skipped.start.tolist() == [1, 3, 5, 6, 8]
    again = pp.query_tiles_from_device(qsl, 9, 2, skip=1)
    assert torch.equal(again.seq, skipped.seq) and torch.equal(again.start, skipped.start)


def test_work_list_moves_through_the_given_upload():
    """The attention layer passes its platform's upload (which pins only where the platform
    allows: not under WSL); the work list goes through it in one call."""
    calls = []

    def upload(t, device):
        calls.append((t.tolist(), device))
        return t.to(device)
    tiles = pp.query_tiles([1, 0, 5, 3], 2, DEVICE, upload=upload)
    assert calls == [([[0, 2, 2, 2, 3, 3], [0, 1, 3, 5, 6, 8]], torch.device(DEVICE))]
    assert tiles.seq.tolist() == [0, 2, 2, 2, 3, 3]


def test_given_work_list_and_empty_sequences():
    """A precomputed work list is used as given (same bits as the one built from the device, and
    in reverse order: a tile writes its own tokens only, not the padded rows' next tokens), a
    sequence with no query token in the middle writes nothing, and a mismatched tile size is
    refused. GQA 4:2 with 4 tokens per tile: 8 rows padded to 16."""
    case = make(([(6, 1), (9, 0), (30, 12)], 1), seed=3, use_sinks=True)
    tiles = pp.query_tiles([1, 0, 12], 4, DEVICE)
    out = case.run(tiles=tiles, block_m=4, block_n=8)
    case.check(out)
    assert torch.equal(out, case.run(block_m=4, block_n=8))
    flip = torch.arange(tiles.seq.numel() - 1, -1, -1, device=DEVICE)
    backwards = pp.QueryTiles(tiles.seq[flip], tiles.start[flip], 4)
    assert torch.equal(out, case.run(tiles=backwards, block_m=4, block_n=8))
    with pytest.raises(ValueError, match=r"tiles built for tile_m=4, the kernel runs tile_m=5"):
        case.run(tiles=tiles, block_m=5)


def test_backend_builds_the_work_list_once_per_step(monkeypatch):
    """``triton_paged`` passes the metadata's work list (built from query_lens_cpu for the
    default tile size, cached on the metadata: every layer gets the same tensors); a
    decode-only step builds none."""
    from vllm.model_executor.layers.attention.triton_paged import TritonPagedAttention
    import vllm.kernels.triton.paged_attention as pa
    seen = []
    real = pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", lambda *a, **kw: seen.append(kw.get("tiles"))
                        or real(*a, **kw))
    for seqs, decodes in (MIXED, ([(9, 1), (3, 1)], 2)):
        case = make((seqs, decodes), hq=4, hkv=2, d=16, seed=5)
        md = AttentionMetadata(case.slots, case.block_tables, case.seq_lens, case.query_start_loc,
                               [c for c, _ in seqs], [n for _, n in seqs], decodes, 4)
        impl = TritonPagedAttention(4, 16, 2, case.scale)
        for _ in range(2):                                               # two layers
            case.check(impl.forward(case.q, case.k, case.v, case.cache, md))
    mixed_tiles, again, none, none_again = seen
    assert none is None and none_again is None and again is mixed_tiles
    # fp32, D = 16, GQA 2:1: 32 rows, 16 tokens per tile; query lengths 1, 1, 3, 17, 70, 17
    # from token 0, 1, 2, 5, 22, 92, of which the two decodes run the decode kernels (no tiles).
    assert mixed_tiles.tile_m == pp.prefill_tile_m(16, 2, torch.float32) == 16
    assert mixed_tiles.seq.tolist() == [2, 3, 3, 4, 4, 4, 4, 4, 5, 5]
    assert mixed_tiles.start.tolist() == [2, 5, 21, 22, 38, 54, 70, 86, 92, 108]


@pytest.mark.parametrize("opts", ["window5", "sinks"])
def test_decodes_of_a_mixed_step_run_the_decode_kernels(opts):
    """With ``num_decodes`` the step's decodes take the split-context decode kernels: their rows
    are bit for bit those of a decode-only step of the same sequences, the rest is the tiled
    kernel's, and both match the reference."""
    case = make(MIXED, hq=8, hkv=2, d=16, seed=7, **OPTIONS[opts])
    out = case.run(num_decodes=2, block_n=8)
    case.check(out)
    from vllm.kernels.triton.paged_attention import paged_attention
    alone = paged_attention(case.q[:2], case.cache, case.block_tables[:2], case.seq_lens[:2],
                            case.query_start_loc[:3], case.scale, decode_only=True,
                            window=case.window, sinks=case.sinks, block_n=8)
    assert torch.equal(out[:2], alone)
    assert torch.equal(out[2:], case.run(block_n=8)[2:])


def test_bad_work_lists_and_decode_counts_are_refused():
    case = make(SMALL, seed=1)
    tiles = pp.query_tiles([1, 3, 13], 4, DEVICE)
    short = pp.QueryTiles(tiles.seq, tiles.start[:-1], 4)
    with pytest.raises(ValueError, match=r"tiles.seq \(6,\) and tiles.start \(5,\) must have one"):
        case.run(tiles=short, block_m=4)
    with pytest.raises(ValueError, match=r"num_decodes=4 must be in \[0, 3\]"):
        case.run(num_decodes=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "f16", "f32"])
def test_on_cuda_at_model_shapes(dtype):
    """Compiled, at a model's shape: GQA 32:8 (eight kv heads: every program id 1) at D = 128,
    block 16; a long decode, prompts of 257 and 7 tokens after history, a 300-token chunk;
    decodes through the decode kernels and through tiles; window and sinks."""
    seqs = ([(3000, 1), (40, 1), (700, 300), (257, 257), (90, 7)], 2)
    for opts in ({}, dict(window=100, use_sinks=True)):
        case = Case(*seqs, hq=32, hkv=8, d=128, bs=16, dtype=dtype, **opts).to("cuda")
        case.check(case.run(num_decodes=2))
        case.check(case.run())


@pytest.mark.parametrize("d,opts", [(80, "window5"), (96, "sinks"), (192, "window3_sinks"),
                                    (576, "shared_sinks")])
def test_head_dims_split_in_two_tiles(d, opts):
    """Head dims that are not powers of two: 96 = 64 + 32 and 192 = 128 + 64 column tiles, MLA's
    one plane of 576 = 512 + 64 (values = keys), and 80 padded to 128 (``head_split``); fp32,
    GQA 2:1, 5 tokens per tile, 16 keys per step."""
    case = make(([(9, 1), (20, 7)], 1), hq=2, hkv=1, d=d, seed=d, **OPTIONS[opts])
    case.check(case.run(block_m=5, block_n=16))
