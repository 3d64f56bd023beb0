"""The "cutlass_w4a16" MoE expert backend: GPTQ INT4 experts (scheme ``w4a16-gptq``, bf16
activations) on CUTLASS's SM90 mixed-input grouped GEMM (``csrc/moe/w4a16_moe_mm.cu``, reached
through ``platform_for("cuda").w4a16_moe_ops()``: ``vllm/kernels/cuda/ops.py``). Not yet
passed on a GPU: on an H100 (2026-11-26) the compiled op equalled its torch stand-in, but the
backend's gpu test failed (a test-helper device bug, fixed since, not re-run). Never chosen by
"auto": only ``moe_backend="cutlass_w4a16"`` selects it.

Layout (``pack``, per expert, so the expert cache's host store and slots hold it as is). The
expert cache requires ``pack`` to keep the scheme's tensor names, so the packed tensors take the
names of the GPTQ tensors they replace (``PACKED``):
  w13_qweight -> q4 uint8 [2N, H/2]: q = u - 8 as a signed nibble (u ^ 8), k even in the low
                 nibble (the kernel's ``w``); w2_qweight -> [H, N/2]
  w13_scales  -> s4 bf16 [G13, 2N] (the kernel's ``scales``); w2_scales -> [G2, H]
  w*_qzeros   as loaded, unread: symmetric GPTQ only (every zero point 8, so the weight is
                 (u - 8) * scale = q * scale). CUTLASS 4.2's grouped mixed-input collective
                 does not set up the scale tensormap in its zero-point mode (w4a16_moe_mm.cu),
                 so asymmetric checkpoints are refused.
  w*_g_idx    int32, each row the projection's input permutation (w13 [2, H], both rows the
                 same; w2 [1, N]): act order only, else as loaded and unread.
Group sizes: a layer's ``group_size`` over each projection's input (w13 over H, w2 over N); -1,
or a size >= the input, is one group over the whole input. The kernel takes K or a multiple of
64 (``W4A16_TILE_K``) that divides K.
Act order (``desc_act``: g_idx a permutation of groups) runs as plain groups, as exllama and
Marlin run it: ``pack`` sorts each expert's input columns by group (a stable argsort of g_idx,
kept in g_idx's place), and each pair's activations are gathered by its expert's permutation
before the GEMM, so groups are contiguous runs of ``group_size`` columns again. Gate and up read
the same input, so they must share one permutation (GPTQ orders both by the same Hessian
diagonal); halves that differ are refused.

Pairs: the T * top_k (token, k) pairs are sorted by id (stable; ids -1 first, in no group), so
group g (an expert, or a cache slot) is rows [off[g], off[g + 1]), off = searchsorted of the
sorted ids; x is gathered into that order, the two grouped GEMMs and the activation run on it,
each row is scaled by its router weight (float32, then bf16), and scattered back to pair order.
Pairs with id -1 keep what ``out`` held (a ``torch.where``), so the cache's waves share ``out``.
No host read of device data: capturable in a CUDA graph. The kernel's workspace (it depends on
the group count only) is one buffer per device shared by every layer, grown outside captures.
"""
from __future__ import annotations

import torch

from vllm.kernels.cuda.ops import W4A16_TILE_K, W4A16MoEOps
from vllm.model_executor.layers.fused_moe.modular_kernel import (MoEActivation, MoEExperts,
                                                                 MoEKernelQuery)
from vllm.model_executor.layers.fused_moe.workspace import SharedWorkspace
from vllm.platforms import platform_for

CUTLASS_W4A16_SCHEME = "w4a16-gptq"
CUTLASS_W4A16_SM = 90
ASYM_REASON = ("CUTLASS 4.2's grouped mixed-input GEMM does not set up its scale tensormap "
               "when zero points are given (its example 69: 'Zero-points ... not supported'); "
               "use 'triton' or 'torch'")
BUILD_HINT = ("vllm._C was built without the CUTLASS W4A16 grouped GEMM (it needs the "
              "nvidia-cutlass headers and 9.0a among the CUDA architectures, e.g. "
              "TORCH_CUDA_ARCH_LIST=9.0a: pip install nvidia-cutlass, then rebuild; "
              "docs/build.md)")
PACKED = {"q": "qweight", "s": "scales"}
"""Role of a packed tensor -> the GPTQ tensor name (w13_/w2_ prefixed) it is stored under."""


def cutlass_w4a16_refusal(q: MoEKernelQuery) -> str | None:
    """The registry's extra check: SM 90, 64-aligned sizes, and the compiled op."""
    cap = q.platform.get_device_capability()
    sm = cap.to_int() if cap is not None else None
    if sm != CUTLASS_W4A16_SM:
        where = f"SM {sm}" if sm is not None else "a device without a compute capability"
        return (f"it runs on SM {CUTLASS_W4A16_SM} only (CUTLASS's SM90 mixed-input grouped "
                f"GEMM), not {where}")
    for what, v in (("hidden_size", q.hidden_size), ("intermediate_size", q.intermediate_size)):
        if v % W4A16_TILE_K:
            return f"it needs {what} a multiple of {W4A16_TILE_K}, not {v}"
    if q.platform.w4a16_moe_ops() is None:
        return BUILD_HINT
    return None


