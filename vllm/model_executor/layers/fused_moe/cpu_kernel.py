"""Expert computation with the C kernel in ``vllm/kernels/cpu/moe_experts.c`` (CPU only).

The kernel reads each expert's weights packed for its register tiles: input dim first, in
column blocks that are each one contiguous stream (``vllm/kernels/cpu/gemm.h``).
``vllm/kernels/cpu/ops.prepack`` makes that layout once per expert at load (the quant method's
``process_expert``), so the host store and the slots hold it too: w13 [E, 2N, K] -> [E, 2N*K],
w2 [E, K, N] -> [E, K*N]; expert biases (w13_bias [E, 2N], w2_bias [E, K]) stay as loaded.
Non-gated experts (``relu2_no_mul``) have N rows in w13 and w13_bias instead of 2N.
One call per layer (or per expert-cache wave): pairs are grouped by expert inside the kernel,
each expert's weights are read once per call, and each pair's value is independent of the other
pairs in the call (see the invariant in the C file), so cached and uncached runs agree bitwise.
Results differ from ``torch_ref`` by f32 summation order and, in bf16, by where values are
rounded to bf16 (the hidden activation once, the output once; tested within tolerance).

Quantized experts (FP8 e4m3 tensor/channel/block scales, GPTQ INT4, NVFP4, MXFP4) go through
``expert_pairs_cpu_quant`` over codes and scale tables packed by ``pack_quantized`` (layout:
``vllm/kernels/cpu/qgemm.h``, ``qgemm_fp4.h``), dequantized tile by tile inside the same GEMM:
each output equals the unquantized kernel's on the dequantized weights, bit for bit, except
under bf16 activations for FP8, INT4, NVFP4 and MXFP4 (``qgemm_codes.h``,
``qgemm_codes_fp4.h``): the codes' exact values run through the bf16 pair chain and the scales
multiply f32 accumulators per group, so no weight is rounded to bf16 (within f32 rounding of a
dequantize-then-matmul; still independent of the other pairs in the call). GPTQ act order is
packed as exllama / Marlin run it: each projection's input rows sorted by group
(``sort_groups``), the perm stored after the group tables (so it travels with its expert), and
the kernel gathers x[:, perm] before the GEMM, which then runs the plain group-wise chains (f32:
the unquantized kernel's bits on the dequantized weights in the sorted row order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm.kernels.cpu.graph import launch
from vllm.kernels.cpu.ops import KERNEL_DTYPES as _DTYPES
from vllm.kernels.cpu.ops import pack_fp4_codes, prepack
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation

_ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2, "relu2_no_mul": 3}


def expert_pairs_cpu(x: torch.Tensor, w13p: torch.Tensor, w2p: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                     activation: str | MoEActivation = "silu", b13: torch.Tensor | None = None,
                     b2: torch.Tensor | None = None) -> None:
    """The contract of ``torch_ref.expert_pairs_ref`` on packed weights: out[t, k] =
    w[t, k] * expert(x[t]) for pairs with 0 <= topk_ids < w13p.shape[0]; others untouched.
    x [T, K]; w13p [G, 2N*K] = prepack(w13); w2p [G, K*N] = prepack(w2); out [T, top_k, K];
    optional biases b13 [G, 2N], b2 [G, K] in x's dtype (w13p [G, N*K], b13 [G, N] for a
    non-gated activation)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("the cpu_kernel MoE backend cannot be traced by torch.compile: "
                           "use moe_backend='grouped_mm' for compiled graphs")
    dtype = x.dtype
    if w13p.dtype != dtype or w2p.dtype != dtype or out.dtype != dtype or dtype not in _DTYPES:
        raise TypeError(f"expert_pairs_cpu: x, w13, w2 and out must share one dtype in "
                        f"{sorted(map(str, _DTYPES))}; got {x.dtype}, {w13p.dtype}, {w2p.dtype}, "
                        f"{out.dtype}")
    if not out.is_contiguous():
        raise ValueError("expert_pairs_cpu: out must be contiguous")
    act = MoEActivation.of(activation)
    H = x.shape[-1]
    G, rows = w13p.shape[0], w13p.shape[-1] // max(H, 1)        # rows: 2N gated, N not
    N = rows // 2 if act.gated else rows
    if w13p.dim() != 2 or rows * H != w13p.shape[1] or (act.gated and rows % 2) or \
            tuple(w2p.shape) != (G, H * N):
        want = "2N*K" if act.gated else "N*K"
        raise ValueError(f"expert_pairs_cpu: shapes x {tuple(x.shape)}, w13p {tuple(w13p.shape)}, "
                         f"w2p {tuple(w2p.shape)} do not match [T, K], [G, {want}], [G, K*N]")
    T, top_k = topk_ids.shape
    if x.shape[0] != T or topk_weights.shape != topk_ids.shape or tuple(out.shape) != (T, top_k, H):
        raise ValueError(f"expert_pairs_cpu: x {tuple(x.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}, out "
                         f"{tuple(out.shape)} do not match [T, K], [T, top_k], [T, top_k, K]")
    b13, b2 = (_bias(b, (G, n), dtype, name) for b, n, name in
               ((b13, rows, "b13"), (b2, H, "b2")))
    x, w13p, w2p = x.contiguous(), w13p.contiguous(), w2p.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    rc = launch(
        "moe_expert_pairs", x.data_ptr(), w13p.data_ptr(), w2p.data_ptr(), wts.data_ptr(),
        ids.data_ptr(),
        out.data_ptr(), T, top_k, G, H, N, _DTYPES[dtype], _ACTIVATIONS[act.name],
        None if b13 is None else b13.data_ptr(), None if b2 is None else b2.data_ptr(),
        act.alpha, act.limit)
    if rc:
        raise MemoryError("expert_pairs_cpu: the kernel could not allocate its scratch")


