"""The Triton quantized fused-MoE kernels (``vllm/kernels/triton/fused_moe_quant.py``) against
plain references written here: FP8 (per tensor, per channel, 2-D blocks) and GPTQ INT4 experts
are built in the quant methods' layer layouts (fp8.py, gptq.py) from random codes and scales,
dequantized by code written from those layout definitions (not the code under test, nor the
quant methods), and run through a dense fp32 loop over each token's top-k choices.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), in fp32 and fp16 only: the interpreter's tl.dot is wrong on bf16 inputs, so
bf16 is checked by the ``gpu`` test on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module
from test_fused_moe import (ALPHA, LIMIT, act_ref, check_skipped_pairs_and_waves, close_1e4,
                            subset_slot_ids)

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.fixture(scope="module")
def qm():
    """The kernel module, compiled on a GPU, else interpreted."""
    return triton_module("fused_moe_quant")


# ---- the layer layouts, from their definitions -----------------------------------------------
def cdiv(a, b):
    return -(-a // b)


def pack_words(q: torch.Tensor, dim: int) -> torch.Tensor:
    """Values in [0, 15] -> int32 words along ``dim``: element 8i + j at bits [4j, 4j + 4)."""
    q = q.movedim(dim, -1).long()
    words = torch.zeros(*q.shape[:-1], q.shape[-1] // 8, dtype=torch.long)
    for j in range(8):
        words |= q[..., j::8] << (4 * j)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).movedim(-1, dim)


def fp8_projection(g, G, R, C, half, strategy, block):
    """Random e4m3 codes [G, R, C] and float32 scales in fp8.py's layout for a projection of
    ``R // half`` halves -> (QuantProjection kwargs, dense float32 weights [G, R, C])."""
    codes = (torch.randn(G, R, C, generator=g) * 16).to(torch.float8_e4m3fn)
    halves = R // half
    r, c = torch.arange(R), torch.arange(C)
    unit = 1 / (16 * C ** 0.5)
    if strategy == "tensor":                          # [G, halves]: one per half
        scales = (torch.rand(G, halves, generator=g) + 0.5) * unit
        dense = codes.float() * scales[:, r // half, None]
        kw = dict(scales=scales.unsqueeze(-1), half_rows=half, block_out=half, block_in=C)
    elif strategy == "channel":                       # [G, R, 1]: one per output row
        scales = (torch.rand(G, R, 1, generator=g) + 0.5) * unit
        dense = codes.float() * scales
        kw = dict(scales=scales, half_rows=R, block_in=C)
    else:                                             # [G, halves * nb, cb]: 2-D blocks
        bo, bi = block
        nb = cdiv(half, bo)                           # block rows per half
        scales = (torch.rand(G, halves * nb, cdiv(C, bi), generator=g) + 0.5) * unit
        dense = torch.empty(G, R, C)
        for row in range(R):
            h, rr = divmod(row, half)
            dense[:, row] = codes[:, row].float() * scales[:, h * nb + rr // bo, c // bi]
        kw = dict(scales=scales, half_rows=half, rows_per_half=nb, block_out=bo, block_in=bi)
    return dict(kind="fp8", codes=codes, **kw), dense


def int4_projection(g, G, R, C, half, group_size, zero_offset, per_tile=False):
    """Random GPTQ values in gptq.py's layer layout (act-order g_idx per half; ``per_tile``:
    contiguous groups, declared through ``group_size``) -> (QuantProjection kwargs, dense
    float32 weights [G, R, C])."""
    halves = R // half
    gs = C if group_size == -1 else group_size
    NG = cdiv(C, gs)
    q = torch.randint(0, 16, (G, R, C), generator=g)
    stored = torch.randint(0, 16 - zero_offset, (G, R, NG), generator=g)
    # ~unit gain per projection (rms |q - zero| ~ 7): outputs of a few units, the scale the
    # tolerances are for (at 1.7x the gain, bf16 outputs near 60 failed by their own rounding).
    scales = ((torch.rand(G, R, NG, generator=g) + 0.5) / (8 * C ** 0.5)).half()
    g_idx = torch.empty(G, halves, C, dtype=torch.int32)
    for e in range(G):
        for h in range(halves):                       # columns in a shuffled group order
            order = torch.arange(C) if per_tile else torch.randperm(C, generator=g)
            g_idx[e, h, order] = (torch.arange(C) // gs).int()
    dense = torch.empty(G, R, C)
    for e in range(G):
        for row in range(R):
            grp = g_idx[e, row // half].long()                        # [C]
            zero = stored[e, row, grp] + zero_offset
            dense[e, row] = (q[e, row] - zero).float() * scales[e, row, grp].float()
    return dict(kind="int4", codes=pack_words(q, 2), scales=scales, zeros=pack_words(stored, 1),
                g_idx=g_idx, zero_offset=zero_offset, half_rows=half,
                group_size=gs if per_tile else 0), dense


def make(qm, kind, T, E, K, H, N, dtype, G=None, seed=0, bias=False, **quant):
    """Inputs, both projections, and their dense weights rounded to ``dtype`` (the kernel
    rounds each dequantized weight to the activation dtype before its products)."""
    g = torch.Generator().manual_seed(seed)
    G = G or E
    build = fp8_projection if kind == "fp8" else int4_projection
    p13, d13 = build(g, G, 2 * N, H, N, **quant)
    p2, d2 = build(g, G, H, N, H, **quant)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    w = torch.rand(T, K, generator=g)
    b13 = torch.randn(G, 2 * N, generator=g) * 0.5 if bias else None
    b2 = torch.randn(G, H, generator=g) * 0.5 if bias else None
    dev = lambda t: None if t is None else t.to(DEVICE)              # noqa: E731
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)   # noqa: E731
    proj = [qm.QuantProjection(**{k: dev(v) if torch.is_tensor(v) else v for k, v in p.items()})
            for p in (p13, p2)]
    dense = [d.to(dtype).float().to(DEVICE) for d in (d13, d2)]
    return cast(x), proj, dense, cast(w), ids.to(DEVICE), cast(b13), cast(b2)


# ---- reference -----------------------------------------------------------------------------


def moe_ref(x, w13, w2, topk_w, ids, activation="silu", b13=None, b2=None):
    """fp32 pairs [T, K, H] from dense weights: topk_w[t, k] * (w2[e] @ act(w13[e] @ x[t] +
    b13[e]) + b2[e]) for 0 <= e = ids[t, k] < G; other pairs NaN."""
    x, topk_w = x.float(), topk_w.float()
    T, K = ids.shape
    G, H = w2.shape[:2]
    out = torch.full((T, K, H), float("nan"), device=x.device)
    for k in range(K):
        e = ids[:, k]
        ok = (e >= 0) & (e < G)
        e = e.clamp(0, G - 1)
        h = torch.einsum("th,tnh->tn", x, w13[e])
        h = h + b13.float()[e] if b13 is not None else h
        y = torch.einsum("tn,thn->th", act_ref(h, activation), w2[e])
        y = (y + b2.float()[e] if b2 is not None else y) * topk_w[:, k, None]
        out[:, k] = torch.where(ok[:, None], y, out[:, k])
    return out


def check(qm, kind, T, E, K, H, N, dtype=torch.float32, config=SMALL, activation="silu",
          bias=False, seed=0, **quant):
    x, (p13, p2), (d13, d2), w, ids, b13, b2 = make(qm, kind, T, E, K, H, N, dtype, seed=seed,
                                                    bias=bias, **quant)
    got = qm.fused_moe_quant(x, p13, p2, w, ids, activation, ALPHA, LIMIT, b13, b2,
                             config=config)
    want = moe_ref(x, d13, d2, w, ids, activation, b13, b2).sum(dim=1)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


FP8 = {"tensor": dict(strategy="tensor", block=None),
       "channel": dict(strategy="channel", block=None),
       "block16x32": dict(strategy="block", block=(16, 32)),    # scale column per K tile
       "block16x24": dict(strategy="block", block=(16, 24)),    # columns gathered per element
       "block128": dict(strategy="block", block=(128, 128))}
INT4 = {"g16-actorder-v1": dict(group_size=16, zero_offset=1),
        "channel-v2": dict(group_size=-1, zero_offset=0),
        "g8-actorder-v2": dict(group_size=8, zero_offset=0),
        "g32-tile-v1": dict(group_size=32, zero_offset=1, per_tile=True),   # 1 group per tile
        "g8-contiguous": dict(group_size=8, zero_offset=0, per_tile=True),  # gathered: 8 < 32
        "channel-tile": dict(group_size=-1, zero_offset=0, per_tile=True)}
SCHEMES = {**{f"fp8-{n}": ("fp8", q) for n, q in FP8.items()},
           **{f"int4-{n}": ("int4", q) for n, q in INT4.items()}}


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_each_scheme(qm, scheme, dtype):
    # H = 40: a partial K block (and a partial 16x32 / 16x24 scale block); N = 24: partial
    # N blocks, and w13's halves start mid-block for block_out 16.
    kind, quant = SCHEMES[scheme]
    check(qm, kind, 19, 7, 3, 40, 24, dtype, seed=len(scheme), **quant)


@pytest.mark.parametrize("T,E,K,H,N,config", [
    (1, 1, 1, 16, 16, None),            # one token, one expert, default block sizes
    (33, 13, 2, 72, 40, SMALL),         # several K, N and grouped M blocks; E = 13
    (70, 3, 2, 48, 80, SMALL),          # N = 80 > the activation's 64 columns
])
@pytest.mark.parametrize("scheme", ["fp8-block16x32", "int4-g16-actorder-v1"])
def test_shapes(qm, scheme, T, E, K, H, N, config):
    kind, quant = SCHEMES[scheme]
    check(qm, kind, T, E, K, H, N, config=config, seed=T + E, **quant)


@pytest.mark.parametrize("scheme", ["fp8-channel", "int4-g8-actorder-v2"])
def test_biased_swigluoai_and_gelu(qm, scheme):
    kind, quant = SCHEMES[scheme]
    for activation in ("swigluoai", "gelu"):
        check(qm, kind, 11, 5, 2, 32, 16, activation=activation, bias=True, **quant)


@pytest.mark.parametrize("scheme", ["fp8-block16x24", "int4-g16-actorder-v1"])
def test_slot_ids_over_a_subset_and_waves(qm, scheme):
    """G = 9 slots, ids use three of them (each slot's own codes AND scales, zero points and
    g_idx); -1 and ids >= G are skipped and their rows of out keep what was there (the expert
    cache's waves); two waves equal one call, with their grids sized for their distinct ids
    (``max_ids``: one slot, then two) as the cache's waves are."""
    kind, quant = SCHEMES[scheme]
    T, K, H, N, G = 23, 2, 32, 16, 9
    x, (p13, p2), (d13, d2), w, _, b13, b2 = make(qm, kind, T, G, K, H, N, torch.float32, G=G,
                                                  bias=True, **quant)
    ids = subset_slot_ids(T, K, G)

    def run(ids, out, max_ids):
        qm.fused_moe_quant_pairs(x, p13, p2, w, ids, out, "silu", ALPHA, LIMIT, b13, b2,
                                 config=SMALL, max_ids=max_ids)
    check_skipped_pairs_and_waves(run, ids, moe_ref(x, d13, d2, w, ids, "silu", b13, b2), G,
                                  close_1e4)


def test_rejects_bad_inputs(qm):
    from dataclasses import replace
    x, (p13, p2), _, w, ids, _, _ = make(qm, "int4", 4, 4, 2, 32, 16, torch.float32,
                                         **INT4["g16-actorder-v1"])
    f13, f2 = make(qm, "fp8", 4, 4, 2, 32, 16, torch.float32, **FP8["block16x32"])[1]
    out = torch.zeros(4, 2, 32, device=DEVICE)
    bad = [((x, p13, p2, w, ids, out, "relu2_no_mul"), r"the quantized layouts are gated"),
           ((x, replace(p13, codes=p13.codes.float()), p2, w, ids, out),
            r"w13 codes are .* torch.float32; need torch.int32"),
           ((x, replace(p13, g_idx=None), p2, w, ids, out), r"int4 needs zeros and g_idx"),
           ((x, p13, replace(p2, zeros=p2.zeros[:, :1]), w, ids, out), r"w2 int4 tensors"),
           ((x, f13, replace(f2, scales=f2.scales[:, :1]), w, ids, out),
            r"w2 scales \(4, 1, 1\) are smaller than the \(2, 1\) blocks"),
           ((x, f13, f2, w, ids, out.half()), r"out must be a contiguous \[T, K, H\]"),
           ((x.long(), f13, f2, w, ids, out), r"x must be \[T, H\]"),
           ((x, replace(p13, group_size=-2), p2, w, ids, out), r"w13 group_size=-2 is invalid"),
           ((x, p13, replace(p2, group_size=4), w, ids, out),
            r"w2 group_size=4 is invalid with scales \(4, 32, 1\)")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            qm.fused_moe_quant_pairs(*args)
    assert not out.any()


@pytest.mark.parametrize("scheme", ["g32-tile-v1", "channel-tile"])
def test_one_group_per_tile_gives_the_gathered_bits(qm, scheme):
    """Contiguous groups declared (``group_size``): each K tile reads one scale and zero per row
    instead of gathering them per column through g_idx; the same values, so the same bits."""
    from dataclasses import replace
    x, (p13, p2), _, w, ids, _, _ = make(qm, "int4", 21, 6, 2, 72, 40, torch.float16, seed=5,
                                         **INT4[scheme])
    assert p13.group_size > 0 and p2.group_size > 0
    tiled = qm.fused_moe_quant(x, p13, p2, w, ids, config=SMALL)
    gathered = qm.fused_moe_quant(x, replace(p13, group_size=0), replace(p2, group_size=0), w,
                                  ids, config=SMALL)
    assert torch.equal(tiled, gathered)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compiled_on_cuda(scheme, dtype):
    """The compiled kernels on the GPU (bf16 included), at model-like shapes and the default
    (untuned) block sizes."""
    from vllm.kernels.triton import fused_moe_quant as qm
    kind, quant = SCHEMES[scheme]
    for T, E, K, H, N in [(1, 64, 8, 512, 256), (77, 64, 8, 512, 256), (8193, 7, 3, 96, 40)]:
        check(qm, kind, T, E, K, H, N, dtype, config=None, seed=T, **quant)