# ---- the layout ----------------------------------------------------------------------------
def _check_group_size(group_size: int) -> None:
    if group_size != -1 and group_size % W4A16_TILE_K:
        raise ValueError(f"moe_backend='cutlass_w4a16' cannot run gptq group_size={group_size}: "
                         f"the kernel takes -1 (the whole input) or a multiple of "
                         f"{W4A16_TILE_K}; use 'triton' or 'torch'")


def effective_group_size(group_size: int, k: int) -> int:
    """The kernel's ``group_size`` for a projection of input size ``k``: k for one group."""
    if group_size == -1 or group_size >= k:
        return k
    _check_group_size(group_size)
    if k % group_size:
        raise ValueError(f"moe_backend='cutlass_w4a16' cannot run gptq group_size={group_size} "
                         f"over an input of {k}: the group must divide it; use 'triton' or "
                         "'torch'")
    return group_size


def group_order(g_idx: torch.Tensor, group_size: int, act_order: bool,
                name: str) -> torch.Tensor | None:
    """g_idx [halves, K] -> the permutation [K] that makes every group a contiguous run of
    ``group_size`` columns (None: already in order). Refused: halves with different orders, a
    group of another size, and a permuted g_idx in a layer without ``desc_act``."""
    g = g_idx.long().cpu()
    k = g.shape[-1]
    want = torch.arange(k) // effective_group_size(group_size, k)
    if torch.equal(g, want.expand_as(g)):
        return None
    if not act_order:
        raise ValueError(f"moe_backend='cutlass_w4a16': {name} is permuted (act order) but the "
                         "checkpoint's quantization config says desc_act=false")
    if not (g == g[0]).all():
        raise ValueError(f"moe_backend='cutlass_w4a16' cannot run {name}: gate and up have "
                         "different act-order permutations (one gather per GEMM); use 'triton' "
                         "or 'torch'")
    perm = g[0].argsort(stable=True)
    if not torch.equal(g[0][perm], want):
        raise ValueError(f"moe_backend='cutlass_w4a16' cannot run {name}: its groups are not "
                         f"all of {effective_group_size(group_size, k)} columns; use 'triton' "
                         "or 'torch'")
    return perm


def signed_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint4 values u [R, K] (0..15, any int dtype) -> uint8 [R, K/2]: q = u - 8 as a two's
    complement nibble (u ^ 8), k even in the low nibble."""
    q = (u.to(torch.uint8) ^ 8).reshape(u.shape[0], -1, 2)
    return q[..., 0] | (q[..., 1] << 4)


def _pack_expert(method, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's GPTQ layer tensors (2-D) -> the packed ones (the module docstring)."""
    values = method._kernel_tensors(t)          # q [R, C] uint8, s/z [G, R] f32, zero w/ offset
    out = dict(t)
    for p in ("w13", "w2"):
        g_idx = t[f"{p}_g_idx"]
        perm = group_order(g_idx, method.group_size, method.desc_act, f"{p}_g_idx")
        if perm is not None:                    # act order: columns sorted by group
            values[p] = values[p][:, perm]
        if method.desc_act:                     # the permutation the activations are gathered by
            order = perm if perm is not None else torch.arange(g_idx.shape[-1])
            out[f"{p}_g_idx"] = order.to(g_idx.device, torch.int32).expand_as(g_idx).contiguous()
        if not (values[f"z{p[1:]}"] == 8).all():
            raise ValueError(f"moe_backend='cutlass_w4a16' runs symmetric GPTQ only (every zero "
                             f"point 8), and {p}_qzeros holds others: {ASYM_REASON}")
        # The kernel's scale type is its MMA type (bf16): GPTQ's f16 scales are rounded to bf16.
        out[f"{p}_{PACKED['q']}"] = signed_nibbles(values[p])
        out[f"{p}_{PACKED['s']}"] = values[f"s{p[1:]}"].to(torch.bfloat16).contiguous()
    return out


