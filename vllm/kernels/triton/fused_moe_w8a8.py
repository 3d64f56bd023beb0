"""Triton fused-MoE GEMMs over FP8 experts with FP8 activations (W8A8): both operands of each
``tl.dot`` are e4m3 codes, so the weights reach the matrix units without the per-weight
dequantization of ``fused_moe_quant.py`` (W8A16), and the scales multiply the fp32 products.

Activations are quantized as the checkpoint declares (``InputQuant``; parsed in
``vllm/config/quantization.py``): dynamically per token row, per token row and group of
``group`` input columns (DeepSeek-V3's 1 x 128), or with the checkpoint's static per-tensor
scale. A dynamic scale is amax / 448 (amax at least 1e-10) over the row's group, and a code is
e4m3(clamp(x / scale, -448, 448)) with round-to-nearest: the same formula as vLLM's
``per_token_group_quant_fp8``. Both divisions are IEEE (``tl.div_rn``): Triton lowers a float32
``/`` to ``div.full.f32`` (up to 2 ulp off; amax / 448 even became amax times an approximate
1 / 448), and a quotient one ulp off moves a code that lies on an e4m3 tie (x / scale = 184.0
exactly: 192 at ties-to-even, 176 from 183.99998), which moves the product of every expert
the row meets. Every scale is per row, so a row's result never depends on the other rows of
the batch (CUDA-graph padding rows included).

Five launches per call (weight-only takes four): the alignment, x quantized (``quantize_rows``),
the gate-up GEMM, the activation quantized in the activation's own kernel (``activation_quant``:
the same bits as ``fused_moe``'s activation kernel followed by ``quantize_rows``), the down GEMM.
The GEMM (``_moe_w8a8_gemm_kernel``) is ``fused_moe_quant``'s grouped GEMM with A and B in e4m3:
    C[r, n] = sum over K tiles of (A_q[r] . W_q[e, n])_tile * a_scale[r, tile] * w_scale[n, tile]
when either scale varies along K (block weights, group activations: the K block divides both
widths, so a tile lies inside one scale column of each), or the whole dot times the two scales
once at the end (tensor / channel weights with token / tensor activations). Same alignment,
activation math and pair contract as ``fused_moe.py``; every weight scale is read at the slot
id of its codes (expert-cache safe); no host read (CUDA-graph safe).

What the matrix units get (compiled for SM90 and SM120, tests/build): e4m3 x e4m3 MMAs on SM120
and on SM90 for tiles of 64 rows or more (``wgmma ... e4m3.e4m3``); SM90's smaller tiles (the
decode entries of the tables) run Triton's MMA v2, which widens both operands to f16 (exactly:
every e4m3 value is an f16) for an f16 MMA with fp32 accumulation, so the sums are the same.
Tested under Triton's interpreter on CPU against a torch reference written in
tests/kernels/triton/test_fused_moe_w8a8.py (the interpreter's e4m3 ``tl.dot`` is exact there).
On an H100 (Triton 3.6) the ``gpu`` tests failed with ``/`` in the quantizer (scales and codes
off the formula's); not yet rerun there with ``tl.div_rn``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.kernels.triton import interpreting
from vllm.kernels.triton.fused_moe import (ACTIVATION_CODES, _pair_block, _pair_rows,
                                           _store_pairs, act_values, moe_align_block_size)
from vllm.kernels.triton.fused_moe_quant import QuantProjection, _check_inputs, dequant_warps
from vllm.kernels.triton.fused_moe_config import get_moe_config

FP8_MAX = 448.0
"""Largest finite e4m3 (float8_e4m3fn) value."""
AMAX_FLOOR = 1e-10
"""A dynamic scale's amax floor: an all-zero row gets codes 0, not NaN."""
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
INPUT_KINDS = ("token", "group", "tensor")
MIN_BLOCK_K = 32
"""The smallest K block of an e4m3 ``tl.dot`` (the k of one FP8 MMA instruction)."""
_ACT_ROWS = tl.constexpr(16)
"""Pair rows ``_act_quant_kernel`` quantizes at a time (the smallest BLOCK_M of a ``tl.dot``)."""