def _bias(b: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
          name: str) -> torch.Tensor | None:
    """A bias the kernel can read in place: contiguous [G, n] in the kernel's dtype."""
    if b is None:
        return None
    if tuple(b.shape) != shape or b.dtype != dtype:
        raise ValueError(f"expert_pairs_cpu: {name} is {tuple(b.shape)} {b.dtype}, must be "
                         f"{list(shape)} {dtype}")
    return b.contiguous()


# ---- weight-only quantized experts: vllm/kernels/cpu/qgemm.h (FP8 e4m3, INT4 GPTQ), ----------
# qgemm_fp4.h (NVFP4, MXFP4).
# Design: the packed layout is what the expert cache's host store holds. The backend's ``pack``
# runs once per expert at store build (``prepare_expert``, after the method's post-load
# processing), so a cache miss stays a plain row copy of every expert tensor, the kernel reads
# slot rows and expert rows alike, and cached == uncached bit for bit. The store keeps the
# method's tensor names; their contents become the kernel's: codes (pair-interleaved bytes),
# f32 scale and zero-point tables [groups, columns] (FP4: the scale bytes as loaded, transposed
# to [groups, columns]; global scales as loaded), int32 group tables.
QTYPES = {"fp8": 0, "int4": 1, "nvfp4": 2, "mxfp4": 3}
FP4_KINDS = ("nvfp4", "mxfp4")
_MIN_SCALE = 2.0 ** -117
"""Smallest nonzero scale packed: |code * scale| >= 2^-126 then (qgemm.h's vcvtne2ps2bf16
flushes f32 subnormals)."""
_MIN_FP4_SCALE = 2.0 ** -125
"""FP4: the smallest nonzero effective scale of a group holding a nonzero code (|e2m1| >= 0.5,
so every nonzero weight is >= 2^-126)."""
ROLES = ("w13", "w2", "s13", "s2", "z13", "z2", "g13", "g2", "gs13", "gs2")
"""What the kernel reads: codes, scales, zero points, group tables, FP4 global scales of w13 and
w2."""


