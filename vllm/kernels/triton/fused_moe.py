"""Triton fused-MoE experts: vLLM's fused_moe design over whatever expert rows it is handed.

The pairs (token t, choice k) of a call are grouped by expert id (``moe_align_block_size`` in
``moe_align.py``: one launch for a decode step), each expert's group padded to a multiple of
BLOCK_M, so every BLOCK_M block of the sorted order belongs to one expert. A grouped GEMM
(``_moe_gemm_kernel``, one program per (M block, N block)) gathers its A rows by sorted pair id
(// top_k for the hidden states), multiplies by that expert's weight block and writes the rows
back at their pair index. Three launches per call:
gate_up = x @ w13[e]^T (+ b13[e]) -> activation (``_moe_act_kernel``) -> out = (act @
w2[e]^T (+ b2[e])) * topk_weight, written straight into the caller's ``out`` [T, K, H]; pairs
with an id outside [0, G) are never written (the expert cache's waves). ``fused_moe`` adds the
sum over K.

Ids index the leading dim of the weights: experts, or the expert cache's slots (the cache maps
expert ids to slot ids before the call; nothing here knows about it). fp32 accumulation; x,
weights and out in one dtype (fp16, bf16 or fp32; fp32 products are IEEE, not TF32). Index
arithmetic is int64 wherever a product can pass 2^31. No host read: every size is fixed by
(T, K, G, BLOCK_M), so a call can be captured in a CUDA graph.

Run on an H100 (2026-11-26): its gpu tests passed, and it ran in the decode benchmark. Also
tested under Triton's interpreter on CPU and compiled for SM90/SM120
(``tests/build/test_triton_compile_fused_moe.py``); block sizes untuned (``fused_moe_config``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.fused_moe_config import get_moe_config
from vllm.kernels.triton.moe_align import moe_align_block_size  # noqa: F401 - re-exported

ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swigluoai": 2, "relu2_no_mul": 3}
"""Activation name (``MoEActivation.name``) -> the kernel's ACT constexpr."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACT_BLOCK_N = 64    # activation columns per program


