"""``exp12``: bf16 experts in 12 bits per weight over the host link, losslessly, so a miss moves
three quarters of its bytes and the slot still receives the exact bf16 values.

Why it pays: a bf16 weight is 1 sign, 8 exponent and 7 mantissa bits, and trained weights use
few exponents: within 128 consecutive weights nearly all lie within 13 of the largest. This
format takes 12.08 bits per weight on the shipped default model's experts (0.755 of bf16; 1.9e-4
of the weights escape) and 12.07 on the offload benchmark's random experts (docs/expert-cache.md
has the commands). DFloat11 (Zhang et al., 2025) reports an exponent entropy of about 2.6 bits
for large LLMs; an entropy code would reach about 11 bits, at the price of a sequential
decode, where this one is a fixed-width code that a GPU decodes in parallel at the link's
speed.

Layout of one expert-indexed tensor [E, ...] (n = elements per expert, a multiple of
``BLOCK`` = 128), every array [E, ...] so an expert is a row of each:
  * ``lo`` [E, n] uint8: sign << 7 | the 7 mantissa bits;
  * ``codes`` [E, n / 2] uint8: a 4-bit exponent code per weight, element 2j in the low nibble
    of byte j: c in 0..13 means exponent = base - c; 14 means exponent 0 (zeros and
    subnormals); 15 is an escape (the weight is in the escape list);
  * ``base`` [E, n / 128] uint8: the largest exponent of each block of 128;
  * ``esc_index`` [E, X] int32 (ascending, -1 past the expert's count) and ``esc_bits`` [E, X]
    int16: the escaped weights' positions and whole bf16 bits (X = the largest count, >= 1).
Inf and NaN (exponent 255) keep their bits like any other value. ``decode`` is the torch
reference of the device kernel (``vllm/kernels/triton/exp12_gather.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm.kernels.cpu.exp12 import Exp12Rows, exp12_encode_expert
from vllm.platforms import native_kernels

BLOCK = 128
ZERO_CODE, ESCAPE = 14, 15
_NAMES = ("lo", "codes", "base", "esc_index", "esc_bits")


@dataclass
class Exp12:
    """One expert-indexed tensor in the exp12 layout (module docstring). A weight [E, R, C]
    indexes as the CPU's misses read it (``TorchExperts``: ``w[e]``, ``shape``, ``dtype``):
    expert e is its planes' rows (``Exp12Rows``), which ``host_experts`` decodes."""
    lo: torch.Tensor
    codes: torch.Tensor
    base: torch.Tensor
    esc_index: torch.Tensor
    esc_bits: torch.Tensor
    shape: tuple[int, ...]
    """The bf16 tensor's shape [E, ...]."""

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in _NAMES)

    @property
    def bytes_per_expert(self) -> int:
        """What one expert's copy reads over the link (its escape rows padded to X)."""
        return sum(p[0].numel() * p.element_size() for p in self.planes)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def __getitem__(self, e: int) -> Exp12Rows:
        return Exp12Rows(*(p[e] for p in self.planes), tuple(self.shape[1:]))


def refusal(t: torch.Tensor) -> str | None:
    """Why ``t`` [E, ...] cannot be stored as exp12, or None."""
    if t.dtype != torch.bfloat16:
        return f"exp12 stores bfloat16 experts only, not {t.dtype}"
    if t.dim() < 2 or t[0].numel() % BLOCK:
        return (f"exp12 needs a multiple of {BLOCK} elements per expert, not shape "
                f"{tuple(t.shape)}")
    return None


def encode(t: torch.Tensor, empty: Callable[..., torch.Tensor] = torch.empty,
           native: bool | None = None) -> Exp12:
    """[E, ...] bf16 (on the host) -> its exp12 layout, one expert at a time (the working memory
    is a few times one expert's). ``empty(shape, dtype)`` allocates the planes (e.g. pinned).
    ``native``: the C encoder (``kernels/cpu/exp12.c``); None = where the CPU kernels are
    built, else the torch version (``_encode_expert``, the same planes). ValueError where
    ``refusal`` says so."""
    why = refusal(t)
    if why is not None:
        raise ValueError(why)
    if native is None:
        native = native_kernels(torch.float32, torch.device("cpu"))
    one = exp12_encode_expert if native else _encode_expert
    E, n = t.shape[0], t[0].numel()
    lo = empty((E, n), dtype=torch.uint8)
    codes = empty((E, n // 2), dtype=torch.uint8)
    base = empty((E, n // BLOCK), dtype=torch.uint8)
    escapes = []
    for e in range(E):
        escapes.append(one(t[e].reshape(-1).contiguous(), lo[e], codes[e], base[e]))
    X = max(1, max(len(i) for i, _ in escapes))
    esc_index = empty((E, X), dtype=torch.int32)
    esc_bits = empty((E, X), dtype=torch.int16)
    esc_index.fill_(-1)
    esc_bits.zero_()
    for e, (idx, bits) in enumerate(escapes):
        esc_index[e, :len(idx)] = idx
        esc_bits[e, :len(idx)] = bits
    return Exp12(lo, codes, base, esc_index, esc_bits, tuple(t.shape))


def _encode_expert(w: torch.Tensor, lo: torch.Tensor, codes: torch.Tensor, base: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's weights into its rows of the planes; returns (escape positions int32,
    their bits int16), ascending. In int16 and uint8 throughout (a quarter of int32's traffic:
    this runs over every expert at load)."""
    bits = w.detach().reshape(-1).contiguous().view(torch.int16)    # [n]
    exp = (bits >> 7) & 0xFF                                        # sign-extended, masked
    top = exp.view(-1, BLOCK).amax(dim=1)                           # [n / 128]
    below = (top.view(-1, 1) - exp.view(-1, BLOCK)).view(-1)        # >= 0
    below.masked_fill_(below > ZERO_CODE - 1, ESCAPE)
    below.masked_fill_(exp == 0, ZERO_CODE)
    code = below.to(torch.uint8)
    lo.copy_((((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8))
    codes.copy_(code[0::2] | (code[1::2] << 4))
    base.copy_(top)
    idx = (code == ESCAPE).nonzero().view(-1)
    return idx.to(torch.int32), bits[idx]


def decode(c: Exp12, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 tensor [E, ...] (or rows ``experts`` of it), bit for bit: the device kernel's
    reference, written as plain torch."""
    sel = (lambda p: p) if experts is None else (lambda p: p[experts])
    lo, codes, base = (sel(p).to(torch.int32) for p in (c.lo, c.codes, c.base))
    esc_index, esc_bits = sel(c.esc_index).long(), sel(c.esc_bits)
    R, n = lo.shape
    code = torch.stack([codes & 15, codes >> 4], dim=2).reshape(R, n)
    exp = torch.where(code == ZERO_CODE, 0, base.repeat_interleave(BLOCK, dim=1) - code)
    bits = ((lo & 0x80) << 8) | (exp.clamp(0, 255) << 7) | (lo & 0x7F)
    out = _int16(bits)
    r, k = (esc_index >= 0).nonzero(as_tuple=True)
    out[r, esc_index[r, k]] = esc_bits[r, k]
    return out.view(torch.bfloat16).reshape(R, *c.shape[1:])


def _int16(bits: torch.Tensor) -> torch.Tensor:
    """Unsigned 16-bit values (int32) -> the int16 with the same bits."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
