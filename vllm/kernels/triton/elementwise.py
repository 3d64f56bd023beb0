"""A decoder layer's small ops as one Triton launch each (CUDA): RMSNorm, the gated activations
(silu / gelu of gate times up) and rotary embedding of q and k together (with Qwen3's per-head
q/k RMSNorm before it: ``qk_norm_rotary``).

Run on an H100 (2026-11-26): its gpu tests passed, and it ran in the decode benchmark. Also
checked under Triton's interpreter against torch references
(``tests/kernels/triton/test_elementwise.py``) and compiled for SM90 / SM120
(``tests/build/test_triton_compile_elementwise.py``).

Semantics are the layers' torch paths (``vllm/model_executor/layers``):
- ``rms_norm``: Hugging Face's: x in float32 times 1 / sqrt(mean(x^2) + eps) (IEEE sqrt and
  division), rounded to x's dtype, then times weight (x's dtype: one rounding of the product).
  ``add_rms_norm``: the same of s = x + residual (rounded to the dtype once, as torch's add),
  returning s too: the pre-norm block's residual add fused into the next norm.
- ``silu_and_mul`` / ``gelu_and_mul``: act(gate) in float32 rounded to the dtype, times up,
  rounded (torch's two roundings). On a GPU silu's exp and division are the fast approximate
  instructions (ex2.approx, div.full: 2 ulp in float32), so fp16 / bf16 results may differ from
  torch's by an ulp now and then; the interpreter computes them exactly.
- ``rotary_embedding``: neox rotate-half over the first ``rotary_dim`` dims of each head, the rest
  copied; a = position * inv_freq (float32), c = cos(a) * scaling, s = sin(a) * scaling with
  libdevice's precise sin/cos (positions reach 1e5 radians, where the approximate instructions
  are wrong), the rotation in float32 (fma(x1, c, -(x2 * s)), as ``kernels/cpu/rotary.c``) and one
  rounding; torch rounds c and s to the dtype first, so fp16/bf16 differ from it by an ulp.
Every op: any number of rows (grid over rows; 0 rows launch nothing), rows may be strided (the
last dim contiguous), float32 / float16 / bfloat16, out of place, no host read (a launch can be
captured in a CUDA graph). Bad input raises ValueError naming the value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes every op takes."""
LAUNCH_OPTIONS = {"enable_fp_fusion": True}
"""Compile options of every launch (FMA contraction on, whatever Triton's default; tests/build
compiles with these)."""
MAX_NORM_BLOCK = 4096   # columns per chunk of an RMSNorm row (wider rows loop)
MAX_ACT_BLOCK = 1024    # columns per program of the gated activations
MAX_ROPE_TILE = 2048    # heads x half-dims per rotary program
ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
"""Gated activation name -> the kernel's ACT code."""


@triton.jit
def _norm_input(x_row, r_row, s_row, c, N, HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """Columns c of the row to normalise, in float32: x, or x + residual rounded to x's dtype
    once (torch's add: the sum in float32, one rounding), stored to the sum row if STORE_SUM."""
    x = tl.load(x_row + c, mask=c < N, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_row + c, mask=c < N, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(s_row.dtype.element_ty)
        if STORE_SUM:
            tl.store(s_row + c, x, mask=c < N)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, N, x_stride, r_stride, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Row r of x [R, N] (row stride x_stride) -> out [R, N] contiguous; grid (R,). With
    HAS_RESIDUAL the row normalised is x + residual (row stride r_stride), rounded to the dtype
    and also written to sum [R, N] contiguous (the next residual)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * x_stride, out_ptr + row * N
    r_row, s_row = r_ptr + row * r_stride, sum_ptr + row * N
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = _norm_input(x_row, r_row, s_row, c, N, HAS_RESIDUAL, True)
        acc += x * x
    mean = tl.div_rn(tl.sum(acc, axis=0), N * 1.0)            # N may be a constexpr 1
    inv = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    for start in range(0, N, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = _norm_input(x_row, r_row, s_row, c, N, HAS_RESIDUAL, False)
        y = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)     # HF: cast back first
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(out_row + c, (y * w).to(out_ptr.dtype.element_ty), mask=c < N)


@triton.jit
def _act(g, ACT: tl.constexpr):
    """float32 activation of g: 0 silu, 1 gelu (erf), 2 gelu (tanh approximation)."""
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * inner))        # 0.5 g (1 + tanh(inner)), no cancellation
    return a