@triton.jit
def _pair_block(block_expert_ptr, num_padded_ptr, N, num_m_blocks, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (expert e int64, M block, N block): GROUP_M M blocks in a row share B's
    columns; e = -1 for a block past the padded pairs or of no expert (the caller returns)."""
    pid = tl.program_id(0)
    group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // group) * GROUP_M
    group_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m
    live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    e = tl.load(block_expert_ptr + pid_m, mask=live, other=-1).to(tl.int64)
    return e, pid_m, pid_n


@triton.jit
def _pair_rows(sorted_ptr, pid_m, pid_n, N, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block's sorted pair ids rows [BLOCK_M] (P = padding), row_ok, and its output columns
    offs_n [BLOCK_N], n_ok."""
    rows = tl.load(sorted_ptr + pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < P, offs_n, offs_n < N


@triton.jit
def _store_pairs(acc, c_ptr, w_ptr, bias_ptr, rows, row_ok, offs_n, n_ok, e, stride_bias_e,
                 stride_cm, stride_cn, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """C[rows, offs_n] = (acc + bias[e]) (* w[rows]), in C's dtype; padding rows skipped."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e * stride_bias_e + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        acc *= w.to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_gemm_kernel(
        a_ptr, b_ptr, bias_ptr, c_ptr, w_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
        N, K, P, num_m_blocks, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
        stride_bias_e, stride_cm, stride_cn,
        ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[r, n] = (A[r // ROW_DIV] @ B[e]^T + bias[e])[n] (* w[r]) for the sorted pair rows r of
    one M block (expert e) and one N block. A [*, K]; B [G, N, K]; bias [G, N]; C [P, N]."""
    e, pid_m, pid_n = _pair_block(block_expert_ptr, num_padded_ptr, N, num_m_blocks, BLOCK_M,
                                  BLOCK_N, GROUP_M)
    if e < 0:
        return
    rows, row_ok, offs_n, n_ok = _pair_rows(sorted_ptr, pid_m, pid_n, N, P, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (b_ptr + e * stride_be + offs_n[None, :] * stride_bn
              + offs_k[:, None] * stride_bk)         # [BLOCK_K, BLOCK_N] tile of B[e]^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    _store_pairs(acc, c_ptr, w_ptr, bias_ptr, rows, row_ok, offs_n, n_ok, e, stride_bias_e,
                 stride_cm, stride_cn, MUL_WEIGHT, HAS_BIAS)


@triton.jit
def act_values(src, mask, N, alpha, limit, ACT: tl.constexpr):
    """fp32 act of the gate-up values at ``src`` (a tile of pointers): gated (ACT 0-2) reads
    gate there and up N columns on; relu2_no_mul (ACT 3) reads up there."""
    if ACT == 3:
        up = tl.maximum(tl.load(src, mask=mask, other=0.0).to(tl.float32), 0.0)
        return up * up
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + N, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        return gate / (1.0 + tl.exp(-gate)) * up
    if ACT == 1:
        return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    # GPT-OSS: clamp, then (up + 1) * glu. NaN propagates as in torch.clamp (the GPU's min/max
    # would return the other one).
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                    propagate_nan=tl.PropagateNan.ALL)
    return (up + 1.0) * (gate / (1.0 + tl.exp(-(gate * alpha))))


@triton.jit
def _moe_act_kernel(in_ptr, out_ptr, sorted_ptr, num_padded_ptr, N, P, stride_in, stride_out,
                    alpha, limit, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """out[r, :N] = act(in[r]) for the sorted pair rows r of one M block: gated (ACT 0-2) in
    = [gate (N) | up (N)]; relu2_no_mul (ACT 3) in = up (N). fp32 math, one rounding."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_ptr + pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < P)[:, None] & (cols < N)[None, :]
    y = act_values(in_ptr + rows[:, None] * stride_in + cols[None, :], mask, N, alpha, limit,
                   ACT)
    dst = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=mask)


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, c: torch.Tensor,
          w: torch.Tensor | None, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          row_div: int, cfg: dict[str, int]) -> None:
    """c [P, N] rows of the aligned pairs = a[rows // row_div] @ b[e]^T (+ bias) (* w)."""
    sorted_ids, block_expert, num_padded = align
    N, K = b.shape[1], b.shape[2]
    num_m = block_expert.numel()
    block_k = cfg["BLOCK_K"] if a.dtype != torch.float32 else max(16, cfg["BLOCK_K"] // 2)
    grid = (num_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, b, bias if bias is not None else b, c, w if w is not None else a, sorted_ids,
        block_expert, num_padded, N, K, c.shape[0], num_m, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2), bias.stride(0) if bias is not None else 0,
        c.stride(0), c.stride(1), ROW_DIV=row_div, MUL_WEIGHT=w is not None,
        HAS_BIAS=bias is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _activation(gate_up: torch.Tensor, act: torch.Tensor, align, activation: str, alpha: float,
                limit: float, block_m: int) -> None:
    sorted_ids, block_expert, num_padded = align
    N = act.shape[1]
    grid = (block_expert.numel(), triton.cdiv(N, ACT_BLOCK_N))
    _moe_act_kernel[grid](gate_up, act, sorted_ids, num_padded, N, act.shape[0],
                          gate_up.stride(0), act.stride(0), float(alpha), float(limit),
                          ACT=ACTIVATION_CODES[activation], BLOCK_M=block_m,
                          BLOCK_N=ACT_BLOCK_N)


def host_readable(t, device: torch.device) -> bool:
    """Whether a kernel on ``device`` can read ``t`` in place although it is host memory: pinned
    (page-locked) host tensors are mapped into a CUDA device's address space (UVA), and Triton
    passes a kernel their device address. The expert-offload benchmark's ``uva`` design runs the
    experts this way, straight from the host store. Run on an H100 (2026-11-26): its gpu test
    passed, and the uva design ran."""
    return device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()


def _check_inputs(x, w13, w2, topk_weights, topk_ids, out, activation, b13, b2) -> None:
    """Clear errors for shapes, dtypes and devices the kernels cannot take."""
    def fail(msg: str):
        raise ValueError(f"triton fused_moe: {msg}")
    if activation not in ACTIVATION_CODES:
        fail(f"activation={activation!r} is invalid: must be one of {list(ACTIVATION_CODES)}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        fail(f"need x [T, H], w13 [G, 2N or N, H], w2 [G, H, N]; got x {tuple(x.shape)}, "
             f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    (T, H), (G, H2, N) = x.shape, w2.shape
    rows = 2 * N if activation != "relu2_no_mul" else N
    if tuple(w13.shape) != (G, rows, H) or H2 != H:
        fail(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)} "
             f"and activation {activation!r}: need w13 ({G}, {rows}, {H}), w2 ({G}, {H}, {N})")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        fail(f"need topk_ids and topk_weights [T={T}, K]; got {tuple(topk_ids.shape)} and "
             f"{tuple(topk_weights.shape)}")
    if out is not None and (tuple(out.shape) != (T, topk_ids.shape[1], H) or
                            not out.is_contiguous()):
        fail(f"out must be a contiguous [T, K, H] = {(T, topk_ids.shape[1], H)} tensor, got "
             f"{tuple(out.shape)} with strides {out.stride()}")
    if x.dtype not in DTYPES:
        fail(f"x.dtype={x.dtype} is not supported: must be one of {list(DTYPES)}")
    named = {"w13": w13, "w2": w2, "out": out, "b13": b13, "b2": b2}
    for name, t in named.items():
        if t is not None and (t.dtype != x.dtype or not (
                t.device == x.device or name != "out" and host_readable(t, x.device))):
            fail(f"{name} is {t.dtype} on {t.device}; x is {x.dtype} on {x.device} (weights may "
                 "also be pinned host memory when x is on CUDA)")
    if topk_ids.device != x.device or topk_weights.device != x.device:
        fail(f"topk_ids ({topk_ids.device}) and topk_weights ({topk_weights.device}) must be on "
             f"x's device {x.device}")
    for name, t, want in (("b13", b13, (G, rows)), ("b2", b2, (G, H))):
        if t is not None and (tuple(t.shape) != want or t.stride(-1) != 1):
            fail(f"{name} must be a row-contiguous {want} tensor, got {tuple(t.shape)}")


def fused_moe_pairs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                    activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    config: dict[str, int] | None = None, device_name: str = "",
                    max_ids: int | None = None) -> None:
    """out[t, k] = topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for ids in [0, G); other
    pairs untouched. x [T, H]; w13 [G, 2N, H] ([gate; up]; [G, N, H] up alone for
    relu2_no_mul); w2 [G, H, N]; optional b13 [G, 2N or N], b2 [G, H]; out [T, K, H]
    contiguous. ``config``: block sizes (default: ``get_moe_config`` for ``device_name``).
    ``max_ids``: at most that many distinct ids (``moe_align_block_size``: the grids' size)."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids, out, activation, b13, b2)
    T, K = topk_ids.shape
    G, H, N = w2.shape
    P = T * K
    if P == 0:
        return
    cfg = config or get_moe_config(N, T, device_name)
    align = moe_align_block_size(topk_ids, cfg["BLOCK_M"], G, max_ids)
    gate_up = x.new_empty(P, w13.shape[1])           # [P, 2N] rows of the call's pairs
    _gemm(x, w13, b13, gate_up, None, align, K, cfg)
    act = x.new_empty(P, N)                          # [P, N]
    _activation(gate_up, act, align, activation, alpha, limit, cfg["BLOCK_M"])
    w = topk_weights.reshape(P)                      # [P] pair weights
    _gemm(act, w2, b2, out.view(P, H), w, align, 1, cfg)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
              limit: float = 7.0, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              config: dict[str, int] | None = None, device_name: str = "") -> torch.Tensor:
    """x [T, H] -> [T, H]: ``fused_moe_pairs`` into zeros, summed over the K pairs of each
    token (skipped pairs add 0)."""
    T, K = topk_ids.shape
    out = x.new_zeros(T, K, x.shape[-1])             # [T, K, H]
    fused_moe_pairs(x, w13, w2, topk_weights, topk_ids, out, activation, alpha, limit, b13, b2,
                    config, device_name)
    return out.sum(dim=1)
