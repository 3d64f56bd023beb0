"""Triton fused-MoE GEMMs over weight-only quantized experts: FP8 (e4m3) and GPTQ INT4.

The design of ``fused_moe.py`` (same ``moe_align_block_size``, same activation kernel, same three
launches and pair contract), with one grouped GEMM (``_moe_quant_gemm_kernel``) whose B tile is
dequantized in registers right before the ``tl.dot``: each weight is ``float32(code - zero) *
float32(scale)`` rounded to the activation dtype, exactly the value the quant method's
``dequantize`` gives the ``torch`` backend, so the two differ only by summation order.
Activations stay in the model dtype (weight-only: W8A16, W4A16); fp32 accumulation. FP8 experts
with FP8 activations (W8A8) run ``fused_moe_w8a8.py``, which reuses ``run_pairs``.

Every quantized tensor is indexed by the same id as the codes (an expert, or an expert-cache
slot: scales, zero points and g_idx travel with their expert). ``QuantProjection`` describes one
projection's tensors in the quant methods' layer layout (fp8.py, gptq.py), read in place: no
repacking, so the host store and slots hold exactly what the method declared. Index arithmetic
is int64 wherever a product can pass 2^31; no host read (CUDA-graph safe like fused_moe.py).

Run on an H100 (2026-11-26): 19 of its 33 gpu tests passed; int4-channel-v2 in bf16 and fp16
failed the tolerance (the test's outputs too large; its data rescaled since, not re-run).
fp8-block and w4a16-gptq ran in the quantization benchmark. Also tested under Triton's interpreter
on CPU and compiled for SM90/SM120 (``tests/build/test_triton_compile_fused_moe_quant.py``);
block sizes are the untuned unquantized tables (``fused_moe_config``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.fused_moe import (ACTIVATION_CODES, DTYPES, _activation, _pair_block,
                                           _pair_rows, _store_pairs, moe_align_block_size)
from vllm.kernels.triton.fused_moe_config import get_moe_config

QUANT_KINDS = {"fp8": 0, "int4": 1}
"""QuantProjection.kind -> the GEMM's QUANT constexpr."""


@dataclass(frozen=True)
class QuantProjection:
    """One projection W[g] [R, C] (R output rows, C input columns) of G experts or slots.

    fp8:  codes float8_e4m3fn [G, R, C]; scales float32 [G, SR, SC]; W[r, c] = code * scales[g,
          (r // half_rows) * rows_per_half + (r % half_rows) // block_out, c // block_in]
          (per tensor: one scale per half; per channel: block_out 1; block: 2-D blocks, edge
          blocks cropped, each half of w13 starting a new block row).
    int4: codes int32 [G, R, C/8] (column c at bits [4 (c % 8), +4) of word c // 8); scales
          [G, R, NG] (float16/bfloat16/float32); zeros int32 [G, R/8, NG] (row r at bits
          [4 (r % 8), +4) of word r // 8); g_idx int32 [G, HALVES, C]; with h = r // half_rows and
          grp = g_idx[g, h, c]: W[r, c] = (q - (zero[r, grp] + zero_offset)) * scales[g, r, grp].
          ``group_size`` > 0 promises g_idx[g, h, c] = c // group_size everywhere (no act
          order): a K tile inside one group then loads one scale and zero per row instead of
          gathering them per element (the same values, so the same bits).
    """
    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    half_rows: int
    """Rows per half (w13's gate, then up rows; all R for w2): selects the scale row block
    (fp8) or the g_idx row (int4)."""
    rows_per_half: int = 1
    """fp8: scale rows per half (the second half's scales start at row ``rows_per_half``)."""
    block_out: int = 1
    """fp8: output rows per scale row within a half."""
    block_in: int = 1
    """fp8: input columns per scale column (C when the scale has one column)."""
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    zero_offset: int = 0
    """int4: added to every stored zero point (GPTQ v1 stores zero - 1)."""
    group_size: int = 0
    """int4: input columns per group when every g_idx is contiguous groups (above); 0: unknown
    or act order (gathered per element)."""

    @property
    def rows(self) -> int:
        return self.codes.shape[1]

    @property
    def cols(self) -> int:
        return self.codes.shape[2] * (8 if self.kind == "int4" else 1)