@dataclass(frozen=True)
class InputQuant:
    """How a GEMM's input rows become e4m3 codes: "token" (dynamic, one scale per row),
    "group" (dynamic, one per row and ``group`` columns) or "tensor" (the static ``scale``,
    a float32 tensor of one element on the device)."""
    kind: str
    group: int = 0
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in INPUT_KINDS:
            raise ValueError(f"InputQuant kind={self.kind!r} is invalid: must be one of "
                             f"{list(INPUT_KINDS)}")
        if (self.kind == "group") != (self.group > 0):
            raise ValueError(f"InputQuant group={self.group} must be > 0 exactly for 'group'")
        if (self.kind == "tensor") != (self.scale is not None) or \
                (self.scale is not None and self.scale.numel() != 1):
            raise ValueError("InputQuant scale must be one value exactly for 'tensor'")

    def width(self, K: int) -> int:
        """Input columns per scale column for rows of K columns."""
        return self.group if self.kind == "group" and self.group < K else K


@triton.jit
def _e4m3_grid(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32:
    3 mantissa bits, so the step is 2^(exponent - 3), and 2^-9 below e4m3's smallest normal
    2^-6. Adding and subtracting 1.5 * 2^23 rounds |v| / step < 2^22 to an integer; the sign
    is put back after, so what rounds to zero keeps it (-0.0, as the cast gives). |v| / step
    is exact (step is a power of two, the quotient normal); ``div_rn`` says so on any target
    rather than trusting ``div.full`` with it."""
    a = tl.abs(v)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.div_rn(a, step) + 12582912.0) - 12582912.0) * step
    return tl.where(v < 0, -r, r)


@triton.jit
def _tile_values(src, ok, N, alpha, limit, ACT: tl.constexpr):
    """fp32 values of a [rows, cols] tile of pointers ``src``: as stored (ACT -1), or the
    activation ACT of the gate-up values there, rounded to their dtype as
    ``fused_moe._moe_act_kernel`` stores it (masked lanes 0 either way)."""
    if ACT < 0:
        return tl.load(src, mask=ok, other=0.0).to(tl.float32)
    y = act_values(src, ok, N, alpha, limit, ACT)
    return tl.where(ok, y.to(src.dtype.element_ty).to(tl.float32), 0.0)


@triton.jit
def _quantize_tile_rows(src_rows, q_rows, s_ptrs, static_ptr, row_ok, start, stop, N, alpha,
                        limit, ACT: tl.constexpr, STATIC: tl.constexpr,
                        ROUND_FIRST: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [start, stop) of ROWS rows (``_tile_values`` of src_rows [ROWS, 1] + columns)
    -> e4m3 codes at q_rows + columns and one scale per row at s_ptrs [ROWS]. Two passes over
    the columns in BLOCK chunks (amax, then codes). ROUND_FIRST (under the interpreter only):
    its float32 -> e4m3 cast rounds wrongly where rounding carries into the next power of two
    (124.3 -> 64, not 128), and exactly on e4m3 values, so the codes are rounded first; a
    GPU's cast (cvt.rn.satfinite) rounds itself."""
    if STATIC:
        scale = tl.zeros((ROWS,), dtype=tl.float32) + tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c0 in range(start, stop, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < stop)[None, :]
            y = _tile_values(src_rows + cols[None, :], ok, N, alpha, limit, ACT)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=1), _AMAX_FLOOR), _FP8_MAX)  # [ROWS]
    for c0 in range(start, stop, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = row_ok[:, None] & (cols < stop)[None, :]
        y = _tile_values(src_rows + cols[None, :], ok, N, alpha, limit, ACT)
        q = tl.clamp(tl.div_rn(y, scale[:, None]), -_FP8_MAX, _FP8_MAX)
        if ROUND_FIRST:
            q = _e4m3_grid(q)
        tl.store(q_rows + cols[None, :], q.to(q_rows.dtype.element_ty), mask=ok)
    tl.store(s_ptrs, scale, mask=row_ok)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, M, K, width, stride_xm, stride_qm,
                       stride_sm, STATIC: tl.constexpr, ROUND_FIRST: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (ROWS rows from m0, scale column j): columns [j width, (j + 1) width) of each
    row -> codes and the scales s_ptr[m, j] (``_quantize_tile_rows``)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1)
    _quantize_tile_rows(x_ptr + rows[:, None] * stride_xm, q_ptr + rows[:, None] * stride_qm,
                        s_ptr + rows * stride_sm + j, static_ptr, rows < M, j * width,
                        tl.minimum(j * width + width, K), K, 0.0, 0.0, -1, STATIC,
                        ROUND_FIRST, ROWS, BLOCK)


