"""Quantized matrix products on the CPU that read the schemes' own layouts (``qgemv.c``): what a
GPU machine's CPU runs for the experts it computes from the host store (``moe_expert_cpu_compute``),
decoding each weight in registers instead of dequantizing the expert into a new tensor first."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kernels.cpu.graph import launch

KINDS = {"fp8": 0, "int4": 1, "fp4": 2}
"""Code layouts ``qgemv`` reads, and the C side's code for each."""

SCALE_CODES = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.uint8: 2}
"""Scale element types: f32 values, e4m3 bytes (NVFP4), e8m0 bytes 2^(b - 127) (MXFP4)."""


@dataclass(frozen=True)
class QuantRows:
    """One quantized projection W [R, C] (R outputs, C inputs) in its scheme's layout.

    ``codes``: fp8, float8_e4m3fn [R, C]; int4, int32 words [R, C / 8] with column c at bits
    [4 (c % 8), +4) of word c / 8 (GPTQ's packing in the layer's [out, in] orientation); fp4,
    uint8 [R, C / 2] e2m1 pairs, column 2i in the low nibble of byte i (NVFP4, MXFP4).
    ``scales`` [ceil(R / row_div), ceil(C / group)]: element (r, c) of W is scaled by
    scales[r // row_div, c // group] (a tensor scale: one row per ``row_div`` rows and one
    group; per channel: row_div 1; 128 x 128 blocks: both 128; GPTQ groups and FP4 blocks:
    row_div 1), as float32, e4m3 (float8_e4m3fn) or e8m0 bytes (uint8, 2^(b - 127)), times
    ``global_scales`` [Rg] float32 (row r: global_scales[r // (R / Rg)]) when given.
    ``zeros``: int4 only, the packed zero points [ceil(R / 8), groups] int32, row r at bits
    [4 (r % 8), +4) of word r / 8, each plus ``zero_offset``: W = (q - zero) x scale.
    ``g_idx``: int4 only, int32 [H, C], the group of each column for the rows of each of H
    equal parts (GPTQ act order: w13's gate and up halves); then ``group`` only sizes the
    scales (ceil(C / group) groups) and the column groups come from g_idx."""
    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    row_div: int
    group: int
    zeros: torch.Tensor | None = None
    zero_offset: int = 0
    global_scales: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.codes.shape[1] * {"fp8": 1, "int4": 8, "fp4": 2}.get(self.kind, 1)

    def check(self) -> None:
        """ValueError naming what does not fit the layout above."""
        def fail(msg: str):
            raise ValueError(f"qgemv {self.kind} weight [{self.rows}, {self.cols}]: {msg}")
        if self.kind not in KINDS:
            raise ValueError(f"qgemv: kind={self.kind!r} is invalid: must be one of {list(KINDS)}")
        want = {"fp8": torch.float8_e4m3fn, "int4": torch.int32, "fp4": torch.uint8}[self.kind]
        if self.codes.dim() != 2 or self.codes.dtype != want or not self.codes.is_contiguous():
            fail(f"codes must be a contiguous 2-D {want} tensor, got {self.codes.dtype} "
                 f"{tuple(self.codes.shape)}")
        if self.row_div < 1 or self.group < 1:
            fail(f"row_div={self.row_div} and group={self.group} must be >= 1")
        if self.kind != "fp8" and (self.group % 8 or self.cols % 8):
            fail(f"group={self.group} and the columns must be multiples of 8 (4-bit codes are "
                 "read 8 at a time, never across groups)")
        shape = (-(-self.rows // self.row_div), -(-self.cols // self.group))
        if (self.scales.dtype not in SCALE_CODES or tuple(self.scales.shape) != shape
                or not self.scales.is_contiguous()):
            fail(f"scales must be contiguous {shape} of float32, float8_e4m3fn or uint8 "
                 f"(e8m0), got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.kind == "int4":
            zshape = (-(-self.rows // 8), shape[1])
            z = self.zeros
            if z is None or z.dtype != torch.int32 or tuple(z.shape) != zshape or \
                    not z.is_contiguous():
                fail(f"zeros must be contiguous int32 {zshape}, got "
                     f"{None if z is None else (z.dtype, tuple(z.shape))}")
        elif self.zeros is not None:
            fail(f"{self.kind} takes no zero points")
        g = self.global_scales
        if g is not None and (g.dtype != torch.float32 or g.dim() != 1 or not g.numel()
                              or self.rows % g.numel() or not g.is_contiguous()):
            fail(f"global_scales must be contiguous float32 [Rg] with Rg dividing {self.rows}, "
                 f"got {g.dtype} {tuple(g.shape)}")
        gi = self.g_idx
        if gi is not None:
            if self.kind != "int4" or gi.dtype != torch.int32 or gi.dim() != 2 or \
                    gi.shape[1] != self.cols or not gi.shape[0] or self.rows % gi.shape[0] or \
                    not gi.is_contiguous():
                fail(f"g_idx must be a contiguous int32 [H, {self.cols}] with H dividing "
                     f"{self.rows}, for int4, got {gi.dtype} {tuple(gi.shape)}")
            if gi.numel() and (int(gi.min()) < 0 or int(gi.max()) >= shape[1]):
                fail(f"g_idx has values in [{int(gi.min())}, {int(gi.max())}], but there are "
                     f"{shape[1]} groups: must be in [0, {shape[1] - 1}]")
        for name in ("codes", "scales", "zeros", "global_scales", "g_idx"):
            t = getattr(self, name)
            if t is not None and t.device.type != "cpu":
                fail(f"{name} is on {t.device}, not the CPU")


def qgemv(x: torch.Tensor, w: QuantRows) -> torch.Tensor:
    """x [T, C] (any float dtype, on the CPU) -> float32 [T, R] = x @ W^T, W decoded in
    registers (``qgemv.c``): exact products, f32 sums per group, scaled once per group. bf16
    tokens take the bf16 chain where the build has one (``bf16_chain``): the same products,
    summed in another order. Needs the CPU kernels (callers ask
    ``vllm.platforms.native_kernels`` first)."""
    w.check()
    if x.dim() != 2 or x.shape[1] != w.cols or x.device.type != "cpu":
        raise ValueError(f"qgemv: x {tuple(x.shape)} on {x.device} must be [T, {w.cols}] on the "
                         "CPU")
    xb = x.contiguous() if x.dtype == torch.bfloat16 else None
    x = x.to(torch.float32).contiguous()
    T = x.shape[0]
    y = torch.empty(T, w.rows, dtype=torch.float32)
    if T == 0 or w.rows == 0:
        return y
    codes = w.codes.view(torch.uint8) if w.kind == "fp8" else w.codes
    scales = w.scales.view(torch.uint8) if w.scales.dtype == torch.float8_e4m3fn else w.scales
    g = w.global_scales
    rc = launch("qgemv", KINDS[w.kind], codes.data_ptr(), scales.data_ptr(),
                SCALE_CODES[w.scales.dtype], None if g is None else g.data_ptr(),
                1 if g is None else w.rows // g.numel(),
                None if w.zeros is None else w.zeros.data_ptr(),
                None if w.g_idx is None else w.g_idx.data_ptr(),
                1 if w.g_idx is None else w.rows // w.g_idx.shape[0], x.data_ptr(),
                None if xb is None else xb.data_ptr(), y.data_ptr(), T, w.rows, w.cols,
                w.scales.shape[1], w.row_div, w.group, w.zero_offset)
    if rc:
        raise RuntimeError(f"qgemv failed (code {rc}: -2 is out of memory)")
    return y


def bf16_chain() -> bool:
    """Whether bf16 tokens take ``qgemv.c``'s bf16 chain in this build (AVX512-BF16 and VBMI)."""
    return bool(launch("qgemv_bf16_chain"))
