"""The Triton FP4 fused-MoE kernels (``vllm/kernels/triton/fused_moe_fp4.py``) against plain
references written here: NVFP4 (ModelOpt: e2m1 pairs low nibble first, e4m3 scale per 16 inputs,
float32 ``weight_scale_2`` per expert and half) and MXFP4 (GPT-OSS ``blocks`` [.., C/32, 16] and
e8m0 ``scales``) experts are packed here from random codes and scale bytes, dequantized from
those definitions in float64 (torch's own e4m3 cast for the scale bytes; not the code under
test, nor the quant methods), and run through test_fused_moe's dense fp32 loop.

Scale bytes cover e4m3 subnormals and zero (and e8m0 0, whose 2^-127 blocks are zero at any
output precision: the decoders are checked on all 256 bytes instead). Without a GPU the kernels run
under Triton's interpreter (the ``triton_interpreter`` fixture) in fp32 and fp16 only: the
interpreter's tl.dot is wrong on bf16 inputs, so bf16 is left to the ``gpu`` test.
"""
from __future__ import annotations

import math

import pytest
import torch
from test_fused_moe import ALPHA, LIMIT, moe_ref

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
WIDE_K = dict(SMALL, BLOCK_K=64)    # fp16: two mxfp4 groups per tile, partial last tile
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@pytest.fixture
def fm(triton_interpreter):
    """The kernel module, interpreted (tests/conftest.py skips where the interpreter is off)."""
    from vllm.kernels.triton import fused_moe_fp4
    return fused_moe_fp4