@dataclass(frozen=True)
class QuantLayout:
    """How a quant method's expert tensors become the kernel's (``cpu_kernel_layout()``)."""
    kind: str
    """"fp8" (e4m3 codes), "int4" (values 0..15, zero points), "nvfp4" (e2m1 codes, e4m3 scale
    bytes, global scales) or "mxfp4" (e2m1 codes, e8m0 scale bytes)."""
    names: dict[str, str]
    """Role (``ROLES``) -> the method's expert tensor name holding it after packing. fp8 has no
    z13/z2, and no g13/g2 when its groups are ``block_in`` rows (shared by all experts); FP4
    has s13/s2 (and nvfp4 gs13/gs2) besides the codes."""
    canonical: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    """One expert's tensors (method layout) -> role -> w13 uint8 [R, H], w2 uint8 [H, N] (codes,
    output rows first), s13 f32 [groups, R], s2 [groups, H] (scale of group g, column c), z13/z2
    likewise (int4), g13 int32 [2, H] (gate, up), g2 [1, N] (int4: GPTQ's g_idx; ``pack``
    sorts act order's rows by group and appends the perms: ``sort_groups``). FP4: s13/s2
    the scale bytes (e4m3 or uint8 e8m0) [groups, R] / [groups, H] of consecutive input groups,
    gs13 f32 [2] (gate, up) and gs2 [1] the global scales (nvfp4)."""
    block_in: int | None = None
    """fp8: input rows per scale group (128 for block scales); None: one group."""
    expert_dims: int = 2
    """Dims of one expert's w13 codes tensor in the method's layout (mxfp4's blocks: 3), which
    tells ``pack`` one expert from a stack."""

    @property
    def shared_groups(self) -> bool:
        """The kernel reads group tables that the backend makes, shared by all experts (fp8)."""
        return self.kind == "fp8"

    @property
    def codes_per_byte(self) -> int:
        return 1 if self.kind == "fp8" else 2


def pack_codes(codes: torch.Tensor, int4: bool) -> torch.Tensor:
    """uint8 codes [cols, n] -> the stream qgemm.h reads: gemm.h's column blocks with input-row
    pairs interleaved (fp8), or each pair in one byte, row 2p in the low nibble (int4)."""
    if not int4:
        return prepack(codes, pairs=True)
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 codes need an even input dim, got {codes.shape[-1]}")
    pairs = prepack(codes, pairs=True).view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()