@triton.jit
def _act_and_mul_kernel(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, ACT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """gate, up [R, N] (row strides g_stride, u_stride) -> out [R, N]; grid (R, cdiv(N, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    g = tl.load(g_ptr + row * g_stride + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + c, mask=m, other=0.0).to(tl.float32)
    a = _act(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + c, (a * u).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _load_heads(q_ptr, k_ptr, q_off, k_off, cols, mq, mk):
    """[HB, C] float32: q's row where mq, else k's (each lane reads one tensor)."""
    xq = tl.load(q_ptr + q_off[:, None] + cols[None, :], mask=mq, other=0.0)
    xk = tl.load(k_ptr + k_off[:, None] + cols[None, :], mask=mk, other=0.0)
    return tl.where(mq, xq, xk).to(tl.float32)


@triton.jit
def _store_heads(qo_ptr, ko_ptr, qo_off, ko_off, cols, mq, mk, y):
    tl.store(qo_ptr + qo_off[:, None] + cols[None, :], y.to(qo_ptr.dtype.element_ty), mask=mq)
    tl.store(ko_ptr + ko_off[:, None] + cols[None, :], y.to(ko_ptr.dtype.element_ty), mask=mk)


@triton.jit
def _head_norm(x, inv, qw_ptr, kw_ptr, cols, mq, mk, DT: tl.constexpr):
    """[HB, C] float32 columns cols of each head times its inv (1 / rms), rounded to DT, times
    q_norm's weight on q's lanes or k_norm's on k's, rounded: RMSNorm's two roundings."""
    y = (x * inv).to(DT).to(tl.float32)
    wq = tl.load(qw_ptr + cols[None, :], mask=mq, other=0.0)
    wk = tl.load(kw_ptr + cols[None, :], mask=mk, other=0.0)
    return (y * tl.where(mq, wq, wk).to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def _rotary_kernel(pos_ptr, inv_ptr, scaling, q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, eps,
                   q_stride, k_stride, HQ, HK, D: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
                   HB: tl.constexpr, HAS_NORM: tl.constexpr):
    """Token t, heads [HB * j, HB * (j + 1)) of q's HQ then k's HK heads; grid (T, cdiv(HQ + HK,
    HB)). q [T, HQ * D], k [T, HK * D] (row strides q_stride, k_stride) -> qo, ko contiguous.
    Dims [0, HALF) pair with [HALF, 2 * HALF); dims [2 * HALF, D) (PASS of them) are copied.
    HAS_NORM: each head is first RMS-normalised over its D dims (eps; weights qw [D] for q's
    heads, kw [D] for k's), rounded to the dtype as RMSNorm rounds, then rotated."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)                       # [HB]
    is_q, is_k = h < HQ, (h >= HQ) & (h < HQ + HK)
    hk = tl.where(is_k, h - HQ, 0).to(tl.int64)
    hq = tl.where(is_q, h, 0).to(tl.int64)
    q_off, k_off = t * q_stride + hq * D, t * k_stride + hk * D
    qo_off, ko_off = t * (HQ * D) + hq * D, t * (HK * D) + hk * D
    DT: tl.constexpr = qo_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK_HALF)
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i, mask=i < HALF, other=0.0)
    c = (tl.cos(ang) * scaling)[None, :]                               # [1, BLOCK_HALF]
    s = (tl.sin(ang) * scaling)[None, :]
    mq = is_q[:, None] & (i < HALF)[None, :]
    mk = is_k[:, None] & (i < HALF)[None, :]
    x1 = _load_heads(q_ptr, k_ptr, q_off, k_off, i, mq, mk)
    x2 = _load_heads(q_ptr, k_ptr, q_off, k_off, i + HALF, mq, mk)
    if PASS > 0:
        j = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pq = is_q[:, None] & (j < D)[None, :]
        pk = is_k[:, None] & (j < D)[None, :]
        xp = _load_heads(q_ptr, k_ptr, q_off, k_off, j, pq, pk)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)        # [HB]; masked lanes 0
        if PASS > 0:
            ss += tl.sum(xp * xp, axis=1)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, D * 1.0) + eps))[:, None]
        x1 = _head_norm(x1, inv, qw_ptr, kw_ptr, i, mq, mk, DT)
        x2 = _head_norm(x2, inv, qw_ptr, kw_ptr, i + HALF, mq, mk, DT)
        if PASS > 0:
            xp = _head_norm(xp, inv, qw_ptr, kw_ptr, j, pq, pk, DT)
    _store_heads(qo_ptr, ko_ptr, qo_off, ko_off, i, mq, mk, x1 * c - x2 * s)
    _store_heads(qo_ptr, ko_ptr, qo_off, ko_off, i + HALF, mq, mk, x2 * c + x1 * s)
    if PASS > 0:
        _store_heads(qo_ptr, ko_ptr, qo_off, ko_off, j, pq, pk, xp)


def _check_dtype(op: str, what: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"triton {op}: {what} dtype={t.dtype} is not supported: must be one of "
                         f"{[str(d) for d in DTYPES]}")


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] -> [R, n] with unit column stride (a view where possible)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 or n <= 1 else t2.contiguous()


def _num_warps(elements: int) -> int:
    return max(1, min(8, elements // 256))


def _check_norm_weight(op: str, x: torch.Tensor, weight: torch.Tensor, H: int) -> None:
    if weight.dtype != x.dtype or weight.numel() != H or weight.device != x.device:
        raise ValueError(f"triton {op}: weight ({weight.dtype}, {weight.numel()} elements, "
                         f"{weight.device}) must be x's dtype {x.dtype}, {H} elements, on "
                         f"{x.device}")


def _launch_norm(x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, total: torch.Tensor | None) -> None:
    R, H = x2.shape
    if R and H:
        block = min(triton.next_power_of_2(H), MAX_NORM_BLOCK)
        _rms_norm_kernel[(R,)](x2, x2 if r2 is None else r2, weight.contiguous(), out,
                               out if total is None else total, H, x2.stride(0),
                               x2.stride(0) if r2 is None else r2.stride(0), float(eps),
                               BLOCK=block, HAS_RESIDUAL=r2 is not None,
                               num_warps=_num_warps(block), **LAUNCH_OPTIONS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] of x's dtype and device -> [..., H] (module docstring)."""
    H = x.shape[-1] if x.dim() else 0
    _check_dtype("rms_norm", "x", x)
    _check_norm_weight("rms_norm", x, weight, H)
    x2 = _rows(x, H)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x2, None, weight, eps, out, None)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] of one dtype and device -> (rms_norm(s), s) with s = x + residual
    rounded to the dtype (bitwise torch's ``x + residual``, then ``rms_norm`` of it), both
    [..., H] contiguous: a decoder layer's residual add and the next norm in one launch."""
    H = x.shape[-1] if x.dim() else 0
    _check_dtype("add_rms_norm", "x", x)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"triton add_rms_norm: residual ({tuple(residual.shape)}, "
                         f"{residual.dtype}, {residual.device}) must match x "
                         f"({tuple(x.shape)}, {x.dtype}, {x.device})")
    _check_norm_weight("add_rms_norm", x, weight, H)
    x2, r2 = _rows(x, H), _rows(residual, H)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x2, r2, weight, eps, out, total)
    return out.view(x.shape), total.view(x.shape)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up: gate, up [..., N] of one dtype and device -> [..., N] contiguous.
    ``act`` is a key of ``ACTS``."""
    if act not in ACTS:
        raise ValueError(f"triton act_and_mul: act={act!r} is not supported: must be one of "
                         f"{sorted(ACTS)}")
    _check_dtype("act_and_mul", "gate", gate)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"triton act_and_mul: gate {tuple(gate.shape)} {gate.dtype} and up "
                         f"{tuple(up.shape)} {up.dtype} must match (shape, dtype, device)")
    N = gate.shape[-1] if gate.dim() else 0
    g2, u2 = _rows(gate, N), _rows(up, N)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] and N:
        block = min(triton.next_power_of_2(N), MAX_ACT_BLOCK)
        _act_and_mul_kernel[(g2.shape[0], triton.cdiv(N, block))](
            g2, u2, out, N, g2.stride(0), u2.stride(0), ACT=ACTS[act], BLOCK=block,
            num_warps=_num_warps(block), **LAUNCH_OPTIONS)
    return out.view(gate.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``, [..., N] each."""
    return act_and_mul(gate, up, "silu")