def pack_gptq_for_cutlass(method, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPTQ layer tensors, one expert (w13_qweight 2-D) or stacked [E, ...], -> the kernel's
    layout under the same names (``PACKED``), per expert. Values come from the method's
    ``_kernel_tensors`` (its ``unpacked_weight``), so repacking subclasses work too."""
    for p in ("w13", "w2"):                      # refuse early: before any expert is packed
        effective_group_size(method.group_size, tensors[f"{p}_g_idx"].shape[-1])
    if tensors["w13_qweight"].dim() == 2:
        return _pack_expert(method, tensors)
    per = [_pack_expert(method, {n: v[e] for n, v in tensors.items()})
           for e in range(tensors["w13_qweight"].shape[0])]
    return {n: torch.stack([p[n] for p in per]) for n in per[0]}


def gather_columns(a: torch.Tensor, perms: torch.Tensor, slot: torch.Tensor,
                   rows: int = 1024) -> torch.Tensor:
    """a [P, K], perms int32 [G, K], slot [P] -> out[r, j] = a[r, perms[slot[r], j]], in chunks
    of ``rows`` rows so the int64 index stays small (a fixed split of P: capturable)."""
    out = torch.empty_like(a)
    for r0 in range(0, a.shape[0], rows):
        idx = perms.index_select(0, slot[r0:r0 + rows]).long()                  # [rows, K]
        out[r0:r0 + rows] = a[r0:r0 + rows].gather(1, idx)
    return out


_WORKSPACE = SharedWorkspace("cutlass_w4a16")


# ---- the backend ---------------------------------------------------------------------------
class CutlassW4A16Experts(MoEExperts):
    """GPTQ INT4 experts on the CUTLASS W4A16 grouped GEMM (module docstring); not yet
    passed on a GPU. ``ops``: the compiled op and its workspace size (default: the CUDA
    platform's), or a stand-in with the same contract (tests)."""
    name = "cutlass_w4a16"
    cuda_graph_safe = True    # sorted pairs and group offsets stay on the device; one workspace

    def __init__(self, activation: MoEActivation, ops: W4A16MoEOps | None = None):
        if not activation.gated:
            raise ValueError(f"moe_backend='cutlass_w4a16' runs gated activations only, not "
                             f"{activation.name!r}")
        self.activation = activation
        self.ops = ops if ops is not None else platform_for("cuda").w4a16_moe_ops()
        if self.ops is None:
            raise ValueError(f"moe_backend='cutlass_w4a16': {BUILD_HINT}")
        self.method = None
        self.group_size = -1
        self.act_order = False
        self._ws_bytes: dict[tuple[int, torch.device], int] = {}

    def bind_scheme(self, method) -> None:
        """Called once by the quant method after selection: symmetric GPTQ, groups the kernel
        takes."""
        if method.scheme != CUTLASS_W4A16_SCHEME:
            raise ValueError(f"moe_backend='cutlass_w4a16' runs {CUTLASS_W4A16_SCHEME} only, not "
                             f"{method.scheme}")
        if not method.sym:
            raise ValueError(f"moe_backend='cutlass_w4a16' cannot run asymmetric gptq (sym=False, "
                             f"zero points): {ASYM_REASON}")
        _check_group_size(method.group_size)
        self.method, self.group_size = method, method.group_size
        self.act_order = bool(method.desc_act)

    def pack(self, tensors):
        if self.method is None:
            raise RuntimeError("cutlass_w4a16: pack before bind_scheme")
        return pack_gptq_for_cutlass(self.method, tensors)

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        T, K = ids.shape
        if T == 0:
            return
        if x.dtype != torch.bfloat16:
            raise ValueError(f"cutlass_w4a16 runs bfloat16 activations only, not {x.dtype}")
        q13, q2 = (weights[f"{p}_{PACKED['q']}"] for p in ("w13", "w2"))
        G, H = q13.shape[0], x.shape[-1]
        workspace = self._workspace(G, x.device)
        sorted_ids, order = torch.sort(ids.reshape(-1).long(), stable=True)     # -1s first
        offsets = torch.searchsorted(sorted_ids, torch.arange(G + 1, device=x.device))
        xs = x.index_select(0, order // K)                                     # [P, H]
        slot = sorted_ids.clamp(min=0)                                         # [P]
        if self.act_order:
            xs = gather_columns(xs, weights["w13_g_idx"][:, 0], slot)
        h13 = self._mm(weights, "w13", xs, q13.shape[1], offsets, workspace)   # [P, 2N]
        act = self.activation(h13).contiguous()                                # [P, N]
        if self.act_order:
            act = gather_columns(act, weights["w2_g_idx"][:, 0], slot)
        h2 = self._mm(weights, "w2", act, q2.shape[1], offsets, workspace)     # [P, H]
        wts = topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(-1)
        res = torch.empty_like(h2).index_copy_(0, order, (h2.float() * wts).to(x.dtype))
        # Rows of id -1 were never written: keep what earlier waves wrote there.
        out.copy_(torch.where((ids >= 0).unsqueeze(-1), res.view(T, K, H), out))

    def _mm(self, weights, p: str, a: torch.Tensor, rows: int, offsets: torch.Tensor,
            workspace: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM of projection ``p`` over the sorted rows ``a`` [P, k] -> [P, rows];
        rows outside [off[0], off[G]) (the id -1 pairs) are left as allocated."""
        d = torch.empty(a.shape[0], rows, dtype=torch.bfloat16, device=a.device)
        self.ops.mm(a, weights[f"{p}_{PACKED['q']}"], weights[f"{p}_{PACKED['s']}"], d, offsets,
                    effective_group_size(self.group_size, a.shape[1]), workspace)
        return d

    def _workspace(self, G: int, device: torch.device) -> torch.Tensor:
        key = (G, device)
        if key not in self._ws_bytes:           # the size query is host work: once per layer
            self._ws_bytes[key] = int(self.ops.workspace_bytes(G, device))
        return _WORKSPACE.get(device, self._ws_bytes[key])