def quantize_rows(x: torch.Tensor, iq: InputQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row-contiguous) -> (e4m3 codes [M, K], float32 scales [M, ceil(K / width)]):
    x[m, c] ~ codes[m, c] * scales[m, c // width]."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows: x must be a row-contiguous [M, K] tensor, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    M, K = x.shape
    width = iq.width(K)
    codes = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(M, triton.cdiv(K, width), dtype=torch.float32, device=x.device)
    if M == 0:
        return codes, scales
    static = iq.scale if iq.scale is not None else scales
    block = min(triton.next_power_of_2(width), 1024)
    rows = max(1, 1024 // block)                     # a [rows, block] tile of 1024 values
    _quant_rows_kernel[(triton.cdiv(M, rows), scales.shape[1])](
        x, codes, scales, static, M, K, width, x.stride(0), codes.stride(0), scales.stride(0),
        STATIC=iq.scale is not None, ROUND_FIRST=interpreting(), ROWS=rows, BLOCK=block,
        num_warps=4)
    return codes, scales


@triton.jit
def _act_quant_kernel(in_ptr, q_ptr, s_ptr, static_ptr, sorted_ptr, num_padded_ptr, N, P, width,
                      stride_in, stride_q, stride_s, alpha, limit, ACT: tl.constexpr,
                      STATIC: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """The activation of the sorted pair rows of one M block, rounded to the gate-up dtype as
    ``fused_moe._moe_act_kernel`` stores it, then quantized by the code ``_quant_rows_kernel``
    runs (scale column program_id(1) of ``width`` columns): the codes and scales that kernel
    would make of the activation kernel's output, in one launch and without storing it.
    ``_ACT_ROWS`` rows at a time (rows are independent): a [64, 128] tile with an IEEE
    division (div.rn.f32, whose slow path is a call) per value spilled on SM90 (static scale,
    silu: 128 registers, 12 B of spill stores per thread)."""
    tl.static_assert(BLOCK_M % _ACT_ROWS.value == 0)
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    j = tl.program_id(1)
    for r0 in range(0, BLOCK_M, _ACT_ROWS):
        rows = tl.load(sorted_ptr + pid_m.to(tl.int64) * BLOCK_M + r0 +
                       tl.arange(0, _ACT_ROWS))
        _quantize_tile_rows(in_ptr + rows[:, None] * stride_in,
                            q_ptr + rows[:, None] * stride_q, s_ptr + rows * stride_s + j,
                            static_ptr, rows < P, j * width, tl.minimum(j * width + width, N),
                            N, alpha, limit, ACT, STATIC, ROUND_FIRST, _ACT_ROWS, BLOCK_N)


def activation_quant(gate_up: torch.Tensor, align, activation: str, alpha: float,
                     limit: float, block_m: int, iq: InputQuant, N: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [P, 2N] (or [P, N] non-gated) -> (e4m3 codes [P, N], float32 scales [P, S]) of
    act(gate_up) rounded to gate_up's dtype, for the aligned pairs' rows (others unset)."""
    sorted_ids, block_expert, num_padded = align
    P, width = gate_up.shape[0], iq.width(N)
    codes = torch.empty(P, N, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty(P, triton.cdiv(N, width), dtype=torch.float32, device=gate_up.device)
    static = iq.scale if iq.scale is not None else scales
    block_n = max(16, min(triton.next_power_of_2(width), 256))
    _act_quant_kernel[(block_expert.numel(), scales.shape[1])](
        gate_up, codes, scales, static, sorted_ids, num_padded, N, P, width, gate_up.stride(0),
        codes.stride(0), scales.stride(0), float(alpha), float(limit),
        ACT=ACTIVATION_CODES[activation], STATIC=iq.scale is not None,
        ROUND_FIRST=interpreting(), BLOCK_M=block_m, BLOCK_N=block_n)
    return codes, scales


@dataclass(frozen=True)
class W8A8Projection:
    """An FP8 ``QuantProjection`` (fused_moe_quant.py's fp8 layout) and how its GEMM's input
    rows are quantized."""
    weight: QuantProjection
    inputs: InputQuant

    @property
    def codes(self) -> torch.Tensor:
        return self.weight.codes

    @property
    def cols(self) -> int:
        return self.weight.cols


@triton.jit
def _moe_w8a8_gemm_kernel(
        a_ptr, as_ptr, q_ptr, s_ptr, bias_ptr, c_ptr, w_ptr, sorted_ptr, block_expert_ptr,
        num_padded_ptr, N, K, P, num_m_blocks, half_rows, rows_per_half, block_out, block_in,
        a_width, stride_am, stride_asm, stride_qe, stride_qn, stride_qk, stride_se, stride_sn,
        stride_sk, stride_bias_e, stride_cm, stride_cn,
        ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        SCALE_EACH_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[r, n] = (A[r // ROW_DIV] @ W[e]^T + bias[e])[n] (* w[r]) for the sorted pair rows r of
    one M block (slot e) and one N block. A: e4m3 codes [*, K] (unit column stride) with
    float32 scales as_ptr [*, ceil(K / a_width)]; W[e]: e4m3 codes [N, K] with fp8.py's scales
    (QuantProjection). SCALE_EACH_TILE: scale each K tile's dot (BLOCK_K divides a_width and
    block_in); else the whole dot once (both scales constant along K)."""
    e, pid_m, pid_n = _pair_block(block_expert_ptr, num_padded_ptr, N, num_m_blocks, BLOCK_M,
                                  BLOCK_N, GROUP_M)
    if e < 0:
        return
    rows, row_ok, offs_n, n_ok = _pair_rows(sorted_ptr, pid_m, pid_n, N, P, BLOCK_M, BLOCK_N)
    a_rows = (rows // ROW_DIV).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = q_ptr + e * stride_qe + offs_n[None, :] * stride_qn + offs_k[:, None] * stride_qk
    srow = (offs_n // half_rows) * rows_per_half + (offs_n % half_rows) // block_out  # [BLOCK_N]
    ws_ptrs = s_ptr + e * stride_se + srow * stride_sn
    as_ptrs = as_ptr + a_rows * stride_asm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALE_EACH_TILE:
            a_s = tl.load(as_ptrs + k0 // a_width, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + (k0 // block_in) * stride_sk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * w_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_qk
    if not SCALE_EACH_TILE:
        a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptrs, mask=n_ok, other=0.0)
        acc = acc * a_s[:, None] * w_s[None, :]
    _store_pairs(acc, c_ptr, w_ptr, bias_ptr, rows, row_ok, offs_n, n_ok, e, stride_bias_e,
                 stride_cm, stride_cn, MUL_WEIGHT, HAS_BIAS)


def _k_tiling(wq: QuantProjection, iq: InputQuant, block_k: int) -> tuple[bool, int | None]:
    """(SCALE_EACH_TILE, the K block) for a projection of wq.cols inputs: the table's block_k
    (at least MIN_BLOCK_K) halved until it divides every scale width that varies along K;
    None when no K block of at least MIN_BLOCK_K does."""
    K, block_k = wq.cols, max(block_k, MIN_BLOCK_K)
    widths = [w for w in (wq.block_in, iq.width(K)) if w < K]
    if not widths:
        return False, block_k
    while block_k >= MIN_BLOCK_K and any(w % block_k for w in widths):
        block_k //= 2
    return True, (block_k if block_k >= MIN_BLOCK_K else None)


def w8a8_refusal(w13: QuantProjection, w2: QuantProjection, i13: InputQuant,
                 i2: InputQuant, block_k: int = 128) -> str | None:
    """Why these projections cannot run W8A8 (a scale width along K that no K block of at least
    MIN_BLOCK_K divides), or None."""
    for name, wq, iq in (("w13", w13, i13), ("w2", w2, i2)):
        if wq.kind != "fp8":
            return f"{name} is {wq.kind}, not fp8"
        if _k_tiling(wq, iq, block_k)[1] is None:
            return (f"{name}'s weight block width {wq.block_in} and input group "
                    f"{iq.width(wq.cols)} (of {wq.cols} inputs) need a K block of at least "
                    f"{MIN_BLOCK_K} dividing both")
    return None


def _w8a8_gemm(a_q: torch.Tensor, a_s: torch.Tensor, proj: W8A8Projection,
               bias: torch.Tensor | None, c: torch.Tensor, w: torch.Tensor | None, align,
               row_div: int, cfg: dict[str, int]) -> None:
    """c [P, R] rows of the aligned pairs = A[rows // row_div] @ W[e]^T (+ bias) (* w), A given
    as e4m3 codes a_q and scales a_s (``quantize_rows``, ``activation_quant``)."""
    sorted_ids, block_expert, num_padded = align
    wq, iq = proj.weight, proj.inputs
    N, K = wq.rows, wq.cols
    per_tile, block_k = _k_tiling(wq, iq, cfg["BLOCK_K"])
    if block_k is None:
        raise ValueError(f"triton fused_moe_w8a8: {w8a8_refusal(wq, wq, iq, iq)}")
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    _moe_w8a8_gemm_kernel[grid](
        a_q, a_s, wq.codes, wq.scales, bias if bias is not None else c, c,
        w if w is not None else c, sorted_ids, block_expert, num_padded, N, K, c.shape[0],
        num_m, wq.half_rows, wq.rows_per_half, wq.block_out, wq.block_in, iq.width(K),
        a_q.stride(0), a_s.stride(0), *wq.codes.stride(), *wq.scales.stride(),
        bias.stride(0) if bias is not None else 0, c.stride(0), c.stride(1), ROW_DIV=row_div,
        MUL_WEIGHT=w is not None, HAS_BIAS=bias is not None, SCALE_EACH_TILE=per_tile,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        GROUP_M=cfg["GROUP_M"], num_warps=w8a8_warps(cfg, per_tile),
        num_stages=cfg["num_stages"])


def w8a8_warps(cfg: dict[str, int], per_tile: bool) -> int:
    """The table's warps, raised to 8 for tiles of 64 x 128 or more scaled per K tile: each
    tile's dot is a second [BLOCK_M, BLOCK_N] fp32 tile beside the accumulator (compiled for
    SM90 at 64 x 128 on 4 warps: 242 registers; on 8: 166; tests/build/test_triton_compile_
    fused_moe_w8a8.py)."""
    return dequant_warps(cfg, gathers=False) if per_tile else cfg["num_warps"]


def w8a8_config(cfg: dict[str, int], per_tile: bool) -> dict[str, int]:
    """The table's block sizes, with at most 64 x 128 output tiles where a call scales per K
    tile: at 128 x 128 on 8 warps the two fp32 tiles took 254 registers and spilled 16 B per
    thread (SM90, Triton 3.9). Such tiles are the tables' prefill entries (2,048 tokens on)."""
    if per_tile and cfg["BLOCK_M"] * cfg["BLOCK_N"] > 64 * 128:
        return dict(cfg, BLOCK_M=64)
    return cfg


def fused_moe_w8a8_pairs(x: torch.Tensor, w13: W8A8Projection, w2: W8A8Projection,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                         activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                         b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                         config: dict[str, int] | None = None, device_name: str = "",
                         max_ids: int | None = None) -> None:
    """``fused_moe_quant.fused_moe_quant_pairs`` for FP8 experts with FP8 inputs, in five
    launches: the alignment, x [T, H] quantized per ``w13.inputs``, the gate-up GEMM, the
    activation quantized per ``w2.inputs`` (one kernel), the down GEMM. out [T, K, H] gets
    out[t, k] = topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for ids in [0, G)."""
    _check_inputs(x, w13.weight, w2.weight, topk_weights, topk_ids, out, activation, b13, b2,
                  who="fused_moe_w8a8")
    reason = w8a8_refusal(w13.weight, w2.weight, w13.inputs, w2.inputs)
    if reason is not None:
        raise ValueError(f"triton fused_moe_w8a8: {reason}")
    T, K = topk_ids.shape
    G, H, N = w13.codes.shape[0], x.shape[1], w2.cols
    P = T * K
    if P == 0:
        return
    per_tile = any(_k_tiling(p.weight, p.inputs, MIN_BLOCK_K)[0] for p in (w13, w2))
    cfg = w8a8_config(config or get_moe_config(N, T, device_name), per_tile)
    align = moe_align_block_size(topk_ids, cfg["BLOCK_M"], G, max_ids)
    gate_up = x.new_empty(P, 2 * N)                  # [P, 2N] rows of the call's pairs
    _w8a8_gemm(*quantize_rows(x.contiguous(), w13.inputs), w13, b13, gate_up, None, align, K,
               cfg)
    act_q, act_s = activation_quant(gate_up, align, activation, alpha, limit, cfg["BLOCK_M"],
                                    w2.inputs, N)
    _w8a8_gemm(act_q, act_s, w2, b2, out.view(P, H), topk_weights.reshape(P), align, 1, cfg)

