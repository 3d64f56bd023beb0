"""Our loaded expert layouts -> the ones FlashInfer's CUTLASS fused MoE reads (the
``flashinfer_cutlass`` backend's ``pack``). Each function takes one expert's tensors or stacked
[E, ...] ones (the expert cache packs expert by expert into its host store; uncached layers pack
the stack), so every change is per expert and a cache slot holds an expert's packed bytes.

FlashInfer's fc1 is [up; gate] (w3 then w1); ours is [gate; up]: every w13 tensor (weights,
scale rows, biases) swaps its halves. Pure torch except MXFP4's weight interleave, a CUDA kernel
of FlashInfer's that the caller passes in (``interleave``)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

MXFP4_ALIGN = 128
"""MXFP4 (SM90 W4A16) pads hidden and intermediate sizes to this: the scale fold works on
64-row x 128-input blocks (``interleave_moe_scales_for_sm90_mixed_gemm``), and FlashInfer's
``prepare_cutlass_w4a16_weights`` requires both sizes divisible by 128."""
E8M0_ONE = 127
"""The e8m0 byte of scale 1.0, written into padding (its codes are 0, so the value is 0)."""

Interleave = Callable[[torch.Tensor], torch.Tensor]
"""uint8 [E, rows, cols / 2] -> the same shape in FlashInfer's SM90 mixed-GEMM byte order."""
FoldScales = Callable[[torch.Tensor], torch.Tensor]
"""e8m0 uint8 [E, rows, cols / 32] -> FlashInfer's folded [E, rows/64, cols/128, 16, 16]."""


