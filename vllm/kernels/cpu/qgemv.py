"""Quantized matrix products on the CPU that read the schemes' own layouts (``qgemv.c``): what a
GPU machine's CPU runs for the experts it computes from the host store (``moe_expert_cpu_compute``),
decoding each weight in registers instead of dequantizing the expert into a new tensor first."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kernels.cpu.graph import launch

KINDS = {"fp8": 0, "int4": 1}
"""Code layouts ``qgemv`` reads, and the C side's code for each."""


@dataclass(frozen=True)
class QuantRows:
    """One quantized projection W [R, C] (R outputs, C inputs) in its scheme's layout.

    ``codes``: fp8, float8_e4m3fn [R, C]; int4, int32 words [R, C / 8] with column c at bits
    [4 (c % 8), +4) of word c / 8 (GPTQ's packing in the layer's [out, in] orientation).
    ``scales``: float32 [ceil(R / row_div), ceil(C / group)]; element (r, c) of W is scaled by
    scales[r // row_div, c // group] (a tensor scale: one row per ``row_div`` rows and one
    group; per channel: row_div 1; 128 x 128 blocks: both 128; GPTQ groups: row_div 1).
    ``zeros``: int4 only, the packed zero points [ceil(R / 8), groups] int32, row r at bits
    [4 (r % 8), +4) of word r / 8, each plus ``zero_offset``: W = (q - zero) x scale."""
    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    row_div: int
    group: int
    zeros: torch.Tensor | None = None
    zero_offset: int = 0

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.codes.shape[1] * (8 if self.kind == "int4" else 1)

    def check(self) -> None:
        """ValueError naming what does not fit the layout above."""
        def fail(msg: str):
            raise ValueError(f"qgemv {self.kind} weight [{self.rows}, {self.cols}]: {msg}")
        if self.kind not in KINDS:
            raise ValueError(f"qgemv: kind={self.kind!r} is invalid: must be one of {list(KINDS)}")
        want = torch.float8_e4m3fn if self.kind == "fp8" else torch.int32
        if self.codes.dim() != 2 or self.codes.dtype != want or not self.codes.is_contiguous():
            fail(f"codes must be a contiguous 2-D {want} tensor, got {self.codes.dtype} "
                 f"{tuple(self.codes.shape)}")
        if self.row_div < 1 or self.group < 1:
            fail(f"row_div={self.row_div} and group={self.group} must be >= 1")
        if self.kind == "int4" and self.group % 8:
            fail(f"group={self.group} must be a multiple of 8 (a word never straddles groups)")
        shape = (-(-self.rows // self.row_div), -(-self.cols // self.group))
        if (self.scales.dtype != torch.float32 or tuple(self.scales.shape) != shape
                or not self.scales.is_contiguous()):
            fail(f"scales must be contiguous float32 {shape}, got {self.scales.dtype} "
                 f"{tuple(self.scales.shape)}")
        if self.kind == "int4":
            zshape = (-(-self.rows // 8), shape[1])
            z = self.zeros
            if z is None or z.dtype != torch.int32 or tuple(z.shape) != zshape or \
                    not z.is_contiguous():
                fail(f"zeros must be contiguous int32 {zshape}, got "
                     f"{None if z is None else (z.dtype, tuple(z.shape))}")
        elif self.zeros is not None:
            fail("fp8 takes no zero points")
        for name in ("codes", "scales", "zeros"):
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
    rc = launch("qgemv", KINDS[w.kind], codes.data_ptr(), w.scales.data_ptr(),
                None if w.zeros is None else w.zeros.data_ptr(), x.data_ptr(),
                None if xb is None else xb.data_ptr(), y.data_ptr(), T, w.rows, w.cols,
                w.scales.shape[1], w.row_div, w.group, w.zero_offset)
    if rc:
        raise RuntimeError(f"qgemv failed (code {rc}: -2 is out of memory)")
    return y


def bf16_chain() -> bool:
    """Whether bf16 tokens take ``qgemv.c``'s bf16 chain in this build (AVX512-BF16 and VBMI)."""
    return bool(launch("qgemv_bf16_chain"))
