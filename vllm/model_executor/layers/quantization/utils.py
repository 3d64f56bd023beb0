"""Bit-level helpers shared by the quantized MoE formats: int4 packing, e2m1 (FP4) codes, e4m3.

Conventions (those of the public checkpoint formats):
  * int4 in int32: 8 values per word, element 8*i + k at bits [4k, 4k + 4) of word i (low first).
  * e2m1 in uint8: 2 values per byte, element 2*i in the low nibble, 2*i + 1 in the high one.
    A code is sign (bit 3) | magnitude index (bits 0-2) into E2M1_VALUES.
  * float8_e4m3fn: finite range +-448; torch's cast does not saturate, so values are clamped first.
"""
from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the 8 non-negative e2m1 codes, index = code & 0b111."""

_INT4_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)   # [8]


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn, saturating at +-448 (the cast alone would give NaN)."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


# ---- int4 <-> int32 --------------------------------------------------------------------------
def pack_int4(q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack integers in [0, 15] along ``dim`` (size divisible by 8) into int32 words."""
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"pack_int4 needs an integer tensor, got {q.dtype}")
    q = q.movedim(dim, -1)
    if q.shape[-1] % 8:
        raise ValueError(f"pack_int4: size {q.shape[-1]} along dim {dim} is not a multiple of 8")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"pack_int4: values must be in [0, 15], got [{int(q.min())}, "
                         f"{int(q.max())}]")
    words = (q.long().reshape(*q.shape[:-1], -1, 8) << _INT4_SHIFTS.to(q.device).long()).sum(-1)
    # Words are unsigned 32-bit patterns; store them as int32 two's complement.
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack_int4(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of ``pack_int4``: int32 words -> int32 values in [0, 15], 8x longer along ``dim``."""
    if p.dtype != torch.int32:
        raise TypeError(f"unpack_int4 needs int32 words, got {p.dtype}")
    p = p.movedim(dim, -1)
    vals = (p.unsqueeze(-1) >> _INT4_SHIFTS.to(p.device)) & 0xF    # [..., C/8, 8]
    return vals.reshape(*p.shape[:-1], -1).movedim(-1, dim)


# ---- e2m1 (FP4) ------------------------------------------------------------------------------
def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] -> float32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to the nearest e2m1 code (uint8).
    Magnitudes beyond 6 saturate to 6; ties go to the smaller magnitude."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    idx = (x.float().abs().unsqueeze(-1) - mags).abs().argmin(-1)        # [..., ] in [0, 7]
    sign = (x < 0) & (idx > 0)                                            # no negative zero
    return (idx + 8 * sign.long()).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., C] codes (C even) -> [..., C/2] uint8, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., C/2] uint8 -> [..., C] codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1 needs uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


# ---- block scales ----------------------------------------------------------------------------
def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int,
                       block_cols: int) -> torch.Tensor:
    """[ceil(rows/br), ceil(cols/bc)] per-block scale -> [rows, cols] (edge blocks cropped)."""
    return (scale.float().repeat_interleave(block_rows, 0)[:rows]
            .repeat_interleave(block_cols, 1)[:, :cols])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