def gelu_and_mul(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(gate, approximate=approximate) * up``, [..., N] each; approximate "none"|"tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"triton gelu_and_mul: approximate={approximate!r} is invalid: must be "
                         "'none' or 'tanh'")
    return act_and_mul(gate, up, "gelu" if approximate == "none" else "gelu_tanh")


def _check_rotary(positions, q, k, inv_freq, head_dim: int, rotary_dim: int) -> None:
    _check_dtype("rotary_embedding", "q", q)
    T = positions.shape[0] if positions.dim() == 1 else -1
    if positions.dtype not in (torch.int32, torch.int64) or T < 0:
        raise ValueError(f"triton rotary_embedding: positions must be [T] int32/int64, got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"triton rotary_embedding: rotary_dim={rotary_dim} is invalid: must be "
                         f"even and in [0, head_dim={head_dim}]")
    if (q.dim() != 2 or k.dim() != 2 or q.shape[0] != T or k.shape[0] != T
            or q.shape[1] % head_dim or k.shape[1] % head_dim or q.dtype != k.dtype):
        raise ValueError(f"triton rotary_embedding: q {tuple(q.shape)} {q.dtype}, k "
                         f"{tuple(k.shape)} {k.dtype} must be [T={T}, heads * {head_dim}] of "
                         "one dtype")
    if inv_freq.dtype != torch.float32 or inv_freq.numel() != rotary_dim // 2:
        raise ValueError(f"triton rotary_embedding: inv_freq ({inv_freq.dtype}, "
                         f"{inv_freq.numel()} elements) must be float32 [rotary_dim / 2 = "
                         f"{rotary_dim // 2}]")
    if not (positions.device == q.device == k.device == inv_freq.device):
        raise ValueError(f"triton rotary_embedding: positions ({positions.device}), q "
                         f"({q.device}), k ({k.device}), inv_freq ({inv_freq.device}) must "
                         "share one device")


