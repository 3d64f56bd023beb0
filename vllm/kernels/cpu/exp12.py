"""exp12's encoder in C (``exp12.c``): one expert's bf16 weights into its planes, at load
(``expert_cache/link_codec.py`` has the layout and the torch version it must equal)."""
from __future__ import annotations

import ctypes

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
