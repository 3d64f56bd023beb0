"""Triton fused-MoE GEMMs over FP4 (e2m1) experts: NVFP4 and MXFP4, weight-only.

The design of ``fused_moe_quant.py`` (same ``moe_align_block_size``, activation kernel, three
launches and pair contract; its input checks), with one grouped GEMM (``_moe_fp4_gemm_kernel``)
whose B tile is dequantized in registers right before the ``tl.dot``: each weight is
``e2m1(code) * (scale * global)`` in float32, rounded to the activation dtype, exactly the value
nvfp4.py's / mxfp4.py's ``dequantize`` gives the ``torch`` backend (and qgemm_fp4.h's S and w),
so the two differ only by summation order. Activations stay in the model dtype (W4A16); fp32
accumulation. The scale bytes are decoded with integer arithmetic (no fp8 conversion
instruction, so no minimum SM beyond tl.dot's own).

Layouts (published, read in place; ``Fp4Projection``): a projection W[g] [R, C] has codes uint8
[G, R, C/2], input column c in byte c // 2, low nibble for even c (ModelOpt NVFP4 ``weight``,
compressed-tensors ``weight_packed``; GPT-OSS ``blocks`` [G, R, C/32, 16] viewed as [G, R, C/2]:
the same bytes); e2m1 code = sign (bit 3) | magnitude index (0, .5, 1, 1.5, 2, 3, 4, 6).
NVFP4: scales e4m3 [G, R, C/16], global scales float32 [G, HALVES] (``weight_scale_2``, one per
half: w13's gate and up, w2's only), W = e2m1 * (e4m3 * global[r // half_rows]).
MXFP4: scales e8m0 uint8 [G, R, C/32], 2^(s - 127) (0 is the subnormal 2^-127, 255 NaN), no
global scale. Every tensor is indexed by the same id as the codes (expert or cache slot).
Index arithmetic is int64 wherever a product can pass 2^31; no host read (CUDA-graph safe).

Run on an H100 (2026-11-26): its gpu tests passed for mxfp4 (bf16, fp16, fp32) and nvfp4 fp32;
nvfp4 bf16 and fp16 failed the tolerance (the test's outputs too large; its data rescaled
since, not re-run). Also tested under Triton's interpreter on CPU and compiled for SM90/SM120
(tests/build/test_triton_compile_fused_moe_fp4.py); block sizes are the untuned unquantized
tables (``fused_moe_config``), with BLOCK_K at least one scale group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.fused_moe import _pair_block, _pair_rows, _store_pairs
from vllm.kernels.triton.fused_moe_quant import (_block_k, _check_inputs, dequant_warps,
                                                 load_packed_codes, run_pairs)

FP4_GROUPS = {"nvfp4": 16, "mxfp4": 32}
"""Fp4Projection.kind -> inputs per scale byte (the GEMM's GROUP constexpr)."""


@dataclass(frozen=True)
class Fp4Projection:
    """One projection W[g] [R, C] of G experts or slots (layouts: the module docstring)."""
    kind: str
    codes: torch.Tensor
    """uint8 [G, R, C/2]: input c in byte c // 2, low nibble when c is even."""
    scales: torch.Tensor
    """[G, R, C / group]: float8_e4m3fn (nvfp4; uint8 bytes accepted) or uint8 e8m0 (mxfp4)."""
    global_scales: torch.Tensor | None = None
    """nvfp4: float32 [G, HALVES]; row r uses column r // (R / HALVES). mxfp4: None."""

    @property
    def rows(self) -> int:
        return self.codes.shape[1]

    @property
    def cols(self) -> int:
        return self.codes.shape[2] * 2

    @property
    def group(self) -> int:
        return FP4_GROUPS[self.kind]


@triton.jit
def _with_sign(mag, sign_bit):
    """float32 mag with int32 sign_bit (0 or 1 << 31) ORed into its bits. Not tl.where(s, -mag,
    mag): Triton 3.6 (the GPU image's) lowers float negation as 0 - x, which makes -0 (e2m1
    code 8, e4m3 0x80) +0."""
    return (mag.to(tl.int32, bitcast=True) | sign_bit).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(code):
    """int32 codes in [0, 16) -> float32, exact: magnitude m < 2 is m / 2, else
    (2 + (m & 1)) * 2^((m >> 1) - 1) / 2; bit 3 the sign (code 8 is -0)."""
    m = code & 7
    twice = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    v = twice.to(tl.float32) * 0.5
    return _with_sign(v, (code & 8) << 28)


@triton.jit
def _e4m3_to_f32(b):
    """int32 e4m3fn bytes -> float32, exact: exponent field 0 is subnormal (mantissa * 2^-9);
    else the f32 bits of the exponent rebased by 127 - 7; |b| 0x7F is NaN."""
    mag_bits = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, ((b & 0x7F) << 20) + (120 << 23))
    mag = tl.where((b & 0x78) == 0, (b & 7).to(tl.float32) * 0.001953125,
                   mag_bits.to(tl.float32, bitcast=True))
    return _with_sign(mag, (b & 0x80) << 24)