@triton.jit
def _fp8_tile(q_ptr, s_ptr, e, k0, offs_n, n_ok, K, half_rows, rows_per_half, block_out,
              block_in, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sk,
              SCALE_PER_TILE: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_K, BLOCK_N] tile of W[e]^T, input columns k0.. and output rows offs_n (int64);
    e int64. SCALE_PER_TILE: the tile's columns lie in one scale column (one scale per row)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k < K)[:, None] & n_ok[None, :]
    codes = tl.load(q_ptr + e * stride_qe + offs_n[None, :] * stride_qn
                    + offs_k[:, None] * stride_qk, mask=mask, other=0.0)
    srow = (offs_n // half_rows) * rows_per_half + (offs_n % half_rows) // block_out  # [BLOCK_N]
    s_row_ptrs = s_ptr + e * stride_se + srow * stride_sn
    if SCALE_PER_TILE:
        s = tl.load(s_row_ptrs + (k0 // block_in) * stride_sk, mask=n_ok, other=0.0)
        return codes.to(tl.float32) * s.to(tl.float32)[None, :]
    s = tl.load(s_row_ptrs[None, :] + (offs_k // block_in)[:, None] * stride_sk, mask=mask,
                other=0.0)
    return codes.to(tl.float32) * s.to(tl.float32)


@triton.jit
def load_packed_codes(q_ptr, e, k0, offs_n, n_ok, K, stride_qe, stride_qn, stride_qk,
                      PER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [BLOCK_K, BLOCK_N] 4-bit codes of input columns k0.. and output rows offs_n of
    W[e], packed PER to a word along the input (code j at bits [4 j, 4 j + 4)): each word
    loaded once ([BLOCK_K / PER, BLOCK_N]) and split in registers, so row PER w + j of the tile
    is code j of word row w (k0 is a multiple of BLOCK_K, itself of PER). A word loaded once
    per code put the INT4 and NVFP4 GEMMs at 255 registers with spills on SM90."""
    offs_w = k0 // PER + tl.arange(0, BLOCK_K // PER)
    words = tl.load(q_ptr + e * stride_qe + offs_n[None, :] * stride_qn
                    + offs_w[:, None] * stride_qk,
                    mask=(offs_w < K // PER)[:, None] & n_ok[None, :], other=0).to(tl.int32)
    codes = (words[:, None, :] >> (tl.arange(0, PER) * 4)[None, :, None]) & 0xF
    return tl.reshape(codes, (BLOCK_K, BLOCK_N))


@triton.jit
def _int4_tile(q_ptr, s_ptr, z_ptr, g_ptr, e, k0, offs_n, n_ok, K, half_rows, zero_offset,
               group_size, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg,
               stride_ze, stride_zn, stride_zg, stride_ge, stride_gh, stride_gk,
               GROUP_PER_TILE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 [BLOCK_K, BLOCK_N] tile of W[e]^T from GPTQ codes, zero points, scales and g_idx
    (each input column looks up its group: act order runs unpermuted). stride_gh = 0 when
    g_idx has one row (w2), so both group loads stay in bounds. GROUP_PER_TILE: g_idx is
    c // group_size and the tile's columns lie in group k0 // group_size (no g_idx read, one
    scale and zero per row)."""
    q = load_packed_codes(q_ptr, e, k0, offs_n, n_ok, K, stride_qe, stride_qn, stride_qk, 8,
                          BLOCK_K, BLOCK_N)                          # [BLOCK_K, BLOCK_N]
    if GROUP_PER_TILE:
        grp1 = k0 // group_size
        s1 = tl.load(s_ptr + e * stride_se + offs_n * stride_sn + grp1 * stride_sg, mask=n_ok,
                     other=0.0)                                      # [BLOCK_N]
        zw1 = tl.load(z_ptr + e * stride_ze + (offs_n // 8) * stride_zn + grp1 * stride_zg,
                      mask=n_ok, other=0)
        z1 = ((zw1 >> ((offs_n % 8) * 4)) & 0xF) + zero_offset
        return (q - z1[None, :]).to(tl.float32) * s1.to(tl.float32)[None, :]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    mask = k_ok[:, None] & n_ok[None, :]
    g_ptrs = g_ptr + e * stride_ge + offs_k * stride_gk
    g_first = tl.load(g_ptrs, mask=k_ok, other=0)                    # [BLOCK_K] gate (or only)
    g_second = tl.load(g_ptrs + stride_gh, mask=k_ok, other=0)       # [BLOCK_K] up
    first = (offs_n // half_rows == 0)[None, :]
    grp = tl.where(first, g_first[:, None], g_second[:, None]).to(tl.int64)
    s = tl.load(s_ptr + e * stride_se + offs_n[None, :] * stride_sn + grp * stride_sg,
                mask=mask, other=0.0)
    zw = tl.load(z_ptr + e * stride_ze + (offs_n // 8)[None, :] * stride_zn + grp * stride_zg,
                 mask=mask, other=0)
    z = ((zw >> ((offs_n % 8) * 4)[None, :]) & 0xF) + zero_offset
    return (q - z).to(tl.float32) * s.to(tl.float32)


@triton.jit
def _moe_quant_gemm_kernel(
        a_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, c_ptr, w_ptr, sorted_ptr,
        block_expert_ptr, num_padded_ptr, N, K, P, num_m_blocks, half_rows, rows_per_half,
        block_out, block_in, zero_offset, stride_am, stride_ak, stride_qe, stride_qn, stride_qk,
        stride_se, stride_sn, stride_sk, stride_ze, stride_zn, stride_zk, stride_ge, stride_gh,
        stride_gk, stride_bias_e, stride_cm, stride_cn,
        QUANT: tl.constexpr, ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        HAS_BIAS: tl.constexpr, SCALE_PER_TILE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr):
    """C[r, n] = (A[r // ROW_DIV] @ W[e]^T + bias[e])[n] (* w[r]) for the sorted pair rows r of
    one M block (slot e) and one N block; W[e] [N, K] dequantized per tile (QUANT 0: fp8,
    1: int4; see QuantProjection). A [*, K] in the activation dtype; C [P, N]. SCALE_PER_TILE:
    each K tile reads one scale column (fp8) or one group (int4, group size ``block_in``)."""
    e, pid_m, pid_n = _pair_block(block_expert_ptr, num_padded_ptr, N, num_m_blocks, BLOCK_M,
                                  BLOCK_N, GROUP_M)
    if e < 0:
        return
    rows, row_ok, offs_n, n_ok = _pair_rows(sorted_ptr, pid_m, pid_n, N, P, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        if QUANT == 0:
            b = _fp8_tile(q_ptr, s_ptr, e, k0, offs_n, n_ok, K, half_rows, rows_per_half,
                          block_out, block_in, stride_qe, stride_qn, stride_qk, stride_se,
                          stride_sn, stride_sk, SCALE_PER_TILE, BLOCK_K)
        else:               # block_in: int4's group size (used with SCALE_PER_TILE)
            b = _int4_tile(q_ptr, s_ptr, z_ptr, g_ptr, e, k0, offs_n, n_ok, K, half_rows,
                           zero_offset, block_in, stride_qe, stride_qn, stride_qk, stride_se,
                           stride_sn, stride_sk, stride_ze, stride_zn, stride_zk, stride_ge,
                           stride_gh, stride_gk, SCALE_PER_TILE, BLOCK_K, BLOCK_N)
        # Rounded to the activation dtype, as the torch backend's dequantize: then the dot.
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    _store_pairs(acc, c_ptr, w_ptr, bias_ptr, rows, row_ok, offs_n, n_ok, e, stride_bias_e,
                 stride_cm, stride_cn, MUL_WEIGHT, HAS_BIAS)


def _block_k(dtype: torch.dtype, cfg: dict[str, int]) -> int:
    """fp32 operands take half the K block (as fused_moe._gemm)."""
    return cfg["BLOCK_K"] if dtype != torch.float32 else max(16, cfg["BLOCK_K"] // 2)


def _strides(t: torch.Tensor | None, n: int = 3) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def _quant_gemm(a: torch.Tensor, wq: QuantProjection, bias: torch.Tensor | None,
                c: torch.Tensor, w: torch.Tensor | None, align, row_div: int,
                cfg: dict[str, int]) -> None:
    """c [P, R] rows of the aligned pairs = a[rows // row_div] @ W[e]^T (+ bias) (* w)."""
    sorted_ids, block_expert, num_padded = align
    N, K = wq.rows, wq.cols
    num_m = block_expert.numel()
    block_k = _block_k(a.dtype, cfg)
    fp8 = wq.kind == "fp8"
    per_tile = fp8 and (wq.scales.shape[2] == 1 or wq.block_in % block_k == 0)
    block_in = wq.block_in
    if not fp8 and wq.group_size > 0 and (wq.group_size >= K or wq.group_size % block_k == 0):
        per_tile, block_in = True, wq.group_size     # every K tile inside one group
    zeros = wq.zeros if wq.zeros is not None else wq.codes       # unused by fp8
    g_idx = wq.g_idx if wq.g_idx is not None else wq.codes
    sge, sgh, sgk = _strides(wq.g_idx)
    if wq.g_idx is not None and wq.g_idx.shape[1] == 1:
        sgh = 0                                      # one g_idx row: both loads read it
    grid = (num_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    _moe_quant_gemm_kernel[grid](
        a, wq.codes, wq.scales, zeros, g_idx, bias if bias is not None else a, c,
        w if w is not None else a, sorted_ids, block_expert, num_padded, N, K, c.shape[0],
        num_m, wq.half_rows, wq.rows_per_half, wq.block_out, block_in, wq.zero_offset,
        a.stride(0), a.stride(1), *wq.codes.stride(), *wq.scales.stride(),
        *_strides(wq.zeros), sge, sgh, sgk, bias.stride(0) if bias is not None else 0,
        c.stride(0), c.stride(1), QUANT=QUANT_KINDS[wq.kind], ROW_DIV=row_div,
        MUL_WEIGHT=w is not None, HAS_BIAS=bias is not None, SCALE_PER_TILE=per_tile,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        num_warps=dequant_warps(cfg, gathers=not fp8 and not per_tile),
        num_stages=cfg["num_stages"])


def dequant_warps(cfg: dict[str, int], gathers: bool) -> int:
    """The table's warps for a dequantizing GEMM, raised to 8 where 4 run out of registers
    (compiled as the JIT specializes, Triton 3.6 and 3.9, not run;
    tests/build/test_triton_compile_fused_moe_{quant,fp4}.py): per-element scale gathers
    (INT4 act order: up to 584 B of spills per thread on SM90) and output tiles of 64 x 128 or
    more (FP4 at the default table's last entry on SM120: 208 B)."""
    big = cfg["BLOCK_M"] * cfg["BLOCK_N"] >= 64 * 128
    return max(cfg["num_warps"], 8) if gathers or big else cfg["num_warps"]


def check_projection(name: str, wq: QuantProjection, rows: int, cols: int, G: int,
                     device: torch.device) -> None:
    """Clear errors for a projection the kernel cannot read as ``QuantProjection`` says."""
    def fail(msg: str):
        raise ValueError(f"triton fused_moe_quant: {name} {msg}")
    if wq.kind not in QUANT_KINDS:
        fail(f"kind={wq.kind!r} is invalid: must be one of {list(QUANT_KINDS)}")
    int4 = wq.kind == "int4"
    want = torch.int32 if int4 else torch.float8_e4m3fn
    if wq.codes.dtype != want or wq.codes.dim() != 3 or (G, wq.rows, wq.cols) != (G, rows, cols):
        fail(f"codes are {tuple(wq.codes.shape)} {wq.codes.dtype}; need {want} "
             f"({G}, {rows}, {cols // 8 if int4 else cols})")
    tensors = {"scales": wq.scales, "zeros": wq.zeros, "g_idx": wq.g_idx}
    if int4 and (wq.zeros is None or wq.g_idx is None):
        fail("int4 needs zeros and g_idx")
    for what, t in tensors.items():
        if t is None:
            continue
        if t.dim() != 3 or t.shape[0] != G or t.device != device:
            fail(f"{what} is {tuple(t.shape)} on {t.device}; need [G={G}, ...] on {device}")
    if int4 and (wq.zeros.dtype != torch.int32 or wq.g_idx.dtype != torch.int32 or
                 wq.scales.shape[1] != rows or wq.zeros.shape[1] * 8 != rows or
                 wq.g_idx.shape[2] != cols or wq.g_idx.shape[1] not in (1, 2)):
        fail(f"int4 tensors scales {tuple(wq.scales.shape)}, zeros {tuple(wq.zeros.shape)} "
             f"{wq.zeros.dtype}, g_idx {tuple(wq.g_idx.shape)} {wq.g_idx.dtype} do not fit "
             f"[G, {rows}, NG], int32 [G, {rows // 8}, NG], int32 [G, 1 or 2, {cols}]")
    if int4 and (wq.group_size < 0 or (wq.group_size and
                                        wq.scales.shape[2] < triton.cdiv(cols, wq.group_size))):
        fail(f"group_size={wq.group_size} is invalid with scales {tuple(wq.scales.shape)}: "
             f"must be 0 (g_idx gathered) or the input columns per group of the {cols}")
    if min(wq.half_rows, wq.rows_per_half, wq.block_out, wq.block_in) < 1:
        fail("half_rows, rows_per_half, block_out and block_in must be >= 1")
    if not int4:        # every scale index the kernel forms must lie inside the scales
        halves = triton.cdiv(rows, wq.half_rows)
        need = ((halves - 1) * wq.rows_per_half + triton.cdiv(min(wq.half_rows, rows),
                                                              wq.block_out),
                triton.cdiv(cols, wq.block_in))
        if wq.scales.shape[1] < need[0] or wq.scales.shape[2] < need[1]:
            fail(f"scales {tuple(wq.scales.shape)} are smaller than the {need} blocks of "
                 f"half_rows={wq.half_rows}, rows_per_half={wq.rows_per_half}, "
                 f"block_out={wq.block_out}, block_in={wq.block_in}")


def _check_inputs(x, w13, w2, topk_weights, topk_ids, out, activation, b13, b2,
                  check=check_projection, who: str = "fused_moe_quant") -> None:
    """Shared by fused_moe_fp4: ``check`` validates one projection as check_projection does."""
    def fail(msg: str):
        raise ValueError(f"triton {who}: {msg}")
    if activation not in ACTIVATION_CODES or activation == "relu2_no_mul":
        fail(f"activation={activation!r} is invalid: the quantized layouts are gated "
             f"({[a for a in ACTIVATION_CODES if a != 'relu2_no_mul']})")
    if x.dim() != 2 or x.dtype not in DTYPES:
        fail(f"x must be [T, H] in {list(DTYPES)}, got {tuple(x.shape)} {x.dtype}")
    (T, H), G, N = x.shape, w13.codes.shape[0], w2.cols
    check("w13", w13, 2 * N, H, G, x.device)
    check("w2", w2, H, N, G, x.device)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        fail(f"need topk_ids and topk_weights [T={T}, K]; got {tuple(topk_ids.shape)} and "
             f"{tuple(topk_weights.shape)}")
    if tuple(out.shape) != (T, topk_ids.shape[1], H) or not out.is_contiguous() or \
            out.dtype != x.dtype:
        fail(f"out must be a contiguous [T, K, H] = {(T, topk_ids.shape[1], H)} {x.dtype} "
             f"tensor, got {tuple(out.shape)} {out.dtype}")
    for name, t, want in (("b13", b13, (G, 2 * N)), ("b2", b2, (G, H))):
        if t is not None and (tuple(t.shape) != want or t.stride(-1) != 1 or
                              t.dtype != x.dtype):
            fail(f"{name} must be a row-contiguous {want} {x.dtype} tensor, got "
                 f"{tuple(t.shape)} {t.dtype}")


def fused_moe_quant_pairs(x: torch.Tensor, w13: QuantProjection, w2: QuantProjection,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                          activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                          b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                          config: dict[str, int] | None = None, device_name: str = "",
                          max_ids: int | None = None) -> None:
    """``fused_moe.fused_moe_pairs`` on quantized experts: out[t, k] = topk_weights[t, k] *
    expert_{topk_ids[t, k]}(x[t]) for ids in [0, G); other pairs untouched. x [T, H];
    w13 [G, 2N, H] ([gate; up]) and w2 [G, H, N] as QuantProjections; optional biases
    b13 [G, 2N], b2 [G, H] in x's dtype; out [T, K, H] contiguous. Gated activations only."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids, out, activation, b13, b2)
    run_pairs(_quant_gemm, x, w13, w2, topk_weights, topk_ids, out, activation, alpha, limit,
              b13, b2, config, device_name, max_ids)


def run_pairs(gemm, x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, out: torch.Tensor, activation: str, alpha: float,
              limit: float, b13: torch.Tensor | None, b2: torch.Tensor | None,
              config: dict[str, int] | None, device_name: str,
              max_ids: int | None = None) -> None:
    """The three launches of a quantized pairs call on checked inputs: ``gemm(a, proj, bias,
    c, weights, align, row_div, cfg)`` (this module's ``_quant_gemm``, fused_moe_fp4's
    ``_fp4_gemm``) for gate-up, the activation, then gemm for down into out [T, K, H]; grids
    sized for at most ``max_ids`` distinct ids (``fused_moe.fused_moe_pairs``)."""
    T, K = topk_ids.shape
    G, H, N = w13.codes.shape[0], x.shape[1], w2.cols
    P = T * K
    if P == 0:
        return
    cfg = config or get_moe_config(N, T, device_name)
    align = moe_align_block_size(topk_ids, cfg["BLOCK_M"], G, max_ids)
    gate_up = x.new_empty(P, 2 * N)                  # [P, 2N] rows of the call's pairs
    gemm(x, w13, b13, gate_up, None, align, K, cfg)
    act = x.new_empty(P, N)                          # [P, N]
    _activation(gate_up, act, align, activation, alpha, limit, cfg["BLOCK_M"])
    gemm(act, w2, b2, out.view(P, H), topk_weights.reshape(P), align, 1, cfg)


def fused_moe_quant(x: torch.Tensor, w13: QuantProjection, w2: QuantProjection,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
                    alpha: float = 1.702, limit: float = 7.0, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, config: dict[str, int] | None = None,
                    device_name: str = "") -> torch.Tensor:
    """x [T, H] -> [T, H]: ``fused_moe_quant_pairs`` into zeros, summed over each token's K."""
    T, K = topk_ids.shape
    out = x.new_zeros(T, K, x.shape[-1])             # [T, K, H]
    fused_moe_quant_pairs(x, w13, w2, topk_weights, topk_ids, out, activation, alpha, limit,
                          b13, b2, config, device_name)
    return out.sum(dim=1)
