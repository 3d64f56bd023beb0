"""The Triton W8A8 fused-MoE kernels (``vllm/kernels/triton/fused_moe_w8a8.py``) against plain
references written here: the activation quantizer from its formula (amax / 448 per row and
group, codes e4m3(clamp(x / scale)), or a static scale), and the MoE as a loop over each
token's choices on dequantized operands in float64: the input rows quantized and dequantized,
the FP8 weights of fp8.py's layouts (built by test_fused_moe_quant.fp8_projection from their
definition), gate-up and the activation rounded to the activation dtype as the kernels store
them, the activation's rows quantized again before the down projection.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py);
its e4m3 ``tl.dot`` is exact there, so bf16 models are checked too (both operands are e4m3).
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module
from test_fused_moe import (ALPHA, LIMIT, act_ref, check_skipped_pairs_and_waves,
                            subset_slot_ids)
from test_fused_moe_quant import fp8_projection

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)
E4M3_MAX = 448.0


@pytest.fixture(scope="module")
def wm():
    return triton_module("fused_moe_w8a8")


# ---- references ----------------------------------------------------------------------------
def quant_rows_ref(x, kind, group=0, static=None):
    """x [M, K] -> (e4m3 codes [M, K], float32 scales [M, S]) from the formula."""
    x = x.float()
    M, K = x.shape
    width = group if kind == "group" and group < K else K
    cols = [(s, min(s + width, K)) for s in range(0, K, width)]
    scales = torch.empty(M, len(cols))
    codes = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    for j, (a, b) in enumerate(cols):
        if kind == "tensor":
            s = static.float().reshape(1).expand(M)
        else:
            s = x[:, a:b].abs().amax(dim=1).clamp(min=1e-10) / E4M3_MAX
        scales[:, j] = s
        codes[:, a:b] = (x[:, a:b] / s[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(codes.dtype)
    return codes, scales, width


def dequant_rows(x, kind, group=0, static=None):
    codes, scales, width = quant_rows_ref(x.cpu(), kind, group,
                                          None if static is None else static.cpu())
    cols = torch.arange(x.shape[1]) // width
    return (codes.double() * scales.double()[:, cols]).to(x.device)


def moe_ref(x, d13, d2, topk_w, ids, i13, i2, activation="silu", b13=None, b2=None):
    """float64 pairs [T, K, H]; pairs with ids outside [0, G) NaN. i13 / i2: (kind, group,
    static scale) of each projection's input rows."""
    T, K = ids.shape
    G, H = d2.shape[:2]
    xd = dequant_rows(x, *i13)                                         # [T, H]
    out = torch.full((T, K, H), float("nan"), dtype=torch.float64, device=x.device)
    for k in range(K):
        e = ids[:, k]
        ok = (e >= 0) & (e < G)
        e = e.clamp(0, G - 1)
        h = torch.einsum("th,tnh->tn", xd, d13[e].double())
        h = h + b13.double()[e] if b13 is not None else h
        a = act_ref(h.to(x.dtype).float(), activation).to(x.dtype)     # stored as the kernels do
        y = torch.einsum("tn,thn->th", dequant_rows(a, *i2), d2[e].double())
        y = (y + b2.double()[e] if b2 is not None else y) * topk_w[:, k, None].double()
        out[:, k] = torch.where(ok[:, None], y, out[:, k])
    return out


# ---- inputs --------------------------------------------------------------------------------
INPUTS = {"token": ("token", 0), "group32": ("group", 32), "tensor": ("tensor", 0)}