@triton.jit
def _e8m0_to_f32(b):
    """int32 e8m0 bytes -> 2^(b - 127) as float32 bits (0: subnormal 2^-127; 255: NaN)."""
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_tile(q_ptr, s_ptr, gs_ptr, e, k0, offs_n, n_ok, K, half_rows, stride_qe, stride_qn,
              stride_qk, stride_se, stride_sn, stride_sk, stride_ge, stride_gh,
              E8M0: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """fp32 [BLOCK_K, BLOCK_N] tile of W[e]^T, input columns k0.. and output rows offs_n (int64);
    e int64. GROUP divides BLOCK_K and K, so the tile holds whole scale groups."""
    codes = load_packed_codes(q_ptr, e, k0, offs_n, n_ok, K, stride_qe, stride_qn, stride_qk,
                              2, BLOCK_K, BLOCK_N)                    # two codes per byte
    vals = _e2m1_to_f32(codes)                                        # [BLOCK_K, BLOCK_N]
    GPT: tl.constexpr = BLOCK_K // GROUP                                # scale groups per tile
    offs_g = k0 // GROUP + tl.arange(0, GPT)
    sb = tl.load(s_ptr + e * stride_se + offs_n[None, :] * stride_sn
                 + offs_g[:, None] * stride_sk,
                 mask=(offs_g < K // GROUP)[:, None] & n_ok[None, :], other=0).to(tl.int32)
    if E8M0:
        s = _e8m0_to_f32(sb)                                            # [GPT, BLOCK_N]
    else:
        gs = tl.load(gs_ptr + e * stride_ge + (offs_n // half_rows) * stride_gh, mask=n_ok,
                     other=0.0)
        s = _e4m3_to_f32(sb) * gs[None, :]                              # scale * global
    s = tl.reshape(tl.broadcast_to(s[:, None, :], (GPT, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
    return vals * s


@triton.jit
def _moe_fp4_gemm_kernel(
        a_ptr, q_ptr, s_ptr, gs_ptr, bias_ptr, c_ptr, w_ptr, sorted_ptr, block_expert_ptr,
        num_padded_ptr, N, K, P, num_m_blocks, half_rows, stride_am, stride_ak, stride_qe,
        stride_qn, stride_qk, stride_se, stride_sn, stride_sk, stride_ge, stride_gh,
        stride_bias_e, stride_cm, stride_cn,
        E8M0: tl.constexpr, GROUP: tl.constexpr, ROW_DIV: tl.constexpr,
        MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr):
    """C[r, n] = (A[r // ROW_DIV] @ W[e]^T + bias[e])[n] (* w[r]) for the sorted pair rows r of
    one M block (slot e) and one N block; W[e] [N, K] dequantized per tile (E8M0 0: nvfp4,
    1: mxfp4). A [*, K] in the activation dtype; C [P, N]."""
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
        b = _fp4_tile(q_ptr, s_ptr, gs_ptr, e, k0, offs_n, n_ok, K, half_rows, stride_qe,
                      stride_qn, stride_qk, stride_se, stride_sn, stride_sk, stride_ge,
                      stride_gh, E8M0, GROUP, BLOCK_K, BLOCK_N)
        # Rounded to the activation dtype, as the torch backend's dequantize: then the dot.
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    _store_pairs(acc, c_ptr, w_ptr, bias_ptr, rows, row_ok, offs_n, n_ok, e, stride_bias_e,
                 stride_cm, stride_cn, MUL_WEIGHT, HAS_BIAS)


def _fp4_gemm(a: torch.Tensor, wq: Fp4Projection, bias: torch.Tensor | None, c: torch.Tensor,
              w: torch.Tensor | None, align, row_div: int, cfg: dict[str, int]) -> None:
    """c [P, R] rows of the aligned pairs = a[rows // row_div] @ W[e]^T (+ bias) (* w)."""
    sorted_ids, block_expert, num_padded = align
    N, K = wq.rows, wq.cols
    num_m = block_expert.numel()
    block_k = max(_block_k(a.dtype, cfg), wq.group)  # whole scale groups per tile (powers of 2)
    gs = wq.global_scales
    half_rows = N // gs.shape[1] if gs is not None else N
    scales = wq.scales.view(torch.uint8)             # e4m3 decoded from its bits
    grid = (num_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    _moe_fp4_gemm_kernel[grid](
        a, wq.codes, scales, gs if gs is not None else a, bias if bias is not None else a, c,
        w if w is not None else a, sorted_ids, block_expert, num_padded, N, K, c.shape[0],
        num_m, half_rows, a.stride(0), a.stride(1), *wq.codes.stride(), *scales.stride(),
        *(gs.stride() if gs is not None else (0, 0)),
        bias.stride(0) if bias is not None else 0, c.stride(0), c.stride(1),
        E8M0=wq.kind == "mxfp4", GROUP=wq.group, ROW_DIV=row_div, MUL_WEIGHT=w is not None,
        HAS_BIAS=bias is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        GROUP_M=cfg["GROUP_M"], num_warps=dequant_warps(cfg, gathers=False),
        num_stages=cfg["num_stages"])


def check_fp4_projection(name: str, wq: Fp4Projection, rows: int, cols: int, G: int,
                         device: torch.device) -> None:
    """Clear errors for a projection the kernel cannot read as ``Fp4Projection`` says."""
    def fail(msg: str):
        raise ValueError(f"triton fused_moe_fp4: {name} {msg}")
    if wq.kind not in FP4_GROUPS:
        fail(f"kind={wq.kind!r} is invalid: must be one of {list(FP4_GROUPS)}")
    gsz = wq.group
    if wq.codes.dtype != torch.uint8 or wq.codes.dim() != 3 or \
            (wq.codes.shape[0], wq.rows, wq.cols) != (G, rows, cols):
        fail(f"codes are {tuple(wq.codes.shape)} {wq.codes.dtype}; need torch.uint8 "
             f"({G}, {rows}, {cols // 2})")
    if cols % gsz:
        fail(f"has {cols} input columns, not a multiple of the {wq.kind} group {gsz}")
    want = (torch.float8_e4m3fn, torch.uint8) if wq.kind == "nvfp4" else (torch.uint8,)
    if wq.scales.dtype not in want or tuple(wq.scales.shape) != (G, rows, cols // gsz):
        fail(f"scales are {tuple(wq.scales.shape)} {wq.scales.dtype}; need "
             f"{' or '.join(map(str, want))} ({G}, {rows}, {cols // gsz})")
    gs = wq.global_scales
    if (wq.kind == "nvfp4") != (gs is not None):
        fail("global_scales are required by nvfp4 and absent from mxfp4")
    if gs is not None and (gs.dtype != torch.float32 or gs.dim() != 2 or gs.shape[0] != G or
                           gs.shape[1] not in (1, 2) or rows % gs.shape[1]):
        fail(f"global_scales are {tuple(gs.shape)} {gs.dtype}; need float32 [G={G}, 1 or 2] "
             f"dividing the {rows} rows")
    for what, t in (("codes", wq.codes), ("scales", wq.scales), ("global_scales", gs)):
        if t is not None and t.device != device:
            fail(f"{what} are on {t.device}; need {device}")


def fused_moe_fp4_pairs(x: torch.Tensor, w13: Fp4Projection, w2: Fp4Projection,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                        activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                        config: dict[str, int] | None = None, device_name: str = "",
                        max_ids: int | None = None) -> None:
    """``fused_moe_quant_pairs`` on FP4 experts: out[t, k] = topk_weights[t, k] *
    expert_{topk_ids[t, k]}(x[t]) for ids in [0, G); other pairs untouched. x [T, H];
    w13 [G, 2N, H] ([gate; up]) and w2 [G, H, N] as Fp4Projections; optional biases
    b13 [G, 2N], b2 [G, H] in x's dtype; out [T, K, H] contiguous. Gated activations only."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids, out, activation, b13, b2,
                  check=check_fp4_projection, who="fused_moe_fp4")
    run_pairs(_fp4_gemm, x, w13, w2, topk_weights, topk_ids, out, activation, alpha, limit,
              b13, b2, config, device_name, max_ids)


def fused_moe_fp4(x: torch.Tensor, w13: Fp4Projection, w2: Fp4Projection,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
                  alpha: float = 1.702, limit: float = 7.0, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, config: dict[str, int] | None = None,
                  device_name: str = "") -> torch.Tensor:
    """x [T, H] -> [T, H]: ``fused_moe_fp4_pairs`` into zeros, summed over each token's K."""
    T, K = topk_ids.shape
    out = x.new_zeros(T, K, x.shape[-1])             # [T, K, H]
    fused_moe_fp4_pairs(x, w13, w2, topk_weights, topk_ids, out, activation, alpha, limit,
                        b13, b2, config, device_name)
    return out.sum(dim=1)