def _launch_rotary(positions, q, k, inv_freq, scaling, head_dim, rotary_dim, norm=None):
    """norm: None, or (q_weight, k_weight, eps) of the heads' RMSNorm before the rotation."""
    q2, k2 = _rows(q, q.shape[1]), _rows(k, k.shape[1])
    qo = torch.empty(q2.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k2.shape, dtype=k.dtype, device=k.device)
    HQ, HK, T = q.shape[1] // head_dim, k.shape[1] // head_dim, q.shape[0]
    if T == 0 or HQ + HK == 0:
        return qo, ko
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    block_half = triton.next_power_of_2(max(half, 1))
    hb = min(triton.next_power_of_2(HQ + HK), max(1, MAX_ROPE_TILE // block_half))
    qw, kw, eps = norm if norm is not None else (qo, ko, 0.0)     # unread without HAS_NORM
    _rotary_kernel[(T, triton.cdiv(HQ + HK, hb))](
        positions.contiguous(), inv_freq.contiguous(), float(scaling), q2, k2, qo, ko,
        qw.contiguous(), kw.contiguous(), float(eps), q2.stride(0), k2.stride(0), HQ, HK,
        D=head_dim, HALF=half, BLOCK_HALF=block_half, PASS=rest,
        BLOCK_PASS=triton.next_power_of_2(max(rest, 1)), HB=hb, HAS_NORM=norm is not None,
        num_warps=_num_warps(hb * block_half), **LAUNCH_OPTIONS)
    return qo, ko


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     inv_freq: torch.Tensor, scaling: float, head_dim: int,
                     rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int; q [T, Hq * head_dim], k [T, Hkv * head_dim] (one dtype); inv_freq
    [rotary_dim / 2] float32 -> new (q, k), contiguous, same shapes. One launch for both."""
    _check_rotary(positions, q, k, inv_freq, head_dim, rotary_dim)
    return _launch_rotary(positions, q, k, inv_freq, scaling, head_dim, rotary_dim)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   inv_freq: torch.Tensor, scaling: float, head_dim: int,
                   rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` of q and k whose heads are first RMS-normalised over head_dim with
    q_weight / k_weight [head_dim] (q's dtype; Qwen3's q_norm and k_norm, one eps): one launch
    instead of three. Each head as ``rms_norm`` of it would give, to rounding of the sum of
    squares (summed in another order), then rotated as ``rotary_embedding``."""
    _check_rotary(positions, q, k, inv_freq, head_dim, rotary_dim)
    _check_norm_weight("qk_norm_rotary", q, q_weight, head_dim)
    _check_norm_weight("qk_norm_rotary", k, k_weight, head_dim)
    return _launch_rotary(positions, q, k, inv_freq, scaling, head_dim, rotary_dim,
                          norm=(q_weight, k_weight, eps))
