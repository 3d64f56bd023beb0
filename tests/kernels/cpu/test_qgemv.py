"""The quantized matrix products on the schemes' layouts (``vllm/kernels/cpu/qgemv.c``) against
a dequantize-then-matmul written here (float64), for FP8 e4m3 with tensor, channel and block
scales, GPTQ INT4 with zero points (and act order's g_idx) and FP4 e2m1 with e4m3 block scales and global scales
(NVFP4) or e8m0 scales (MXFP4), in f32 and bf16 tokens (the two chains), at token counts
around the kernel's chunk of 4, odd row counts and columns past the last vector step; the code
decoders exactly, every code."""
from __future__ import annotations

import pytest
import torch

from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.kernels.cpu.qgemv import QuantRows, qgemv

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="CPU kernels not built")
E4M3_NAN = (0x7F, 0xFF)


def e4m3_codes(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 codes, NaN codes replaced by 0."""
    c = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int32)
    for nan in E4M3_NAN:
        c[c == nan] = 0
    return c.to(torch.uint8).view(torch.float8_e4m3fn)


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """int values [R, C] in [0, 15] -> int32 words [R, C / 8], column c at bits 4 (c % 8)."""
    R, C = q.shape
    words = torch.zeros(R, C // 8, dtype=torch.int64)
    for j in range(8):
        words |= q[:, j::8].long() << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(z: torch.Tensor) -> torch.Tensor:
    """[R, G] in [0, 15] -> [ceil(R / 8), G] int32, row r at bits 4 (r % 8) of word r / 8."""
    R, G = z.shape
    padded = torch.zeros(-(-R // 8) * 8, G, dtype=torch.int64)
    padded[:R] = z
    return pack_cols(padded.t().contiguous()).t().contiguous()


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, row_div: int, group: int,
              zero: torch.Tensor | None = None, global_scale: torch.Tensor | None = None
              ) -> torch.Tensor:
    """x [T, C] @ ((w - zero) * scale * global)^T in float64; zero [R, groups]."""
    R, C = w.shape
    r, c = torch.arange(R)[:, None] // row_div, torch.arange(C)[None] // group
    deq = w.double()
    if zero is not None:
        deq = deq - zero.double()[torch.arange(R)[:, None], c]
    deq = deq * scale.double()[r, c]
    if global_scale is not None:
        deq = deq * global_scale.double().repeat_interleave(R // global_scale.numel())[:, None]
    return x.double() @ deq.t()


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1 = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)   # code: sign bit 3


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[R, C] codes in [0, 15] -> uint8 [R, C / 2], column 2i in the low nibble of byte i."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("R,C,row_div,group", [
    (96, 256, 48, 256),      # a tensor scale per half (w13 of a 48-row projection)
    (33, 200, 1, 200),       # per channel; odd rows, columns past the last vector
    (256, 384, 128, 128),    # 128 x 128 blocks
    (70, 300, 32, 64),       # partial last blocks both ways
    (48, 96, 16, 16),        # groups of one vector: each vector scaled before its FMAs
    (40, 96, 8, 32),         # groups narrower than a bf16-chain step: the f32 chain
])
def test_fp8_equals_dequantize_then_matmul(T, R, C, row_div, group, dtype):
    """bf16 tokens: the bf16 chain where the build has it (64-column steps, then the rest of
    each group one column at a time), on the tokens' bf16 values."""
    gen = torch.Generator().manual_seed(R * C + T)
    codes = e4m3_codes(R, C, gen)
    scale = torch.rand(-(-R // row_div), -(-C // group), generator=gen) + 0.1
    x = torch.randn(T, C, generator=gen).to(dtype)
    y = qgemv(x, QuantRows("fp8", codes, scale, row_div, group))
    ref = reference(x, codes.float(), scale, row_div, group)
    assert y.dtype == torch.float32 and y.shape == (T, R)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 4, 6])
@pytest.mark.parametrize("R,C,group,offset", [
    (64, 256, 128, 1),       # GPTQ v1: stored zero - 1
    (37, 136, 8, 0),         # odd rows; group 8: one word, no vector step of either chain
    (48, 520, 520, 0),       # one group over all columns, past the last vector
    (96, 384, 32, 1),
    (40, 160, 16, 1),        # groups of one vector: (q - z) s per vector
])
def test_int4_equals_dequantize_then_matmul(T, R, C, group, offset, dtype):
    gen = torch.Generator().manual_seed(R + C + T)
    G = -(-C // group)
    q = torch.randint(0, 16, (R, C), generator=gen)
    stored = torch.randint(0, 16 - offset, (R, G), generator=gen)
    scale = torch.rand(R, G, generator=gen) * 0.01 + 0.001
    x = torch.randn(T, C, generator=gen).to(dtype)
    y = qgemv(x, QuantRows("int4", pack_cols(q), scale, 1, group, pack_rows(stored), offset))
    ref = reference(x, q.float(), scale, 1, group, stored + offset)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("R,C,group,H", [
    (64, 256, 32, 2),        # 8 groups: one register's permute; gate and up permutations
    (40, 200, 8, 1),         # 25 groups: two registers'; columns past the last vector
    (36, 640, 16, 2),        # 40 groups: a gather; 18 rows a half, so a pair straddles halves
    (30, 96, 96, 3),         # one group; rows in three parts
])
def test_int4_act_order_equals_dequantize_then_matmul(T, R, C, group, H, dtype):
    """GPTQ act order: each column's group from g_idx (a permutation of column // group per
    part of the rows), zero points and scales per lane."""
    gen = torch.Generator().manual_seed(R + C + T + H)
    G = -(-C // group)
    q = torch.randint(0, 16, (R, C), generator=gen)
    stored = torch.randint(0, 15, (R, G), generator=gen)
    scale = torch.rand(R, G, generator=gen) * 0.01 + 0.001
    g_idx = torch.stack([(torch.arange(C) // group)[torch.randperm(C, generator=gen)]
                         for _ in range(H)]).to(torch.int32)
    x = torch.randn(T, C, generator=gen).to(dtype)
    y = qgemv(x, QuantRows("int4", pack_cols(q), scale, 1, group, pack_rows(stored), 1,
                           g_idx=g_idx))
    rows_g = g_idx.long().repeat_interleave(R // H, dim=0)               # [R, C] groups
    r = torch.arange(R)[:, None]
    deq = (q.double() - (stored + 1).double()[r, rows_g]) * scale.double()[r, rows_g]
    ref = x.double() @ deq.t()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_g_idx_out_of_range_is_refused():
    words = torch.zeros(16, 4, dtype=torch.int32)
    zeros = torch.zeros(2, 2, dtype=torch.int32)
    bad = torch.full((1, 32), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"g_idx has values in \[2, 2\], but there are 2 groups"):
        qgemv(torch.zeros(1, 32), QuantRows("int4", words, torch.ones(16, 2), 1, 16, zeros,
                                            g_idx=bad))
    with pytest.raises(ValueError, match="g_idx must be a contiguous int32"):
        qgemv(torch.zeros(1, 32), QuantRows("int4", words, torch.ones(16, 2), 1, 16, zeros,
                                            g_idx=torch.zeros(3, 32, dtype=torch.int32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 7])
@pytest.mark.parametrize("R,C,scheme", [(64, 256, "nvfp4"), (33, 272, "nvfp4"),
                                        (96, 512, "mxfp4"), (35, 224, "mxfp4")])
def test_fp4_equals_dequantize_then_matmul(T, R, C, scheme, dtype):
    """NVFP4: e4m3 scales per 16 columns and a global scale per half of the rows (w13's gate
    and up); MXFP4: e8m0 scales per 32 columns (one bf16-chain step each)."""
    gen = torch.Generator().manual_seed(R + C + T)
    q = torch.randint(0, 16, (R, C), generator=gen)
    x = torch.randn(T, C, generator=gen).to(dtype)
    if scheme == "nvfp4":
        group = 16
        scale = e4m3_codes(R, C // group, gen)
        scale_value = scale.float().abs() + 0.0                     # |scale|, NaN-free
        scale = scale_value.to(torch.float8_e4m3fn)
        glob = torch.rand(2 if R % 2 == 0 else 1, generator=gen) + 0.5     # w13's, w2's
        w = QuantRows("fp4", pack_nibbles(q), scale, 1, group, global_scales=glob)
        ref = reference(x, E2M1[q], scale.float(), 1, group, global_scale=glob)
    else:
        group = 32
        exps = torch.randint(110, 140, (R, C // group), generator=gen)
        w = QuantRows("fp4", pack_nibbles(q), exps.to(torch.uint8), 1, group)
        ref = reference(x, E2M1[q], 2.0 ** (exps.double() - 127), 1, group)
    y = qgemv(x, w)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_e2m1_code_and_scale_byte_decodes_exactly(dtype):
    """One-hot tokens on one row of all 16 codes 34 times (bf16-chain steps, then 16 columns
    one by one): each output is one code times its block's scale. e8m0 bytes 0 (2^-127, an f32
    subnormal), 1, 127 and 254; e4m3 scale bytes through torch's value of them."""
    q = (torch.arange(544) % 16)[None]
    x = torch.eye(544, dtype=dtype)
    exps = torch.tensor([[0, 1, 127, 254] * 4 + [127]], dtype=torch.uint8)      # 17 blocks of 32
    y = qgemv(x, QuantRows("fp4", pack_nibbles(q), exps, 1, 32))
    want = E2M1[q[0]] * (2.0 ** (exps[0].double() - 127)).repeat_interleave(32)
    assert torch.equal(y[:, 0].double(), want.float().double())
    scales = torch.tensor([[0.5, 448.0, 2.0 ** -9, -3.0] * 8 + [1.0, 1.0]]).to(torch.float8_e4m3fn)
    y = qgemv(x, QuantRows("fp4", pack_nibbles(q), scales, 1, 16))
    assert torch.equal(y[:, 0], (E2M1[q[0]] * scales[0].double().repeat_interleave(16)).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_e4m3_code_decodes_exactly(dtype):
    """One row of all 254 non-NaN codes and 6 more (both chains' vector steps, then columns one
    by one), read by one-hot tokens: each output is one code times 1, which must be torch's
    value of it."""
    codes = torch.tensor([c for c in range(256) if c not in E4M3_NAN] + [1, 8, 0x80, 0x81, 0x7E,
                                                                        0xFE],
                         dtype=torch.uint8)
    C = codes.numel()
    w = codes.view(torch.float8_e4m3fn)[None].contiguous()
    y = qgemv(torch.eye(C, dtype=dtype), QuantRows("fp8", w, torch.ones(1, 1), 1, C))
    assert torch.equal(y[:, 0], w[0].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_int4_code_decodes_exactly(dtype):
    q = torch.arange(136) % 16           # vector steps of both chains, then one word
    zero = pack_rows(torch.zeros(1, 1, dtype=torch.int64))
    y = qgemv(torch.eye(136, dtype=dtype), QuantRows("int4", pack_cols(q[None]), torch.ones(1, 1),
                                                     1, 136, zero, 0))
    assert torch.equal(y[:, 0], q.float())


def test_no_tokens():
    w = QuantRows("fp8", torch.zeros(16, 64, dtype=torch.float8_e4m3fn), torch.ones(16, 1), 1, 64)
    assert qgemv(torch.zeros(0, 64, dtype=torch.bfloat16), w).shape == (0, 16)


@pytest.mark.parametrize("bad,match", [
    (dict(kind="int8"), "kind='int8' is invalid"),
    (dict(codes=torch.zeros(4, 8, dtype=torch.int32)), "float8_e4m3fn"),
    (dict(scales=torch.ones(4, 2)), r"scales must be contiguous \(4, 1\)"),
    (dict(scales=torch.ones(4, 1, dtype=torch.float16)), "float16"),
    (dict(global_scales=torch.ones(3)), "global_scales must be contiguous float32 \\[Rg\\]"),
    (dict(group=0), "must be >= 1"),
    (dict(zeros=torch.zeros(1, 1, dtype=torch.int32)), "fp8 takes no zero points"),
    (dict(kind="fp4", codes=torch.zeros(4, 4, dtype=torch.int32)), "contiguous 2-D torch.uint8"),
])
def test_fp8_layout_refusals_name_the_value(bad, match):
    fields = dict(kind="fp8", codes=torch.zeros(4, 8, dtype=torch.float8_e4m3fn),
                  scales=torch.ones(4, 1), row_div=1, group=8)
    with pytest.raises(ValueError, match=match):
        qgemv(torch.zeros(1, 8), QuantRows(**{**fields, **bad}))


def test_int4_layout_refusals_name_the_value():
    words = torch.zeros(16, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="group=12 and the columns must be multiples of 8"):
        qgemv(torch.zeros(1, 32), QuantRows("int4", words, torch.ones(16, 3), 1, 12,
                                            torch.zeros(2, 3, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"zeros must be contiguous int32 \(2, 1\)"):
        qgemv(torch.zeros(1, 32), QuantRows("int4", words, torch.ones(16, 1), 1, 32, None))
    with pytest.raises(ValueError, match=r"must be \[T, 32\]"):
        qgemv(torch.zeros(1, 31), QuantRows("int4", words, torch.ones(16, 1), 1, 32,
                                            torch.zeros(2, 1, dtype=torch.int32)))