# ---- the published layouts, from their definitions ------------------------------------------
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., C] codes in [0, 16) -> [..., C/2] uint8: input 2j low nibble, 2j + 1 high."""
    lo, hi = codes[..., 0::2].int(), codes[..., 1::2].int()
    return (lo + 16 * hi).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1, dtype=torch.float64)[(codes % 8).long()]
    return torch.where(codes >= 8, -mag, mag)


def nvfp4_projection(g, G, R, C, halves):
    """Random NVFP4 codes, e4m3 scale bytes (normals, subnormals, zero) and global scales ->
    (Fp4Projection kwargs, dense float64 [G, R, C])."""
    codes = torch.randint(0, 16, (G, R, C), generator=g)
    sbytes = torch.randint(0x20, 0x40, (G, R, C // 16), generator=g)  # 2^-3 .. 1.875
    pick = torch.rand(G, R, C // 16, generator=g)
    sbytes = torch.where(pick < 0.1, torch.randint(1, 8, sbytes.shape, generator=g), sbytes)
    sbytes = torch.where(pick > 0.97, 0, sbytes)                      # subnormal / zero scales
    scales = sbytes.to(torch.uint8).view(torch.float8_e4m3fn)
    # ~unit gain per projection (rms |W| ~ 1 / sqrt(C)): outputs of a few units, the scale the
    # tolerances are for (at 2.4x the gain, bf16 outputs near 60 failed by their own rounding).
    gscale = (torch.rand(G, halves, generator=g) + 0.5) / (2.5 * C ** 0.5)
    per_row = gscale.double().repeat_interleave(R // halves, dim=1)   # [G, R]
    dense = e2m1_values(codes) * (scales.double().repeat_interleave(16, dim=2)
                                  * per_row[..., None])
    return dict(kind="nvfp4", codes=pack_nibbles(codes), scales=scales,
                global_scales=gscale), dense


def mxfp4_projection(g, G, R, C, halves):
    """Random MXFP4 codes packed as GPT-OSS publishes them ([G, R, C/32, 16], viewed as the
    [G, R, C/2] bytes they are) and e8m0 scales (a few 0 = 2^-127) -> (kwargs, dense)."""
    codes = torch.randint(0, 16, (G, R, C), generator=g)
    top = 126 - round(0.5 * math.log2(C))                             # weights ~ 1 / sqrt(C)
    s = torch.randint(top - 3, top + 1, (G, R, C // 32), generator=g)
    s = torch.where(torch.rand(s.shape, generator=g) < 0.05, 0, s).to(torch.uint8)
    blocks = pack_nibbles(codes).reshape(G, R, C // 32, 16)
    dense = e2m1_values(codes) * (2.0 ** (s.double() - 127)).repeat_interleave(32, dim=2)
    return dict(kind="mxfp4", codes=blocks.view(G, R, -1), scales=s), dense


BUILD = {"nvfp4": nvfp4_projection, "mxfp4": mxfp4_projection}


def make(fm, kind, T, E, K, H, N, dtype, G=None, seed=0, bias=False):
    """Inputs, both projections, and their dense weights rounded to ``dtype`` (the kernel
    rounds each dequantized weight to the activation dtype before its products)."""
    g = torch.Generator().manual_seed(seed)
    G = G or E
    p13, d13 = BUILD[kind](g, G, 2 * N, H, 2)
    p2, d2 = BUILD[kind](g, G, H, N, 1)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    w = torch.rand(T, K, generator=g)
    b13 = torch.randn(G, 2 * N, generator=g) * 0.5 if bias else None
    b2 = torch.randn(G, H, generator=g) * 0.5 if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)   # noqa: E731
    proj = [fm.Fp4Projection(**{k: v.to(DEVICE) if torch.is_tensor(v) else v
                                for k, v in p.items()}) for p in (p13, p2)]
    dense = [d.float().to(dtype).float().to(DEVICE) for d in (d13, d2)]
    return cast(x), proj, dense, cast(w), ids.to(DEVICE), cast(b13), cast(b2)


def check(fm, kind, T, E, K, H, N, dtype=torch.float32, config=SMALL, activation="silu",
          bias=False, seed=0):
    x, (p13, p2), (d13, d2), w, ids, b13, b2 = make(fm, kind, T, E, K, H, N, dtype, seed=seed,
                                                    bias=bias)
    got = fm.fused_moe_fp4(x, p13, p2, w, ids, activation, ALPHA, LIMIT, b13, b2,
                           config=config)
    want = moe_ref(x, d13, d2, w, ids, activation, b13, b2).sum(dim=1)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def _decode_kernel(fm):
    """A one-program kernel storing the three byte decoders' values of b [256]. Triton resolves
    a kernel's callees among its module's globals, so they are bound there."""
    import triton
    import triton.language as tl
    global _e2m1, _e4m3, _e8m0
    _e2m1, _e4m3, _e8m0 = fm._e2m1_to_f32, fm._e4m3_to_f32, fm._e8m0_to_f32

    @triton.jit
    def decode(b_ptr, e2m1_ptr, e4m3_ptr, e8m0_ptr):
        i = tl.arange(0, 256)
        b = tl.load(b_ptr + i).to(tl.int32)
        tl.store(e2m1_ptr + i, _e2m1(b & 15))
        tl.store(e4m3_ptr + i, _e4m3(b))
        tl.store(e8m0_ptr + i, _e8m0(b))
    return decode


# ---- tests ---------------------------------------------------------------------------------
def test_byte_decoders_on_every_byte(fm):
    """e2m1 (low nibble), e4m3fn and e8m0 of all 256 bytes, bit for bit (NaN where the
    format has one): against the published tables and torch's own e4m3 cast."""
    b = torch.arange(256).to(torch.uint8).to(DEVICE)
    got = [torch.empty(256, device=DEVICE) for _ in range(3)]
    _decode_kernel(fm)[(1,)](b, *got)
    want = [e2m1_values(b.cpu() & 15).float(), b.cpu().view(torch.float8_e4m3fn).float(),
            torch.tensor([2.0 ** (s - 127) for s in range(255)] + [float("nan")])]
    for g, w in zip(got, want):
        # -0.0 and NaN compared by their bits too (e2m1 code 8, e4m3 0x80, the NaN bytes).
        assert torch.equal(g.cpu().nan_to_num(7.0), w.nan_to_num(7.0))
        assert torch.equal(g.cpu().isnan(), w.isnan()) and torch.equal(g.cpu().signbit(),
                                                                       w.signbit())
    assert want[2][0] > 0 and want[1][1] == 2.0 ** -9        # subnormals, not flushed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,H,N,config", [
    ("nvfp4", 48, 48, SMALL),     # partial K tile; w13's halves meet mid N block (global scale)
    ("mxfp4", 96, 32, WIDE_K),    # two groups per K tile, partial last tile; w2 K = 32 < BLOCK_K
])
def test_each_format(fm, kind, H, N, config, dtype):
    check(fm, kind, 19, 7, 3, H, N, dtype, config=config, seed=H + N)


@pytest.mark.parametrize("T,E,K,H,N,config", [
    (1, 1, 1, 32, 32, None),           # one token, one expert, default block sizes
    (33, 13, 2, 64, 96, SMALL),        # several K, N and grouped M blocks; N > ACT_BLOCK_N
])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_shapes(fm, kind, T, E, K, H, N, config):
    check(fm, kind, T, E, K, H, N, config=config, seed=T + E)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_biased_swigluoai_and_gelu(fm, kind):
    """GPT-OSS's experts are MXFP4 with biases and the clamped swigluoai."""
    for activation in ("swigluoai", "gelu"):
        check(fm, kind, 11, 5, 2, 32, 32, activation=activation, bias=True)


@pytest.mark.parametrize("T,kind,dtype", [(8191, "nvfp4", torch.float32),
                                          (8192, "mxfp4", torch.float16),
                                          (8193, "nvfp4", torch.float16)])