def swap_halves(t: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """(a; b) halves of ``dim`` -> (b; a): our [gate; up] w13 rows -> FlashInfer's [up; gate]."""
    a, b = t.chunk(2, dim=dim)
    return torch.cat([b, a], dim=dim)


def round_up(v: int, m: int) -> int:
    return -(-v // m) * m


# ---- NVFP4 / FP8 block / unquantized ----------------------------------------------------------
def swizzle_block_scales(s: torch.Tensor) -> torch.Tensor:
    """NVFP4 block scales [..., R, C] (row r's scale of inputs 16c .. 16c + 15) -> the 128x4
    tiled layout FlashInfer's CUTLASS kernels read: [..., R', C'] with R' = ceil(R / 128) * 128,
    C' = ceil(C / 4) * 4 (zero padded), whose bytes are a [R'/128, C'/4, 32, 4, 4] tensor with
    entry [i, j, a, b, c] = padded s[128 i + 32 b + a, 4 j + c] (the inverse of FlashInfer's
    test helper ``convert_swizzled_to_linear``)."""
    *lead, R, C = s.shape
    Rp, Cp = round_up(R, 128), round_up(C, 4)
    u8 = s.view(torch.uint8)
    padded = u8.new_zeros(*lead, Rp, Cp)
    padded[..., :R, :C] = u8
    tiles = padded.view(*lead, Rp // 128, 4, 32, Cp // 4, 4)            # [.., i, b, a, j, c]
    return tiles.permute(*range(len(lead)), -5, -2, -3, -4, -1).reshape(*lead, Rp, Cp) \
        .view(s.dtype)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)      # torch's cast does not saturate


def nvfp4_to_flashinfer(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nvfp4.py's tensors (one expert, or stacked with a leading [E]) -> FlashInfer's; N =
    intermediate, K = hidden:
      w13_weight uint8 [.., 2N, K/2]          -> [up; gate] rows, same e2m1 packing
      w13_weight_scale e4m3 [.., 2N, K/16]    -> [up; gate], each half rescaled onto the shared
                                                 global scale g = max(g_gate, g_up) (exact when
                                                 equal, else rounded to e4m3), swizzled
                                                 [.., pad128(2N), pad4(K/16)]
      w13_weight_scale_2 f32 [.., 2]          -> [.., 2], both g (FlashInfer: one per expert)
      w2_weight_scale e4m3 [.., K, N/16]      -> swizzled [.., pad128(K), pad4(N/16)]
      w2_weight, w2_weight_scale_2            unchanged."""
    g2 = t["w13_weight_scale_2"].float()                                 # [.., 2] gate, up
    g = g2.amax(dim=-1, keepdim=True)                                    # [.., 1]
    s13 = t["w13_weight_scale"].float()
    N = s13.shape[-2] // 2
    ratio = torch.where(g > 0, g2 / g, 1.0).unsqueeze(-1)                # [.., 2, 1]
    s13 = torch.cat([s13[..., :N, :] * ratio[..., 0:1, :], s13[..., N:, :] * ratio[..., 1:2, :]],
                    dim=-2)
    out = dict(t)
    out["w13_weight"] = swap_halves(t["w13_weight"])
    out["w13_weight_scale"] = swizzle_block_scales(swap_halves(_e4m3(s13)))
    out["w13_weight_scale_2"] = g.expand_as(g2).to(t["w13_weight_scale_2"].dtype).contiguous()
    out["w2_weight_scale"] = swizzle_block_scales(t["w2_weight_scale"])
    return out


def fp8_block_to_flashinfer(t: dict[str, torch.Tensor], scale_name: str
                            ) -> dict[str, torch.Tensor]:
    """fp8.py's block layout (128x128 blocks, N a multiple of 128) -> FlashInfer's: w13_weight
    e4m3 [.., 2N, K] and w13_<scale_name> f32 [.., 2N/128, K/128] to [up; gate] rows; w2 as is."""
    out = dict(t)
    for name in ("w13_weight", f"w13_{scale_name}"):
        out[name] = swap_halves(t[name])
    return out


def unquantized_to_flashinfer(t: dict[str, torch.Tensor], gated: bool
                              ) -> dict[str, torch.Tensor]:
    """w13_weight [.., 2N, K] and w13_bias [.., 2N] to [up; gate]; non-gated (N rows: up only)
    and w2 unchanged."""
    out = dict(t)
    if gated:
        out["w13_weight"] = swap_halves(t["w13_weight"])
        if "w13_bias" in t:
            out["w13_bias"] = swap_halves(t["w13_bias"], dim=-1)
    return out


# ---- MXFP4 (GPT-OSS) for the SM90 W4A16 path ----------------------------------------------------
def _pad_last2(t: torch.Tensor, rows: int, cols: int, value: int = 0) -> torch.Tensor:
    """Pads the last two dims of ``t`` at their ends to (rows, cols)."""
    return F.pad(t, (0, cols - t.shape[-1], 0, rows - t.shape[-2]), value=value)


def _fc1_rows(t: torch.Tensor, rows: int, cols: int, value: int = 0) -> torch.Tensor:
    """[.., 2N, C] [gate; up] -> [.., 2 * rows, cols] [up; gate], each half padded."""
    gate, up = t.chunk(2, dim=-2)
    return torch.cat([_pad_last2(up, rows, cols, value), _pad_last2(gate, rows, cols, value)],
                     dim=-2)


def _per_expert(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor,
                trailing: int) -> torch.Tensor:
    """``fn`` over a stack [E, rows, cols] made from ``t``'s leading dims (none: one expert);
    the result keeps ``t``'s leading dims and ``fn``'s trailing ones."""
    lead = t.shape[:t.dim() - trailing]
    out = fn(t.reshape(-1, *t.shape[-trailing:]).contiguous())
    return out.reshape(*lead, *out.shape[1:])


def mxfp4_to_flashinfer(t: dict[str, torch.Tensor], interleave: Interleave,
                        fold_scales: FoldScales) -> dict[str, torch.Tensor]:
    """mxfp4.py's tensors (one expert, or stacked [E, ...]) -> FlashInfer's SM90 W4A16 MXFP4
    operands; N = intermediate, K = hidden, padded to Np, Kp (multiples of ``MXFP4_ALIGN``):
      w13_blocks uint8 [.., 2N, K/32, 16] -> [up; gate] e2m1 bytes [.., 2Np, Kp/2] (code 2j low
                                             nibble of byte j, as ours), zero padded, then
                                             ``interleave``d (FlashInfer's CUDA kernel)
      w13_scales uint8 [.., 2N, K/32]     -> [up; gate] e8m0 [.., 2Np, Kp/32] (padding 1.0), then
                                             ``fold_scales``: [.., 2Np/64, Kp/128, 16, 16]
      w2_blocks [.., K, N/32, 16]         -> [.., Kp, Np/2], interleaved; w2_scales likewise
      w13_bias [.., 2N] -> [up; gate] [.., 2Np]; w2_bias [.., K] -> [.., Kp] (zero padded).
    Padded rows and columns are zero weights: they add nothing, and the padded outputs (zero,
    plus a zero bias) are sliced off by the backend."""
    N2, K = t["w13_scales"].shape[-2], t["w2_scales"].shape[-2]
    Np, Kp = round_up(N2 // 2, MXFP4_ALIGN), round_up(K, MXFP4_ALIGN)
    b13 = t["w13_blocks"].flatten(-2)                                    # [.., 2N, K/2]
    b2 = t["w2_blocks"].flatten(-2)                                      # [.., K, N/2]
    out = dict(t)
    out["w13_blocks"] = _per_expert(interleave, _fc1_rows(b13, Np, Kp // 2), 2)
    out["w2_blocks"] = _per_expert(interleave, _pad_last2(b2, Kp, Np // 2), 2)
    out["w13_scales"] = _per_expert(
        fold_scales, _fc1_rows(t["w13_scales"], Np, Kp // 32, E8M0_ONE), 2)
    out["w2_scales"] = _per_expert(
        fold_scales, _pad_last2(t["w2_scales"], Kp, Np // 32, E8M0_ONE), 2)
    if "w13_bias" in t:
        gate, up = t["w13_bias"].chunk(2, dim=-1)
        out["w13_bias"] = torch.cat([F.pad(up, (0, Np - up.shape[-1])),
                                     F.pad(gate, (0, Np - gate.shape[-1]))], dim=-1)
    if "w2_bias" in t:
        out["w2_bias"] = F.pad(t["w2_bias"], (0, Kp - K))
    return out