def make(wm, strategy, block, inputs, T, E, K, H, N, dtype, G=None, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    G = G or E
    p13, d13 = fp8_projection(g, G, 2 * N, H, N, strategy, block)
    p2, d2 = fp8_projection(g, G, H, N, H, strategy, block)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    w = torch.rand(T, K, generator=g)
    b13 = (torch.randn(G, 2 * N, generator=g) * 0.5).to(dtype) if bias else None
    b2 = (torch.randn(G, H, generator=g) * 0.5).to(dtype) if bias else None
    kind, group = INPUTS[inputs]
    # Static scales as a calibration would give: amax / 448 over typical inputs.
    statics = (torch.tensor([4.0 / E4M3_MAX]), torch.tensor([0.5 / E4M3_MAX]))
    dev = lambda t: None if t is None else t.to(DEVICE)               # noqa: E731
    projs, refs = [], []
    for p, static in zip((p13, p2), statics):
        static = static if kind == "tensor" else None
        weight = wm.QuantProjection(**{k: dev(v) if torch.is_tensor(v) else v
                                       for k, v in p.items()})
        projs.append(wm.W8A8Projection(weight, wm.InputQuant(kind, group, dev(static))))
        refs.append((kind, group, static))
    return (dev(x), projs, [dev(d13), dev(d2)], dev(w), dev(ids), dev(b13), dev(b2), refs)


def check(wm, strategy, block, inputs, T, E, K, H, N, dtype=torch.float32, config=SMALL,
          activation="silu", bias=False, seed=0):
    x, (p13, p2), (d13, d2), w, ids, b13, b2, (i13, i2) = make(
        wm, strategy, block, inputs, T, E, K, H, N, dtype, seed=seed, bias=bias)
    out = torch.zeros(T, K, H, dtype=dtype, device=DEVICE)
    wm.fused_moe_w8a8_pairs(x, p13, p2, w, ids, out, activation, ALPHA, LIMIT, b13, b2,
                            config=config)
    want = moe_ref(x, d13, d2, w, ids, i13, i2, activation, b13, b2)
    assert_close_but_flips(out, want, {torch.float32: 2e-3, torch.float16: 2e-2,
                                       torch.bfloat16: 6e-2}[dtype])


def assert_close_but_flips(got, want, tol):
    """Within ``tol``, except where an activation's code flipped. The kernel's fp32 gate-up and
    act (a GPU's exp and division approximate) and the float64 reference's differ in the last
    bits, so a stored activation may be one ulp of its dtype off the reference's: near the
    midpoint of two e4m3 values its code moves one step; as its group's amax it moves the
    group's scale, and any code of the group near a midpoint with it. Either moves one pair's
    output row (one e4m3 step, up to 1/8 of the group's amax, over the row's weights). Input
    rows x are quantized bit for bit as here (``test_codes_on_e4m3_ties``), so no flip moves
    all K rows of a token (one x code off at a tie put 33 of 4096 outputs past tol at the first
    fp16 test_compiled_on_cuda shape on an H100). Rare otherwise: with every gate-up and act
    value that lies within 8 fp32 ulps (of the sum of |terms|, for gate-up) of a dtype
    midpoint rounded the other way, the test_compiled_on_cuda shapes put at most 3e-5 of the
    outputs past tol (in 13 pair rows of 24,579), none past 4.7 tol: allowed, at most 0.1%
    past tol, none past 8."""
    got, want = got.double(), want.double()
    off = ~torch.isclose(got, want, atol=tol, rtol=tol)
    rows = int(off.reshape(-1, off.shape[-1]).any(-1).sum())
    assert off.double().mean().item() <= 1e-3, \
        f"{int(off.sum())} of {off.numel()} off, in {rows} pair rows"
    torch.testing.assert_close(got, want, atol=8 * tol, rtol=8 * tol)


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind,group", [("token", 0), ("group", 32), ("group", 48)])
def test_quantize_rows_matches_the_formula(wm, kind, group, dtype):
    """Bitwise: codes and scales of dynamic rows (K = 100: a partial group; a zero row)."""
    g = torch.Generator().manual_seed(group)
    x = (torch.randn(6, 100, generator=g) * 3).to(dtype)
    x[2] = 0
    got_q, got_s = wm.quantize_rows(x.to(DEVICE), wm.InputQuant(kind, group))
    want_q, want_s, _ = quant_rows_ref(x, kind, group)
    assert torch.equal(got_s.cpu(), want_s)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert not got_q[2].float().any()


# x / scale lands exactly on the midpoint of two e4m3 values (amax 2.625: scale 0.005859375,
# not a power of two); ties go to the even code. An approximate quotient or scale (a GPU's
# ``/``: div.full.f32, amax times an approximate 1 / 448) lands one ulp off and rounds the
# other way: 1.078125 -> 183.99998 -> 176, not 192.
TIE_AMAX, TIES = 2.625, (1.078125, -1.265625, 1.453125)


def e4m3_ties(x, width):
    """How many x / scale (the formula's float32 scales) are exactly an e4m3 midpoint."""
    _, scales, _ = quant_rows_ref(x, "group", width)
    q = x.double() / scales.double()[:, torch.arange(x.shape[1]) // width]
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    return int(torch.isin(q.abs(), (grid[1:] + grid[:-1]) / 2).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind,group", [("token", 0), ("group", 32)])
def test_codes_on_e4m3_ties(wm, kind, group, dtype):
    """Codes whose quotient is an exact e4m3 tie, and their scales, bit for bit (IEEE
    division: tl.div_rn)."""
    x = torch.zeros(2, 40)
    x[0, :4] = torch.tensor((TIE_AMAX,) + TIES)
    x[1, 33:37] = -x[0, :4]                         # a second group; negated
    x = x.to(dtype)
    assert e4m3_ties(x, 32) == 2 * len(TIES)
    got_q, got_s = wm.quantize_rows(x.to(DEVICE), wm.InputQuant(kind, group))
    want_q, want_s, _ = quant_rows_ref(x, kind, group)
    assert torch.equal(got_s.cpu(), want_s)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert got_q[0, 1].float().item() == 192.0


def test_quantize_rows_static_and_long_rows(wm):
    """A static scale clamps at +-448; a row longer than one 1024-column chunk (two passes)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2500, generator=g) * 2
    x[0, 7] = 1e4                                         # past 448 * scale: clamped
    static = torch.tensor([0.01])
    got_q, got_s = wm.quantize_rows(x.to(DEVICE), wm.InputQuant("tensor", 0, static.to(DEVICE)))
    want_q, want_s, _ = quant_rows_ref(x, "tensor", 0, static)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s.cpu(), want_s) and got_q[0, 7].float().item() == E4M3_MAX
    got_q, got_s = wm.quantize_rows(x.to(DEVICE), wm.InputQuant("token"))
    want_q, want_s, _ = quant_rows_ref(x, "token")
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s.cpu(), want_s)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,group", [("token", 0), ("group", 32), ("tensor", 0)])
def test_activation_quant_is_the_activation_then_quantize_rows(wm, activation, dtype, kind,
                                                               group, block_m):
    """One launch (``activation_quant``) gives, on the wave's pair rows, the bits of the
    activation kernel's output quantized by ``quantize_rows``: the same act, rounded to the
    gate-up dtype, then the same quantizer (M blocks of 64: slabs of 16 rows, about 20 pairs
    per slot)."""
    from vllm.kernels.triton.fused_moe import _activation, moe_align_block_size
    g = torch.Generator().manual_seed(group + len(activation))
    T, K, G, N = 60, 2, 5, 80                      # N = 80: partial chunks and groups
    ids = torch.randint(-1, G, (T, K), generator=g).to(DEVICE)
    align = moe_align_block_size(ids, block_m, G)
    gate_up = (torch.randn(T * K, 2 * N, generator=g) * 3).to(dtype).to(DEVICE)
    iq = wm.InputQuant(kind, group, torch.tensor([0.02], device=DEVICE) if kind == "tensor"
                       else None)
    got_q, got_s = wm.activation_quant(gate_up, align, activation, ALPHA, LIMIT, block_m, iq,
                                       N)
    act = gate_up.new_empty(T * K, N)
    _activation(gate_up, act, align, activation, ALPHA, LIMIT, block_m)
    want_q, want_s = wm.quantize_rows(act, iq)
    rows = (ids.reshape(-1) >= 0).nonzero().squeeze(1)            # the pairs' rows only
    assert rows.numel() > 0
    assert torch.equal(got_s[rows], want_s[rows])
    assert torch.equal(got_q[rows].view(torch.uint8), want_q[rows].view(torch.uint8))


STRATEGIES = {"tensor": ("tensor", None), "channel": ("channel", None),
              "block16x32": ("block", (16, 32)), "block32x64": ("block", (32, 64)),
              "block128": ("block", (128, 128))}


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_each_weight_strategy_and_input_scheme(wm, strategy, inputs):
    # H = 80, N = 48: partial K tiles and partial input groups; block128 has one scale column
    # (scaled once at the end with token / tensor inputs).
    check(wm, *STRATEGIES[strategy], inputs, 19, 7, 3, 80, 48, seed=len(strategy + inputs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(wm, dtype):
    check(wm, "block", (32, 64), "group32", 13, 5, 2, 64, 64, dtype, bias=True)


def test_biased_swigluoai_and_gelu(wm):
    for activation in ("swigluoai", "gelu"):
        check(wm, "channel", None, "token", 11, 5, 2, 64, 32, activation=activation,
              bias=True)


@pytest.mark.parametrize("T", [8191, 8192, 8193])
def test_around_8192_tokens(wm, T):
    """The seed's crash shape (int32 index math); tiny H and N keep the interpreter quick."""
    cfg = dict(SMALL, BLOCK_M=64, BLOCK_K=32)
    check(wm, "channel", None, "token", T, 5, 2, 32, 32, config=cfg, seed=T)


def test_slot_ids_over_a_subset_and_waves(wm):
    """G = 9 slots, ids use three (each slot's own codes and scales); -1 and ids >= G are
    skipped, their rows of out untouched; two waves (grids sized by ``max_ids``) equal one
    call bit for bit."""
    T, K, H, N, G = 23, 2, 64, 32, 9
    x, (p13, p2), (d13, d2), w, _, b13, b2, (i13, i2) = make(
        wm, "block", (16, 32), "group32", T, G, K, H, N, torch.float32, G=G, bias=True)
    ids = subset_slot_ids(T, K, G)

    def run(ids, out, max_ids):
        wm.fused_moe_w8a8_pairs(x, p13, p2, w, ids, out, "silu", ALPHA, LIMIT, b13, b2,
                                config=SMALL, max_ids=max_ids)
    check_skipped_pairs_and_waves(run, ids, moe_ref(x, d13, d2, w, ids, i13, i2, "silu", b13, b2),
                                  G, lambda got, want: assert_close_but_flips(got, want, 2e-3))


def test_refusals(wm):
    from dataclasses import replace
    x, (p13, p2), _, w, ids, _, _, _ = make(wm, "block", (16, 24), "token", 4, 4, 2, 64, 48,
                                            torch.float32)
    assert "need a K block of at least 32" in wm.w8a8_refusal(p13.weight, p2.weight,
                                                               p13.inputs, p2.inputs)
    out = torch.zeros(4, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="block width 24"):
        wm.fused_moe_w8a8_pairs(x, p13, p2, w, ids, out)
    with pytest.raises(ValueError, match="group 16"):       # group 16 < the 32 of an fp8 MMA
        tok = make(wm, "channel", None, "token", 4, 4, 2, 64, 48, torch.float32)[1]
        wm.fused_moe_w8a8_pairs(x, tok[0], replace(tok[1], inputs=wm.InputQuant("group", 16)),
                                w, ids, out)
    assert not out.any()
    for args, msg in ((("int8",), "kind='int8' is invalid"), (("group",), "group=0"),
                      (("tensor",), "one value exactly for 'tensor'"),
                      (("token", 0, torch.ones(2)), "one value exactly")):
        with pytest.raises(ValueError, match=msg):
            wm.InputQuant(*args)


@pytest.mark.gpu
def test_quantizer_compiled_on_cuda():
    """The hardware's e4m3 cast (cvt.rn.satfinite) gives the formula's codes bit for bit: the
    interpreter's tests round to the e4m3 grid in the kernel first (ROUND_FIRST), this one
    does not. Scales and codes are IEEE quotients (tl.div_rn), exact ties included (random
    bf16 rows hold some; row 6 holds TIES)."""
    from vllm.kernels.triton import fused_moe_w8a8 as wm
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 2500, generator=g) * 3
    x[3] = 0
    x[5, 9] = 1e4
    x[6] = 0
    x[6, :4] = torch.tensor((TIE_AMAX,) + TIES)
    assert e4m3_ties(x.to(torch.bfloat16), 48) >= len(TIES)
    for kind, group in (("token", 0), ("group", 128), ("group", 48)):
        got_q, got_s = wm.quantize_rows(x.to(DEVICE, torch.bfloat16), wm.InputQuant(kind, group))
        want_q, want_s, _ = quant_rows_ref(x.to(torch.bfloat16), kind, group)
        assert torch.equal(got_s.cpu(), want_s), kind
        assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8)), kind


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy,inputs", [("block128", "group32"), ("channel", "token"),
                                             ("tensor", "tensor"), ("block128", "token")])
def test_compiled_on_cuda(strategy, inputs, dtype):
    """The compiled kernels on the GPU at model-like shapes and the default block sizes."""
    from vllm.kernels.triton import fused_moe_w8a8 as wm
    for T, E, K, H, N in [(1, 64, 8, 512, 256), (77, 64, 8, 512, 256), (8193, 7, 3, 128, 64)]:
        check(wm, *STRATEGIES[strategy], inputs, T, E, K, H, N, dtype, config=None, seed=T)