def test_around_8192_tokens(fm, T, kind, dtype):
    """The int32 index bound of the seed's kernels; one scale group keeps the interpreter quick."""
    H = N = fm.FP4_GROUPS[kind]
    check(fm, kind, T, 5, 2, H, N, dtype, config=None, seed=T)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_slot_ids_fewer_slots_than_top_k(fm, kind):
    """The expert cache's contract with 2 slots < top_k = 3: waves load experts into slots
    (codes, scales and global scales travel together) and run with slot ids, -1 elsewhere;
    pairs outside a wave, and ids >= G, keep what was in out. The assembled pairs equal both
    the reference and, bit for bit, one call over all experts."""
    T, E, K, H, N, G = 21, 6, 3, 32, 32, 2
    x, (p13, p2), (d13, d2), w, ids, b13, b2 = make(fm, kind, T, E, K, H, N, torch.float32,
                                                    bias=True)
    one_call = torch.full((T, K, H), 3.0, device=DEVICE)
    fm.fused_moe_fp4_pairs(x, p13, p2, w, ids, one_call, "silu", ALPHA, LIMIT, b13, b2,
                           config=SMALL)
    slot = lambda p, ex: fm.Fp4Projection(p.kind, p.codes[ex], p.scales[ex],   # noqa: E731
                                          None if p.global_scales is None
                                          else p.global_scales[ex])
    waves = torch.full((T, K, H), 3.0, device=DEVICE)
    for experts in ([4, 1], [0], [5, 2], [3]):              # slot s holds experts[s]
        ex = torch.tensor(experts, device=DEVICE)
        sid = torch.full((E,), -1, device=DEVICE).index_put_((ex,), torch.arange(len(ex),
                                                                                 device=DEVICE))
        fm.fused_moe_fp4_pairs(x, slot(p13, ex), slot(p2, ex), w, sid[ids], waves, "silu",
                               ALPHA, LIMIT, b13[ex], b2[ex], config=SMALL)
    want = moe_ref(x, d13, d2, w, ids, "silu", b13, b2)
    torch.testing.assert_close(waves, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(waves, one_call)
    skipped = torch.full((T, K, H), 3.0, device=DEVICE)
    ex = torch.tensor([0, 1], device=DEVICE)
    fm.fused_moe_fp4_pairs(x, slot(p13, ex), slot(p2, ex), w, torch.full_like(ids, G),
                           skipped, "silu", ALPHA, LIMIT, b13[ex], b2[ex], config=SMALL)
    assert torch.equal(skipped, torch.full_like(skipped, 3.0))


def test_rejects_bad_inputs(fm):
    from dataclasses import replace
    x, (n13, n2), _, w, ids, _, _ = make(fm, "nvfp4", 4, 4, 2, 32, 32, torch.float32)
    m13, m2 = make(fm, "mxfp4", 4, 4, 2, 32, 32, torch.float32)[1]
    out = torch.zeros(4, 2, 32, device=DEVICE)
    bad = [((x, n13, n2, w, ids, out, "relu2_no_mul"), r"the quantized layouts are gated"),
           ((x, replace(n13, codes=n13.codes.int()), n2, w, ids, out),
            r"fused_moe_fp4: w13 codes are .* torch.int32; need torch.uint8"),
           ((x, n13, replace(n2, global_scales=None), w, ids, out),
            r"w2 global_scales are required by nvfp4"),
           ((x, m13, replace(m2, global_scales=n2.global_scales), w, ids, out),
            r"w2 global_scales are required by nvfp4 and absent from mxfp4"),
           ((x, replace(n13, global_scales=n13.global_scales.double()), n2, w, ids, out),
            r"w13 global_scales are \(4, 2\) torch.float64"),
           ((x, m13, replace(m2, scales=m2.scales[..., :0]), w, ids, out),
            r"w2 scales are \(4, 32, 0\) torch.uint8; need torch.uint8 \(4, 32, 1\)"),
           ((x, replace(n13, kind="mxfp4", global_scales=None), n2, w, ids, out),
            r"w13 scales are .* torch.float8_e4m3fn; need torch.uint8"),
           ((x.long(), m13, m2, w, ids, out), r"x must be \[T, H\]")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fm.fused_moe_fp4_pairs(*args)
    with pytest.raises(ValueError, match=r"48 input columns, not a multiple of the mxfp4 "
                                         r"group 32"):
        fm.check_fp4_projection("w13", replace(m13, codes=m13.codes.new_zeros(4, 64, 24)), 64,
                                48, 4, x.device)
    assert not out.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_compiled_on_cuda(kind, dtype):
    """The compiled kernels on the GPU (bf16 included), at model-like shapes and the default
    (untuned) block sizes."""
    from vllm.kernels.triton import fused_moe_fp4 as fm
    for T, E, K, H, N in [(1, 64, 8, 512, 256), (77, 64, 8, 512, 256), (8193, 7, 3, 96, 64)]:
        check(fm, kind, T, E, K, H, N, dtype, config=None, seed=T)
