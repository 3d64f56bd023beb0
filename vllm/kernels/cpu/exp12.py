"""exp12 in C (``exp12.c``, ``exp12.h``): the encoder (one expert's bf16 weights into its
planes, at load) and the decode of one expert's planes for the CPU's misses
(``expert_cache/link_codec.py`` has the layout and the torch versions they must equal)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from vllm.kernels.cpu.graph import launch


def exp12_encode_expert(w: torch.Tensor, lo: torch.Tensor, codes: torch.Tensor,
                        base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (bf16, contiguous, n weights, n a multiple of 128) into lo [n], codes [n / 2] and
    base [n / 128] (contiguous uint8 CPU rows); returns (escape positions int32, their bits
    int16), ascending. Needs the CPU kernels (``vllm.platforms.native_kernels``)."""
    n = w.numel()
    for t, size in ((lo, n), (codes, n // 2), (base, n // 128)):
        if t.dtype != torch.uint8 or t.numel() != size or not t.is_contiguous() or \
                t.device.type != "cpu":
            raise ValueError(f"exp12_encode: planes must be contiguous uint8 CPU tensors of "
                             f"{n}, {n // 2} and {n // 128} bytes, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if w.dtype != torch.bfloat16 or not w.is_contiguous() or w.device.type != "cpu" or n % 128:
        raise ValueError(f"exp12_encode: w must be a contiguous bf16 CPU tensor of a multiple "
                         f"of 128 weights, got {w.dtype} {tuple(w.shape)} on {w.device}")
    cap = max(1, n // 64)
    while True:
        idx = torch.empty(cap, dtype=torch.int32)
        bits = torch.empty(cap, dtype=torch.int16)
        count = ctypes.c_int64(0)
        rc = launch("exp12_encode", w.data_ptr(), n, lo.data_ptr(), codes.data_ptr(),
                    base.data_ptr(), idx.data_ptr(), bits.data_ptr(), cap,
                    ctypes.addressof(count))
        if rc == 3:                      # more escapes than room: again with room for all
            cap = count.value
            continue
        if rc:
            raise RuntimeError(f"exp12_encode failed (code {rc})")
        return idx[:count.value].clone(), bits[:count.value].clone()


@dataclass(frozen=True)
class Exp12Rows:
    """One expert's bf16 W [R, C] as its exp12 planes (1-D CPU views: ``lo`` [R C], ``codes``
    [R C / 2], ``base`` [R C / 128] uint8, ``esc_index`` int32 and ``esc_bits`` int16 [X], the
    escapes' ascending positions, -1 past the expert's count): what ``gemv16_exp12`` and
    ``exp12_decode`` read."""
    lo: torch.Tensor
    codes: torch.Tensor
    base: torch.Tensor
    esc_index: torch.Tensor
    esc_bits: torch.Tensor
    shape: tuple[int, int]

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def escapes(self) -> int:
        """How many of ``esc_index`` are escapes (the rest is -1 padding)."""
        return int((self.esc_index >= 0).sum())

    def check(self, what: str) -> None:
        """ValueError naming what does not fit the layout above."""
        n = self.shape[0] * self.shape[1]
        sizes = ((self.lo, torch.uint8, n), (self.codes, torch.uint8, n // 2),
                 (self.base, torch.uint8, n // 128),
                 (self.esc_index, torch.int32, self.esc_index.numel()),
                 (self.esc_bits, torch.int16, self.esc_index.numel()))
        if n % 128 or any(t.dtype != dt or t.dim() != 1 or t.numel() != size or
                          not t.is_contiguous() or t.device.type != "cpu"
                          for t, dt, size in sizes):
            raise ValueError(f"{what}: exp12 planes of a {list(self.shape)} weight must be "
                             f"contiguous 1-D CPU tensors: uint8 lo [{n}], codes [{n // 2}], "
                             f"base [{n // 128}], int32 esc_index and int16 esc_bits of one "
                             f"length (n a multiple of 128); got "
                             f"{[(t.dtype, tuple(t.shape)) for t, _, _ in sizes]}")

    def pointers(self) -> tuple:
        return (self.lo.data_ptr(), self.codes.data_ptr(), self.base.data_ptr(),
                self.esc_index.data_ptr(), self.esc_bits.data_ptr(), self.escapes())


def exp12_decode(w: Exp12Rows) -> torch.Tensor:
    """The bf16 W [R, C] of ``w``, bit for bit (``exp12.c``). Needs the CPU kernels."""
    w.check("exp12_decode")
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    rc = launch("exp12_decode", *w.pointers(), out.numel(), out.data_ptr())
    if rc:
        raise RuntimeError(f"exp12_decode failed (code {rc})")
    return out