def _check_fp4_scales(layout: QuantLayout, c: dict[str, torch.Tensor]) -> None:
    """Refuse scales the kernel cannot reproduce exactly: non-finite effective scales (the e4m3
    NaN code, e8m0 255) and, in groups holding a nonzero code, nonzero ones below 2^-125."""
    for p, rows in (("13", c["w13"].shape[0]), ("2", c["w2"].shape[0])):
        s = c[f"s{p}"]
        if layout.kind == "mxfp4":          # 2^(s - 127) as the kernel decodes it; 255: inf
            bits = (s.to(torch.int32) << 23) | (s == 0).to(torch.int32) * 0x400000
            eff = bits.view(torch.float32)
        else:
            g = c[f"gs{p}"].float()
            eff = s.float() * g.repeat_interleave(rows // g.numel())[None]
        codes = c[f"w{p}"]                                         # [cols, n], groups along n
        nonzero = (codes & 7).reshape(rows, s.shape[0], -1).amax(-1).t() > 0   # [groups, cols]
        bad = ~torch.isfinite(eff) | (nonzero & (eff != 0) & (eff.abs() < _MIN_FP4_SCALE))
        if bad.any():
            v = eff[bad][0].item()
            raise ValueError(f"{layout.names[f's{p}']} holds a scale of {v:.3g} (times its "
                             f"global scale): the cpu_kernel backend needs finite scales and, "
                             f"with nonzero codes, at least 2^-125 (its bf16 rounding would "
                             f"flush their products); use moe_backend='torch'")


def sort_groups(codes: torch.Tensor, g_idx: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ act order, as exllama and Marlin run it: codes [cols, n] and their g_idx [n] ->
    (codes with the input rows (columns here) in the order perm = argsort(g_idx, stable), the
    sorted g_idx, perm int32), so each group's rows are contiguous and the kernel runs its
    plain group-wise chains on x[:, perm]. A g_idx already in order (no act order) is left as
    it is, perm all -1 (the kernel gathers nothing: the same bits as before perms existed)."""
    g = g_idx.to(torch.int32)
    if g.numel() < 2 or bool((g[1:] >= g[:-1]).all()):
        return codes, g, torch.full_like(g, -1)
    perm = torch.argsort(g, stable=True)
    return codes[:, perm].contiguous(), g[perm].contiguous(), perm.to(torch.int32)


def pack_quantized(layout: QuantLayout, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's tensors (method layout) -> the same names holding the kernel's layout."""
    c = layout.canonical(tensors)
    if layout.kind in FP4_KINDS:
        _check_fp4_scales(layout, c)
        n = c["w13"].shape[0] // 2
        packed = {"w13": torch.cat([pack_fp4_codes(c["w13"][:n]), pack_fp4_codes(c["w13"][n:])]),
                  "w2": pack_fp4_codes(c["w2"])}
        packed |= {r: c[r].contiguous().reshape(-1) for r in ("s13", "s2", "gs13", "gs2")
                   if r in layout.names}
        return dict(tensors) | {layout.names[r]: t for r, t in packed.items()}
    int4 = layout.kind == "int4"
    for r in ("s13", "s2"):
        tiny = c[r][(c[r] != 0) & (c[r].abs() < _MIN_SCALE)]
        if tiny.numel():
            raise ValueError(f"{layout.names[r]} holds a scale of {tiny.abs().min().item():.3g}, "
                             f"below 2^-117: the cpu_kernel backend's bf16 rounding would flush "
                             f"its products; use moe_backend='torch'")
    n = c["w13"].shape[0] // 2
    halves = [c["w13"][:n], c["w13"][n:]]
    if int4:
        halves[0], g_gate, p_gate = sort_groups(halves[0], c["g13"][0])
        halves[1], g_up, p_up = sort_groups(halves[1], c["g13"][1])
        w2, g2, p2 = sort_groups(c["w2"], c["g2"][0])
        c = dict(c, w2=w2, g13=torch.stack([g_gate, g_up, p_gate, p_up]),
                 g2=torch.stack([g2, p2]))
    packed = {"w13": torch.cat([pack_codes(h, int4) for h in halves]),
              "w2": pack_codes(c["w2"], int4)}
    packed |= {r: c[r].to(torch.float32).reshape(-1).contiguous() for r in ("s13", "s2", "z13", "z2")
               if r in layout.names}
    packed |= {r: c[r].to(torch.int32).contiguous() for r in ("g13", "g2") if r in layout.names}
    out = dict(tensors)
    out.update({layout.names[r]: t for r, t in packed.items()})
    return out


def _packed_groups(layout: QuantLayout, w: dict[str, torch.Tensor],
                   groups: tuple[torch.Tensor, torch.Tensor] | None, G: int, H: int, N: int,
                   R: int) -> tuple[int, int]:
    """(ng13, ng2): scale groups per input dim of w13 / w2, after checking the packed shapes."""
    ng13, ng2 = w["s13"].shape[-1] // R, w["s2"].shape[-1] // H
    ok = tuple(w["w13"].shape) == (G, R * H // layout.codes_per_byte) and ng13 and ng2 and \
        w["s13"].shape == (G, ng13 * R) and w["s2"].shape == (G, ng2 * H)
    if layout.kind in FP4_KINDS:
        gs13, gs2 = H // max(ng13, 1), N // max(ng2, 1)
        ok = ok and not (H % 16 or N % 16 or gs13 * ng13 != H or gs2 * ng2 != N or gs13 % 2 or
                         gs2 % 2)
        for r, shape in (("gs13", (G, R // N)), ("gs2", (G, 1))):
            t = w.get(r)
            ok = ok and (t is None or (tuple(t.shape) == shape and t.dtype == torch.float32))
    else:
        g13, g2 = (w["g13"], w["g2"]) if groups is None else groups
        ok = ok and g13.shape[-1] == H and g2.shape[-1] == N
    if not ok:
        raise ValueError(f"expert_pairs_cpu_quant: packed codes {tuple(w['w13'].shape)}, "
                         f"{tuple(w['w2'].shape)}, scales {tuple(w['s13'].shape)}, "
                         f"{tuple(w['s2'].shape)} do not fit H={H}, N={N} ({layout.kind})")
    return ng13, ng2


def _group_stride(g13: torch.Tensor | None, g2: torch.Tensor | None, per_expert: bool) -> int:
    """The kernel's gstride: 0 shared group tables (fp8; FP4 reads none), 1 per expert g13
    [G, 2, H], g2 [G, 1, N], 2 per expert with act order's perms after the groups (int4 as
    ``pack_quantized`` packs it: g13 [G, 4, H] gate, up groups then gate, up perms; g2
    [G, 2, N])."""
    if not per_expert:
        return 0
    rows13, rows2 = g13.shape[-2] if g13.dim() > 1 else 1, g2.shape[-2] if g2.dim() > 1 else 1
    if rows13 not in (2, 4) or rows2 != rows13 // 2:
        raise ValueError(f"expert_pairs_cpu_quant: group tables {tuple(g13.shape)}, "
                         f"{tuple(g2.shape)} are neither [G, 2, H], [G, 1, N] nor (with act "
                         f"order's perms) [G, 4, H], [G, 2, N]")
    return rows13 // 2


def expert_pairs_cpu_quant(x: torch.Tensor, layout: QuantLayout, w: dict[str, torch.Tensor],
                           shared_groups: tuple[torch.Tensor, torch.Tensor] | None,
                           topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                           activation: MoEActivation, b13: torch.Tensor | None = None,
                           b2: torch.Tensor | None = None) -> None:
    """``expert_pairs_cpu`` on quantized experts: ``w`` role -> [G, ...] packed tensors
    (``pack_quantized`` rows); ``shared_groups`` (g13 [2, H], g2 [1, N]) when the layout has
    shared group tables (fp8). FP4 reads no group tables; its global scales (gs13, gs2) take the
    kernel's zero-point arguments."""
    if torch.compiler.is_compiling():
        raise RuntimeError("the cpu_kernel MoE backend cannot be traced by torch.compile")
    dtype, H = x.dtype, x.shape[-1]
    T, top_k = topk_ids.shape
    G, N = w["w2"].shape[0], w["w2"].shape[-1] * layout.codes_per_byte // max(H, 1)
    R = N * (2 if activation.gated else 1)
    if dtype not in _DTYPES or out.dtype != dtype or not out.is_contiguous() or \
            tuple(out.shape) != (T, top_k, H) or x.shape[0] != T or N == 0:
        raise ValueError(f"expert_pairs_cpu_quant: x {tuple(x.shape)} {x.dtype}, out "
                         f"{tuple(out.shape)} {out.dtype}, codes {tuple(w['w2'].shape)} do not "
                         f"fit [T, K] f32/bf16, [T, top_k, K] contiguous")
    ng13, ng2 = _packed_groups(layout, w, shared_groups, G, H, N, R)
    fp4 = layout.kind in FP4_KINDS
    g13, g2 = (None, None) if fp4 else (w["g13"], w["g2"]) if shared_groups is None \
        else shared_groups
    z13, z2 = (w.get("gs13"), w.get("gs2")) if fp4 else (w.get("z13"), w.get("z2"))
    b13, b2 = (_bias(b, (G, m), dtype, name) for b, m, name in ((b13, R, "b13"), (b2, H, "b2")))
    x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    ptr = lambda t: None if t is None else t.data_ptr()            # noqa: E731
    rc = launch(
        "moe_expert_pairs_quant", x.data_ptr(), w["w13"].data_ptr(),
        w["w2"].data_ptr(), w["s13"].data_ptr(), w["s2"].data_ptr(), ptr(z13), ptr(z2),
        ptr(g13), ptr(g2), wts.data_ptr(), ids.data_ptr(), out.data_ptr(), T, top_k,
        G, H, N, _DTYPES[dtype], _ACTIVATIONS[activation.name], ptr(b13), ptr(b2),
        activation.alpha, activation.limit, QTYPES[layout.kind], ng13, ng2,
        _group_stride(g13, g2, shared_groups is None and not fp4))
    if rc == -2:
        raise ValueError(f"expert_pairs_cpu_quant: the kernel refused qtype {layout.kind} with "
                         f"H={H}, N={N}, {ng13} / {ng2} scale groups")
    if rc:
        raise MemoryError("expert_pairs_cpu_quant: the kernel could not allocate its scratch")
